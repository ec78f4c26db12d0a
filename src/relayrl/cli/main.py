"""Command line: `relayrl train | export | check-trace | report | runs | bench ...`.

Invariant: the exit code and the one `error:` line follow the error's kind (relayrl/errors.py).
Bad input (a `UserError`: config key, file, value, task data, reward or environment entry, model
path, run directory, a refused resume, a bad checkpoint; or a file the command cannot read while
checking its input) prints one line naming what and where and exits 2. A run that fails for a
reason the user can act on (a `RunFailed`: a failed reward call under task.strict_rewards,
function and trajectory; a reward worker that cannot start; a non-finite loss,
train.on_nonfinite / train.max_consecutive_skips, the step; every group filtered,
orchestrator.max_filtered_per_step, the step and the reasons; a trajectory that cannot be
packed) or is stopped by a file-system error (disk full: path and errno) prints one line and
exits 1. Anything else (a stall, the last sampler replica retired, an environment's error, a
bug: a plain ValueError included, while building the run too) prints one line naming the
exception and exits 1, its traceback kept in RUN_DIR/error.txt (in a temporary file, named in the
line, when the command has no run directory it may write). A run stopped by Ctrl-C (exit 130) or
SIGTERM (exit 143) is cancelled cleanly (summary "cancelled"), or ends at once if it cannot wind
down within orchestrator.stop_grace_s; a run that fails or stops names the checkpoint to resume
from (unless resuming cannot help). A failed check (check-trace: a violated rule) exits 1. Nothing
else is printed as an error.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar, cast

import typer
from rich.console import Console

from relayrl.cli.signals import exit_on_signals
from relayrl.config.schema import Config, load_config
from relayrl.errors import RunFailed, UserError
from relayrl.recipes import default_recipe

if TYPE_CHECKING:
    from relayrl.orchestrator.program import Program
    from relayrl.telemetry.progress import ProgressPrinter

T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="relayrl: asynchronous RL post-training for language models.")
bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")

out = Console(highlight=False, soft_wrap=True)
ERROR_FILE = "error.txt"  # in the run directory: the traceback of a run that failed unexpectedly


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(help="Recipe TOML (default: the shipped default recipe).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a key: section.key=value (repeatable).")] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="sim | local")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Run the samplers and the trainer as Ray actors (= --set ray.enabled=true).")] = False,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue RUN_DIR from its newest checkpoint (with its config.toml and any --set).")
    ] = None,
) -> None:
    """Run a training recipe and write its run directory, or resume one (--resume RUN_DIR)."""

    from relayrl.config.extras import check_extras

    overrides = list(set_ or [])
    if backend is not None:
        overrides.append(f"run.backend={backend}")
    if ray:
        overrides.append("ray.enabled=true")
    try:  # everything a user can get wrong is checked here, before the run starts
        if resume is not None:
            if config is not None:
                _fail("give either a recipe or --resume RUN_DIR (a resumed run uses RUN_DIR/config.toml)")
            _resumable_or_fail(resume)
            cfg = load_config(resume / "config.toml", overrides)
        else:
            cfg = load_config(config or default_recipe(), overrides)
        check_extras(cfg)  # a missing optional package: one line naming its extra, before any import of it
    except (UserError, OSError) as exc:
        _fail(_one_line(exc))

    from relayrl.orchestrator.build import build_program, run_dir_for
    from relayrl.telemetry.progress import ProgressPrinter

    run_dir = resume if resume is not None else run_dir_for(cfg)
    try:
        progress = ProgressPrinter(cfg.run.steps, out)
        program = build_program(cfg, [progress], run_dir, resume=resume is not None)
    except (UserError, OSError) as exc:  # config, task data, reward names, model path, run directory, checkpoint
        _fail(_one_line(exc))
    except Exception as exc:  # a bug while building the run: one line, traceback kept, exit 1
        _unexpected(exc, _build_traceback(run_dir, exc, resume is not None))
    done = program.start_step  # steps are numbered from 1: a resume goes on after step `done`
    if done:
        out.print(
            f"relayrl: resuming after step {done} (next: step {done + 1} of {cfg.run.steps}) on the {cfg.run.backend} backend → {run_dir}"
        )
    else:
        out.print(f"relayrl: {cfg.run.steps} steps on the {cfg.run.backend} backend → {run_dir}")
    if cfg.task.agent is None:
        _train_run(cfg, program, progress, run_dir)
        return
    from relayrl.agents.leftovers import Leftovers

    before = Leftovers.now()
    code: int | None = None  # None: a bug escaped the run (main() says it and exits)
    try:
        _train_run(cfg, program, progress, run_dir)
        code = 0
    except typer.Exit as stop:
        code = stop.exit_code
        raise
    finally:  # what the run's agents left running: named, its processes ended, its threads not waited for
        before.end(code)


def _train_run(cfg: Config, program: Program, progress: ProgressPrinter, run_dir: Path) -> None:
    """Run `program` to its end and say how it ended (see `train`)."""
    import asyncio

    from relayrl.cli.signals import Stopped, run_until_stopped

    try:
        result = asyncio.run(run_until_stopped(program, cfg.orchestrator.stop_grace_s, lambda: _resume_hint(run_dir, cfg)))
    except UserError as exc:  # a bad checkpoint found while restoring it
        progress.close()
        _fail(_one_line(exc))
    except RunFailed as exc:  # a reward under strict_rewards, no reward worker, a non-finite step, every group filtered, ...
        progress.close()
        if not exc.resumable:  # e.g. every group filtered (orchestrator.max_filtered_per_step): resuming would not help
            _fail(_one_line(exc), 1)
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        _stopped(run_dir, cfg, 1)
    except OSError as exc:  # disk full, ...
        progress.close()
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        _stopped(run_dir, cfg, 1)
    except Stopped as stop:  # Ctrl-C (130) or SIGTERM (143), e.g. a scheduler preempting the job
        progress.close()
        _stopped(run_dir, cfg, stop.code)
    except Exception as exc:  # a stall (StallError), a failed worker, an environment's error, a bug: one line, traceback kept
        progress.close()
        print(f"error: {type(exc).__name__}: {_one_line(exc)}{_keep_traceback(run_dir, exc)}", file=sys.stderr)
        _stopped(run_dir, cfg, 1)
    finally:
        progress.close()
    s = result.summary
    acc = ""
    if s.get("accuracy_before") is not None and s.get("accuracy_after") is not None:
        acc = f", held-out accuracy {s['accuracy_before']:.3f} → {s['accuracy_after']:.3f}"
    out.print(
        f"done: {s['steps_completed']} steps in {s['wall_time_s']:.1f}s, {s['samples_per_s']:.1f} samples/s, "
        f"trainer busy {s['trainer_busy_fraction']:.1%}{acc}; run directory {run_dir}"
    )
    if result.model_dir is not None and (result.model_dir / "adapter_config.json").is_file():  # train.lora
        out.print(
            f"model: {result.model_dir} (a LoRA adapter: PeftModel.from_pretrained on the base model; "
            f"relayrl export {run_dir} --merged writes the merged model)"
        )
    elif result.model_dir is not None:
        out.print(f"model: {result.model_dir} (a Hugging Face model directory: AutoModelForCausalLM.from_pretrained, or --set model.path=)")


def _resumable_or_fail(run_dir: Path) -> None:
    """A --resume of a directory that does not exist, or of a run stopped before it wrote its
    config (e.g. Ctrl-C while Ray started): one line saying there is nothing to resume, exit 2."""
    if not run_dir.is_dir():
        _fail(f"nothing to resume: run directory {run_dir} does not exist")
    if not (run_dir / "config.toml").is_file():
        _fail(f"nothing to resume: the run in {run_dir} stopped before its first step (no config.toml); start it again without --resume")


def _one_line(exc: BaseException) -> str:
    """An error as one line; an OSError names its path and errno first."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror} (errno {exc.errno}, {errno.errorcode.get(exc.errno or 0, '?')})"
    return " ".join(str(exc).split("\n"))


def _unexpected(exc: BaseException, kept: str) -> NoReturn:
    """An error no handler expects (a bug, a plain ValueError included): one line naming its type
    and saying where its traceback is (`kept`); exit 1."""
    print(f"error: {type(exc).__name__}: {_one_line(exc)}{kept}", file=sys.stderr)
    raise typer.Exit(1)


def _keep_traceback(run_dir: Path, exc: BaseException) -> str:
    """Write `exc`'s traceback to RUN_DIR/error.txt (whole or not at all); say where it is."""
    import traceback

    path = run_dir / ERROR_FILE
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
        tmp.replace(path)
    except OSError:  # e.g. the disk is full: no empty error.txt.tmp is left behind
        tmp.unlink(missing_ok=True)
        return ""
    return f" (traceback in {path})"


def _keep_traceback_elsewhere(exc: BaseException) -> str:
    """Write `exc`'s traceback to a new temporary file (a command without a run directory of its
    own to write); say where it is."""
    import tempfile
    import traceback

    try:
        fd, name = tempfile.mkstemp(prefix="relayrl-error-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(traceback.format_exception(exc)))
    except OSError:
        return ""
    return f" (traceback in {name})"


def _build_traceback(run_dir: Path, exc: BaseException, resume: bool) -> str:
    """Keep the traceback of a run that failed while being built, in RUN_DIR/error.txt when
    RUN_DIR is this run's: the one resumed, one this process claimed (its marker names this
    process), or none yet (created here as a relayrl run directory, which a fresh run with
    run.overwrite replaces); under the directory's lock. Never in a directory that holds another
    run's files, is in use or is not relayrl's: then in a temporary file."""
    from relayrl.rundir.lock import RunDirLock

    if resume or _claimed_here(run_dir) or _empty_or_missing(run_dir):
        lock = RunDirLock(run_dir)
        try:
            lock.acquire(adopt=resume)
        except (UserError, OSError):  # in use by another run, not relayrl's, cannot be created
            pass
        else:
            try:
                kept = _keep_traceback(run_dir, exc)
            finally:
                lock.release()
            if kept:
                return kept
    return _keep_traceback_elsewhere(exc)


def _claimed_here(run_dir: Path) -> bool:
    """Whether `run_dir`'s marker names this process (it locked the directory for this run)."""
    import socket

    from relayrl.rundir.lock import MARKER

    try:
        info = json.loads((run_dir / MARKER).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname()


def _empty_or_missing(run_dir: Path) -> bool:
    try:
        return not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir()))
    except OSError:
        return False


def _resume_hint(run_dir: Path, cfg: Config) -> str:
    from relayrl.rundir.checkpoint import CHECKPOINTS, complete_checkpoints

    newest = complete_checkpoints(run_dir / CHECKPOINTS)
    if newest:
        return (
            f"; continue after step {int(newest[-1].name.removeprefix('step-'))} ({newest[-1].name}) with: relayrl train --resume {run_dir}"
        )
    if cfg.orchestrator.checkpoint_every:
        return " before its first checkpoint"
    return " (no checkpoints: orchestrator.checkpoint_every is 0)"


def _stopped(run_dir: Path, cfg: Config, code: int) -> NoReturn:
    print(f"stopped{_resume_hint(run_dir, cfg)}", file=sys.stderr)
    raise typer.Exit(code)


@app.command("check-trace")
def check_trace(run_dir: Annotated[Path, typer.Argument(help="Run directory (or trace.json).")]) -> None:
    """Verify step-boundary rules 1–6 and the staleness bound from a run's trace."""
    from relayrl.analysis.checker import check_run_dir

    try:
        report = check_run_dir(run_dir)
    except (OSError, UserError) as exc:  # no trace, an unreadable one, or one that is not a trace (TraceError)
        _fail(_one_line(exc))
    if not report.ok:
        more = f" (+{len(report.violations) - 1} more)" if len(report.violations) > 1 else ""
        print(f"violation: {report.violations[0]}{more}", file=sys.stderr)
        raise typer.Exit(1)
    state = "completed" if report.completed else "not completed (partial trace)"
    out.print(f"ok: {report.steps} committed steps, run {state}; rules 1–6 and staleness hold")


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="Run directory (finished, running or crashed).")]) -> None:
    """Write report.html and PNG plots into a run directory."""
    from relayrl.analysis.report import write_report

    try:
        path = write_report(run_dir)
    except (OSError, UserError) as exc:  # not a run directory, a trace.json that is not a trace (TraceError), a write error
        _fail(_one_line(exc))
    out.print(f"wrote {path}")


@app.command()
def runs(root: Annotated[Path, typer.Argument(help="Folder holding run directories.")] = Path("runs")) -> None:
    """List run directories with their key figures (a plain table, whole values, when piped)."""
    from relayrl.analysis.runlist import list_runs, runs_cells, runs_text

    found = list_runs(root)
    if not found:
        out.print(f"no runs under {root}")
        return
    if not sys.stdout.isatty():  # a pipe or a file: whole values, no terminal-width cut
        sys.stdout.write(runs_text(found))
        return
    from rich.table import Table

    header, *rows = runs_cells(found)
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    out.print(table)


@app.command("plan")
def plan(
    run_dirs: Annotated[list[Path], typer.Argument(help="RUN_DIR (the measured run); with --check: RUN_A RUN_B.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Change a key of the planned run: section.key=value (repeatable).")
    ] = None,
    sweep: Annotated[str | None, typer.Option("--sweep", help="KEY=V1,V2,...: a prediction per value, a table and plan-sweep.png.")] = None,
    scale: Annotated[
        list[str] | None, typer.Option("--scale", help="WORK=FACTOR: train, generate, sync, checkpoint, host, metrics.")
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Predict RUN_B from RUN_A; print the errors; write RUN_B/plan-check.json.")
    ] = False,
    seeds: Annotated[int, typer.Option("--seeds", help="Predicted runs per configuration.")] = 3,
    steps: Annotated[int | None, typer.Option("--steps", help="Steps of each predicted run (default: the config's run.steps).")] = None,
    model: Annotated[Path | None, typer.Option("--model", help="An (edited) plan-model.json to use instead of fitting.")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Where plan-model.json and plan-sweep.png go (default: RUN_DIR).")] = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Predict a run from a measured one (docs/design.md, "Planning a run")."""
    from relayrl.plan.command import PlanOptions, check_text, plan_check, plan_sweep, plan_text
    from relayrl.plan.command import plan as run_plan

    if len(run_dirs) != (2 if check else 1):
        _fail("give RUN_A RUN_B with --check" if check else "give one RUN_DIR (two only with --check)")
    opts = PlanOptions(list(set_ or []), list(scale or []), seeds, steps, model, out_dir)
    try:
        if check:
            result = plan_check(run_dirs[0], run_dirs[1], opts)
        elif sweep is not None:
            result = plan_sweep(run_dirs[0], sweep, opts)
        else:
            result = run_plan(run_dirs[0], opts)
    except (UserError, OSError) as exc:  # a missing or foreign run directory, a bad key, --scale or model file
        _fail(_one_line(exc))
    if as_json:
        print(json.dumps(result))
        return
    if check:
        out.print(f"{run_dirs[1]} predicted from {run_dirs[0]}:", markup=False)
        out.print(check_text(result), end="", markup=False)
        out.print(f"wrote {result['check_file']}", markup=False)
    elif sweep is not None:
        out.print(str(result["table"]), end="", markup=False)
        out.print(f"wrote {result['png']}", markup=False)
    else:
        out.print(plan_text(result), end="", markup=False)
    if result.get("model_file"):
        out.print(f"model: {result['model_file']}", markup=False)


@app.command("export")
def export(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of a local-backend run with checkpoints.")],
    step: Annotated[int | None, typer.Option("--step", help="The checkpoint after step N (default: the newest).")] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Output directory (default: RUN_DIR/model, or RUN_DIR/model-step-N for an older step; "
            "with --merged RUN_DIR/model-merged[-step-N]).",
        ),
    ] = None,
    merged: Annotated[
        bool, typer.Option("--merged", help="A LoRA run: write the model with the adapter merged in, not the adapter (PEFT format).")
    ] = False,
) -> None:
    """Write a checkpoint's policy as a Hugging Face model directory (config.json,
    model.safetensors, tokenizer files, generation_config.json); a LoRA run's as its adapter in
    PEFT format (adapter_config.json, adapter_model.safetensors), or merged with --merged."""
    from relayrl.config.extras import LOCAL_BACKEND_MODULES, require
    from relayrl.models.export import export_run, run_config

    try:
        cfg = run_config(run_dir)
        if cfg.run.backend == "local":
            for module in LOCAL_BACKEND_MODULES:
                require(module, "local", "relayrl export")
        exported = export_run(run_dir, step=step, out=out_dir, merged=merged)
    except UserError as exc:  # no run, a sim run, no checkpoint, a missing step, an --out that is not an export, the model
        _fail(_one_line(exc))
    except OSError as exc:  # e.g. disk full while writing
        _fail(_one_line(exc), 1)
    note = " (loaded from GGUF, written as safetensors)" if exported.gguf else ""
    what = "a LoRA adapter (PEFT format) on" if exported.adapter else "a Hugging Face model of"
    if exported.adapter and exported.gguf:
        note = f" (its base written as a Hugging Face directory in {exported.directory / 'base'})"
    replaced = " (replacing the previous export there)" if exported.replaced else ""
    out.print(f"wrote {exported.directory}{replaced}: the policy after step {exported.step}, {what} {exported.source}{note}")


def _bench(run: Callable[[], T], as_json: bool) -> T:
    """Run a benchmark; with --json print its figures as one object and stop there."""
    try:
        figures = run()
    except UserError as exc:  # a bad --set or recipe
        _fail(_one_line(exc))
    if as_json:
        print(json.dumps(figures))
        raise typer.Exit(0)
    return figures


@bench_app.command("boundary")
def bench_boundary(
    steps: int = typer.Option(6, help="Steps per configuration."),
    time_scale: float = typer.Option(1.0, help="Multiply every simulated cost (e.g. 0.1 for a quick run)."),
    set_: Annotated[list[str] | None, typer.Option("--set", help='Extra override for both runs, e.g. telemetry.sinks=["wandb"].')] = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Inline vs overlapped step boundary on the seed's large-model cost profile."""
    from relayrl.bench.suite import run_boundary

    figures = _bench(lambda: run_boundary(steps=steps, time_scale=time_scale, extra=list(set_ or [])), as_json)
    for label in ("inline", "overlapped"):
        f = figures[label]
        assert isinstance(f, dict)
        out.print(
            f"{label:<11} gap median {f['gap_median_s'] * 1e3:9.2f} ms   trainer busy {f['busy_fraction']:6.1%}   "
            f"step median {f['step_time_median_s']:.3f} s   loop lag max {f['loop_lag_max_ms']:7.1f} ms"
        )
    out.print(f"ratio (overlapped / inline gap): {figures['ratio']:.4f}")


@bench_app.command("control-plane")
def bench_control_plane(
    steps: int = typer.Option(40, help="Steps (1,024 trajectories each)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Trajectories/s through the whole pipeline with zero-latency sim workers, on one core."""
    from relayrl.bench.suite import run_control_plane

    figures = _bench(lambda: run_control_plane(steps=steps), as_json)
    out.print(
        f"{figures['trajectories']} trajectories in {figures['wall_s']:.2f} s on {figures['cores']} core(s): "
        f"{figures['trajectories_per_s']:,.0f} trajectories/s"
    )


@bench_app.command("e2e")
def bench_e2e(
    steps: int = typer.Option(8, help="Steps per configuration."),
    recipe: Annotated[Path | None, typer.Option(help="Recipe (default: the shipped default recipe).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Extra override for every configuration.")] = None,
    repeats: int = typer.Option(1, help="Run A, B, C round-robin this many times; print medians."),
    ray: bool = typer.Option(False, "--ray", help="Add (D): C on Ray actors, on a local cluster started once for D."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The shortened default recipe: (A) synchronous + inline bookkeeping, (B) synchronous +
    overlapped bookkeeping, (C) the default; with --ray also (D) C on Ray actors."""
    from relayrl.bench.suite import E2E_RAY_TARGETS, run_e2e

    figures = _bench(lambda: run_e2e(steps=steps, recipe=recipe, extra=list(set_ or []), repeats=repeats, ray=ray), as_json)
    for label, f in figures.items():
        out.print(
            f"({label}) {f['samples_per_s']:8.1f} completions/s   trainer busy {f['trainer_busy']:6.1%}   "
            f"sampler busy {f['sampler_busy']:6.1%}   gap median {f['gap_median_s'] * 1e3:8.2f} ms   "
            f"exposed bookkeeping {f['exposed_bookkeeping_s']:.3f} s"
        )
    out.print(f"completions/s ratio C/A: {figures['C']['samples_per_s'] / figures['A']['samples_per_s']:.2f}")
    if "D" in figures:
        d, t = figures["D"], E2E_RAY_TARGETS
        ratio = d["samples_per_s"] / figures["C"]["samples_per_s"]

        def mark(ok: bool) -> str:
            return "ok" if ok else "MISSED"

        out.print(f"completions/s ratio D/C: {ratio:.2f} (target >= {t['d_over_c']})  {mark(ratio >= t['d_over_c'])}")
        out.print(
            f"(D) gap median {d['gap_median_s'] * 1e3:.2f} ms (target <= {t['gap_median_s'] * 1e3:.0f} ms)  "
            f"{mark(d['gap_median_s'] <= t['gap_median_s'])}   trainer busy {d['trainer_busy']:.1%} "
            f"(target >= {t['trainer_busy']:.0%})  {mark(d['trainer_busy'] >= t['trainer_busy'])}"
        )


@bench_app.command("agent")
def bench_agent(
    steps: int = typer.Option(8, help="Steps per run."),
    repeats: int = typer.Option(1, help="Run agent, env round-robin this many times; print medians."),
    set_: Annotated[list[str] | None, typer.Option("--set", help="Extra override for both runs.")] = None,
    model: str = typer.Option("tiny", help="The model every configuration runs: tiny (the recipe's) or smollm2."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Agent mode (the example "draft, then answer" agent through the endpoint) beside the
    multi-turn environment path (`draft_answer`) on the agent recipe's task: samples/s and ratio."""
    from relayrl.bench.agents import AGENT_MODELS, run_agent

    if model not in AGENT_MODELS:
        _fail(f"--model {model!r}: one of {', '.join(AGENT_MODELS)}")
    figures = _bench(lambda: run_agent(steps=steps, repeats=repeats, extra=list(set_ or []), model=model), as_json)
    out.print(f"model: {model}")
    names = {"agent": f"agent processes {figures['agent_processes']}", "loop": "on the run's loop", "env": "draft_answer"}
    for label in ("agent", "loop", "env"):
        f = figures[label]
        assert isinstance(f, dict)
        out.print(
            f"({label:<5}) {f['samples_per_s']:7.1f} samples/s   trainer busy {f['trainer_busy']:6.1%}   "
            f"sampler busy {f['sampler_busy']:6.1%}   sampling calls/step {f['sampling_calls_per_step']:5.1f}   "
            f"wall {f['wall_s']:.1f} s   ({names[label]})"
        )
        out.print(
            f"        CPU a step {f['cpu_s_per_step']:.3f} s: the run's process {f['cpu_run_s_per_step']:.3f} s, "
            f"agent processes {f['cpu_agents_s_per_step']:.3f} s; {f['cpu_busy']:.0%} of the {figures['cores']} cores busy"
        )
    met = "met" if figures["met"] else "MISSED"
    out.print(
        f"samples/s ratio agent/env: {figures['ratio']:.2f} (target >= {figures['target']})  {met}   (loop/env {figures['loop_ratio']:.2f})"
    )
    bound = cast(float, figures["cpu_bound_ratio"])
    agent, env = cast(dict[str, float], figures["agent"]), cast(dict[str, float], figures["env"])
    out.print(
        f"work bound, where the CPU is the limit (cores busy: agent {agent['cpu_busy']:.0%}, env {env['cpu_busy']:.0%}): "
        f"the same samples a step on the same cores, agent/env cannot exceed their CPU a step's ratio, "
        f"{bound:.2f} (the ratio reached {cast(float, figures['ratio']) / bound:.2f} of it)"
    )
    for key, where in (("endpoint", "agents on the run's loop"), ("endpoint_processes", "agents in 2 processes")):
        e = figures[key]
        assert isinstance(e, dict)
        out.print(
            f"endpoint without the model, {where} (one step's 128 episodes, 256 calls, a sampler that answers at once): "
            f"{e['wall_ms_per_call']:.2f} ms wall, {e['cpu_ms_per_call']:.2f} ms CPU of the run's process per call; "
            f"{e['sampling_calls_per_round']:.1f} sampling calls per step"
        )


@bench_app.command("collate")
def bench_collate(
    repeats: int = typer.Option(5, help="Timed collations per case and path (after one warm-up); the median is printed."),
    scale: float = typer.Option(1.0, help="Shorten every prompt and completion by this factor (0, 1] (a quick run)."),
    device: str = typer.Option("cpu", help="Where the trainer's own mask build is timed (mask_ms): cpu or cuda[:N]."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Collation of packed micro-batches of about 3k, 6k and 11k tokens with shared prompts: the
    current path (segment and branch ids) beside the old one (a dense L x L mask built on the
    driver), measured in the same run: tokens, collate_ms, batch_bytes."""
    from relayrl.bench.collate import run_collate

    figures = _bench(lambda: run_collate(repeats=repeats, scale=scale, device=device), as_json)
    out.print(
        f"micro-batches of 2 rows, each one prompt shared by 4 completions; median of {repeats} collations; "
        f"the trainer's mask build on {figures['device']}"
    )
    for case in cast(list[dict[str, Any]], figures["cases"]):
        new, old = case["new"], case["old"]
        out.print(
            f"{case['name']:>4}: {case['tokens']:6,} tokens ({case['tokens_unshared']:,} unshared), rows of {case['length']:,}   "
            f"new {new['collate_ms']:8.1f} ms {new['batch_bytes'] / 2**20:7.2f} MiB (mask on the trainer {new['mask_ms']:7.1f} ms)   "
            f"old {old['collate_ms']:8.1f} ms {old['batch_bytes'] / 2**20:7.2f} MiB   "
            f"({old['collate_ms'] / max(new['collate_ms'], 1e-9):.0f}x faster, {old['batch_bytes'] / new['batch_bytes']:.0f}x fewer bytes)"
        )
    target = cast(float, figures["target_11k_ms"])
    largest = cast(list[dict[str, Any]], figures["cases"])[-1]
    if scale == 1.0:
        ok = largest["new"]["collate_ms"] <= target
        out.print(f"{largest['name']}: {largest['new']['collate_ms']:.1f} ms (target <= {target:.0f} ms)  {'ok' if ok else 'MISSED'}")


@bench_app.command("engines")
def bench_engines(
    repeats: int = typer.Option(2, help="Timed generate calls per engine (after one warm-up)."),
    versions: int = typer.Option(3, help="Weight versions loaded per engine."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The same rollout load through the hf engine and the vLLM engine (where the vllm extra is
    installed), on the tiny model and a random ~40M Qwen2: start-up, tokens/s, weight load per
    version; "hf-before" is the hf engine's old decode loop, the same-run baseline of "hf"."""
    from relayrl.bench.engines import ENGINE_MODELS, run_engines

    figures = _bench(lambda: run_engines(repeats=repeats, versions=versions), as_json)
    for name in ENGINE_MODELS:
        f = cast(dict[str, Any], figures[name])
        prompts, samples, tokens = f["load"]
        eos = ", EOS never drawn" if name == "tiny-decode" else ""
        out.print(f"{name}: {prompts} prompts x {samples} samples x <= {tokens} tokens, temperature 1{eos}, one compute thread")
        for engine in ("hf-before", "hf", "vllm"):
            if engine not in f:
                why = "not measured under this load" if name == "tiny-decode" else "not installed (the vllm extra)"
                out.print(f"  {engine:<9} {why}: left out")
                continue
            e = f[engine]
            out.print(
                f"  {engine:<9} {e['tokens_per_s']:9,.0f} tokens/s   weight load {e['weight_load_s'] * 1e3:8.1f} ms per version   "
                f"start-up {e['startup_s']:6.1f} s"
            )
        out.print(f"  hf decode loop, after/before tokens/s: {f['hf']['tokens_per_s'] / f['hf-before']['tokens_per_s']:.2f}")
        if "vllm" in f:
            out.print(f"  vllm/hf tokens/s: {f['vllm']['tokens_per_s'] / f['hf']['tokens_per_s']:.2f}")


@bench_app.command("weights")
def bench_weights(
    models: str = typer.Option("tiny,qwen2-52m,qwen2-0.5b", help="Comma-separated models: tiny, qwen2-52m, qwen2-0.5b."),
    replicas: int = typer.Option(2, min=1, help="Sampler replicas each version is loaded into (Ray: sampler actors)."),
    versions: int = typer.Option(3, min=1, help="Timed versions per model and transport (after one warm-up); the median is printed."),
    dtype: str = typer.Option("bfloat16", help="The models' dtype: bfloat16 or float32."),
    ray: bool = typer.Option(True, "--ray/--no-ray", help="Include the Ray transports (object_store, collective) on a local cluster."),
    sharded: bool = typer.Option(True, "--sharded/--no-sharded", help="Include a 2-rank trainer's collective: gathered vs streamed."),
    vllm: bool = typer.Option(
        False, "--vllm", help="Include real vLLM engines, in this process and (--ray) in Ray sampler actors (needs vLLM: .venv-vllm)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Every weight transport (rollout.weight_transport) side by side: one version = the trainer's
    commit snapshot loaded into every replica; bytes, seconds and GB/s per version and host copies
    (bytes staged in host memory per version's bytes), on the tiny model, a random 52M Qwen2 and a
    random Qwen2.5-0.5B-shaped Qwen2 (nothing downloaded)."""
    from relayrl.bench.weight_models import WEIGHT_MODELS
    from relayrl.bench.weights import run_weights

    names = [m.strip() for m in models.split(",") if m.strip()]
    if not names or any(m not in WEIGHT_MODELS for m in names):
        _fail(f"--models {models!r}: give models among {', '.join(WEIGHT_MODELS)}, separated by commas")
    if dtype not in ("bfloat16", "float32"):
        _fail(f"--dtype {dtype!r}: bfloat16 or float32")
    if vllm and importlib.util.find_spec("vllm") is None:
        _fail("--vllm: vLLM is not installed here (bash scripts/setup.sh --vllm, then run .venv-vllm/bin/relayrl)")
    figures = _bench(
        lambda: run_weights(names, replicas=replicas, versions=versions, dtype=dtype, ray=ray, sharded=sharded, vllm=vllm), as_json
    )
    out.print(
        f"one version = export + {replicas} replicas loaded, {dtype}, one compute thread per process; "
        f"median of {versions} versions (after one warm-up)"
    )
    for name, f in cast(dict[str, dict[str, Any]], figures["models"]).items():
        out.print(f"{name}: export {f['export_bytes'] / 2**20:,.1f} MiB (unique parameters {f['unique_param_bytes'] / 2**20:,.1f} MiB)")
        for transport, t in cast(dict[str, dict[str, float]], f["transports"]).items():
            out.print(
                f"  {transport:<25} {t['bytes_per_version'] / 2**20:9,.1f} MiB/version  {t['seconds_per_version']:8.3f} s/version  "
                f"{t['gb_per_s']:7.3f} GB/s  host copies {t['host_copies']:.1f}"
                + (f"  rank 0 peak {t['rank0_peak_bytes'] / 2**20:,.1f} MiB" if "rank0_peak_bytes" in t else "")
            )
    target = cast(dict[str, Any], figures["target"])
    if "met" in target:
        out.print(
            f"{target['model']}, {target['replicas']} Ray sampler actors: collective {target['speedup']:.2f}x the object store "
            f"(target >= {target['collective_over_object_store']:.0f}x)  {'met' if target['met'] else 'MISSED'}"
        )
    else:
        out.print(f"target (collective >= 2x object_store on {target['model']}, 2 Ray sampler actors): not measured in this run")


@bench_app.command("trainer")
def bench_trainer(
    world_size: str = typer.Option("1,2", "--world-size", help="Comma-separated rank counts (train.world_size)."),
    steps: int = typer.Option(3, help="Steps per configuration (the first warms up)."),
    model: str = typer.Option("50m", help="Random Qwen2 size: 50m or tiny."),
    device: str = typer.Option("cpu", help="cpu (gloo) or cuda (NCCL, rank r on cuda:r)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The sharded trainer at each world size on a random Qwen2 (no download): tokens/s, and per
    rank the peak RSS and the shard's parameter and AdamW bytes (~1/N of the whole)."""
    from relayrl.bench.trainer import MODELS, run_trainer

    try:
        sizes = [int(x) for x in world_size.split(",") if x.strip()]
    except ValueError:
        _fail(f"--world-size {world_size!r}: give rank counts separated by commas, e.g. 1,2")
    if not sizes or min(sizes) < 1 or model not in MODELS:
        _fail(f"--world-size {world_size!r} / --model {model!r}: rank counts >= 1 and a model among {', '.join(MODELS)}")
    if device not in ("cpu", "cuda"):
        _fail(f"--device {device!r}: cpu or cuda")
    figures = _bench(lambda: run_trainer(sizes, model=model, steps=max(2, steps), device=device), as_json)
    load = cast(dict[str, Any], figures["load"])
    params = cast(int, figures["params"])
    out.print(
        f"random Qwen2 {figures['model']}: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB fp32, AdamW state twice that); "
        f"{load['steps']} steps of {load['microbatches']} micro-batches x {load['row_tokens']} tokens, "
        f"{load['threads_per_rank']} thread per rank"
    )
    configs = cast(list[dict[str, Any]], figures["configs"])
    base = configs[0]
    for c in configs:
        n = c["world_size"]
        ranks = c["ranks"]
        rss = max(r["peak_rss_bytes"] for r in ranks) / 2**20
        shard = max(r["param_bytes"] + r["optim_bytes"] for r in ranks)
        whole = params * 4 * 3
        out.print(
            f"world_size {n}: {c['tokens_per_s']:8,.0f} tokens/s "
            f"({c['tokens_per_s'] / base['tokens_per_s']:.2f}x world_size {base['world_size']})   "
            f"peak RSS per rank {rss:7,.0f} MiB   shard params+AdamW {shard / 2**20:6,.0f} MiB = {shard / whole:.2f} of the whole   "
            f"start-up {c['startup_s']:.1f} s"
        )


@bench_app.command("weight-sync")
def bench_weight_sync(
    replicas: int = typer.Option(2, help="Sampler actors that load each version."),
    versions: int = typer.Option(3, help="Timed versions per model and format (after the warm-up versions)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Weight-sync bandwidth on a local Ray cluster: one version from the trainer actor into N
    sampler actors, as numpy arrays and (baseline) as pickled torch tensors."""
    from relayrl.bench.suite import WEIGHT_SYNC_MODELS, WEIGHT_SYNC_TARGET_GBPS, run_weight_sync

    figures = _bench(lambda: run_weight_sync(replicas=replicas, versions=versions), as_json)
    for name in WEIGHT_SYNC_MODELS:
        f = cast(dict[str, Any], figures[name])
        out.print(f"{name}: {f['params'] / 1e6:.1f} M parameters, {f['bytes'] / 1e6:.1f} MB per version, {replicas} replica(s)")
        for mode in ("numpy", "tensors"):
            m = f[mode]
            out.print(
                f"  {mode:<8} {m['s_per_version'] * 1e3:9.1f} ms per version   {m['gb_per_s']:7.3f} GB/s   "
                f"(export + put {m['export_s'] * 1e3:.1f} ms; first version {m['first_s_per_version'] * 1e3:.1f} ms, "
                f"{m['warmup_versions']} warm-up)"
            )
        out.print(f"  ratio numpy/tensors (GB/s): {f['ratio_numpy_over_tensors']:.1f}")
    big = cast(dict[str, Any], figures["qwen2-50m"])["numpy"]["gb_per_s"]
    verdict = "ok" if big >= WEIGHT_SYNC_TARGET_GBPS else "MISSED"
    out.print(f"qwen2-50m numpy: {big:.2f} GB/s (target >= {WEIGHT_SYNC_TARGET_GBPS} GB/s on one node)  {verdict}")


@bench_app.command("ray-scale")
def bench_ray_scale(
    steps: int = typer.Option(16, help="Steps per max_staleness (the control-plane run takes 4x as many)."),
    replicas: int = typer.Option(8, help="Sampler actors."),
    time_scale: float = typer.Option(0.5, help="Multiply every simulated cost (1.0 = the seed's large-model profile)."),
    set_: Annotated[list[str] | None, typer.Option("--set", help="Extra override for every run.")] = None,
    interruptible: bool = typer.Option(
        False, "--interruptible", help="Also run each max_staleness with rollout.interruptible and print both side by side."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Scale by simulation: sim workers on a local Ray cluster, sampler replicas with heavy-tailed
    (lognormal) generation latency and the seed's large-model trainer costs, at max_staleness 1
    and 2, plus the control plane's trajectories/s on Ray (every simulated cost zero)."""
    from relayrl.bench.suite import RAY_SCALE_STALENESS, RAY_SCALE_TARGET_BUSY, run_ray_scale

    figures = _bench(
        lambda: run_ray_scale(steps=steps, replicas=replicas, time_scale=time_scale, extra=list(set_ or []), interruptible=interruptible),
        as_json,
    )
    out.print(
        f"{replicas} sampler replicas, {steps} steps per run, time scale {time_scale:g} "
        f"(cluster started in {cast(float, figures['cluster_start_s']):.1f} s, not counted)"
    )
    for s in RAY_SCALE_STALENESS:
        f = cast(dict[str, float], figures[f"max_staleness_{s}"])
        out.print(
            f"max_staleness {s}: trainer busy {f['trainer_busy']:6.1%}   staleness mean {f['staleness_mean']:.2f}, "
            f"max {f['staleness_max']:.0f}   {f['completions_per_s']:6.1f} completions/s"
        )
        out.print(
            f"  exposed generation per step after the first: mean {f['exposed_generation_mean_s'] * 1e3:.1f} ms, "
            f"max {f['exposed_generation_max_s'] * 1e3:.1f} ms (step 0: {f['exposed_generation_first_s']:.2f} s)   "
            f"sync round mean {f['sync_round_mean_s']:.2f} s, max {f['sync_round_max_s']:.2f} s"
        )
    cp = cast(dict[str, float], figures["control_plane"])
    out.print(
        f"control plane (every simulated cost zero): {cp['trajectories']:.0f} trajectories in {cp['wall_s']:.2f} s: "
        f"{cp['trajectories_per_s']:,.0f} trajectories/s"
    )
    busy = cast(dict[str, float], figures[f"max_staleness_{max(RAY_SCALE_STALENESS)}"])["trainer_busy"]
    verdict = "ok" if busy >= RAY_SCALE_TARGET_BUSY else "MISSED"
    out.print(f"trainer busy at max_staleness {max(RAY_SCALE_STALENESS)}: {busy:.1%} (target >= {RAY_SCALE_TARGET_BUSY:.0%})  {verdict}")
    if interruptible:
        _print_interruptible(figures)


def _print_interruptible(figures: dict[str, object]) -> None:
    """`bench ray-scale --interruptible`: the waiting and the interruptible runs side by side."""
    from relayrl.bench.suite import (
        RAY_SCALE_INTERRUPTIBLE_BUSY_STALENESS,
        RAY_SCALE_STALENESS,
        RAY_SCALE_TARGET_BUSY,
        RAY_SCALE_TARGET_SYNC_MEAN_S,
    )

    out.print("sync rounds: waiting for running generations vs rollout.interruptible (loads between decode steps)")
    out.print(f"  {'':<18}{'waiting':<48}interruptible")
    for s in RAY_SCALE_STALENESS:
        runs = [cast(dict[str, float], figures[f"max_staleness_{s}{tail}"]) for tail in ("", "_interruptible")]
        cells = [
            f"round mean {f['sync_round_mean_s']:.3f} s, max {f['sync_round_max_s']:.3f} s, busy {f['trainer_busy']:.1%}" for f in runs
        ]
        out.print(f"  {f'max_staleness {s}':<18}{cells[0]:<48}{cells[1]}")
        stale = [f"staleness mean {f['staleness_mean']:.2f}, max {f['staleness_max']:.0f}" for f in runs]
        out.print(f"  {'':<18}{stale[0]:<48}{stale[1]}")
    s = RAY_SCALE_INTERRUPTIBLE_BUSY_STALENESS
    i = cast(dict[str, float], figures[f"max_staleness_{s}_interruptible"])
    rounds = max(cast(dict[str, float], figures[f"max_staleness_{t}_interruptible"])["sync_round_mean_s"] for t in RAY_SCALE_STALENESS)
    verdict = "ok" if rounds <= RAY_SCALE_TARGET_SYNC_MEAN_S else "MISSED"
    out.print(
        f"interruptible sync round mean (worst max_staleness): {rounds:.3f} s (target <= {RAY_SCALE_TARGET_SYNC_MEAN_S} s)  {verdict}"
    )
    verdict = "ok" if i["trainer_busy"] >= RAY_SCALE_TARGET_BUSY else "MISSED"
    out.print(
        f"interruptible trainer busy at max_staleness {s}: {i['trainer_busy']:.1%} (target >= {RAY_SCALE_TARGET_BUSY:.0%})  {verdict}"
    )
    bounds = cast(dict[str, float], figures["oldest_token_bound"])
    out.print(
        "  the workload's bound with the orchestration free, a trajectory's staleness its oldest token's: "
        + ", ".join(f"{b:.1%} at max_staleness {t}" for t, b in bounds.items())
    )


@bench_app.command("plan")
def bench_plan(
    steps: int = typer.Option(30, help="Steps of every real run (source and targets)."),
    seeds: int = typer.Option(2, help="Predicted runs per configuration."),
    change: Annotated[list[str] | None, typer.Option("--change", help="Only these changes (labels of the table).")] = None,
    ray: bool = typer.Option(False, "--ray", help="Source and targets on Ray actors (a local cluster)."),
    keep: Annotated[Path | None, typer.Option("--keep", help="Keep the real runs in this folder (default: a temporary one).")] = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """`relayrl plan` checked: calibrated from one default-recipe torch run, predict runs changing
    one thing each, run them, print predicted vs measured (targets: samples/s within 15%, trainer
    busy within 5 points)."""
    from relayrl.plan.bench import bench_text, run_plan_bench

    figures = _bench(lambda: run_plan_bench(steps=steps, seeds=seeds, changes=change, ray=ray, keep=keep), as_json)
    out.print(bench_text(figures), end="", markup=False)


@bench_app.command("soak")
def bench_soak(
    steps: int = typer.Option(2000, help="Steps of the long sim run (at least 20)."),
    time_scale: float = typer.Option(0.01, help="Multiply the boundary profile's simulated costs."),
    set_: Annotated[list[str] | None, typer.Option("--set", help="Extra override, e.g. orchestrator.release_memory=false.")] = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """A long sim run (release_memory on): do memory, threads, fds, tasks, step time or memory
    release time grow with the number of steps?"""
    from relayrl.bench.suite import SOAK_TARGETS, run_soak

    f = _bench(lambda: run_soak(steps=steps, time_scale=time_scale, extra=list(set_ or [])), as_json)

    def fig(key: str) -> float:
        return float(cast(float, f[key]))

    def mark(ok: bool) -> str:
        return "ok" if ok else "OVER TARGET"

    drift, step_ratio, rel_ratio = fig("rss_drift_fraction"), fig("step_time_ratio"), fig("release_time_ratio")
    out.print(
        f"{f['steps']} steps in {fig('wall_s'):.1f} s "
        f"(warm-up {f['warmup_steps']} steps; first/last = median of the first/last 10% after it)"
    )
    out.print(
        f"step time      {fig('step_time_first_s') * 1e3:8.2f} ms -> {fig('step_time_last_s') * 1e3:8.2f} ms   "
        f"ratio {step_ratio:.3f} (target <= {SOAK_TARGETS['step_time_ratio']})  {mark(step_ratio <= SOAK_TARGETS['step_time_ratio'])}"
    )
    out.print(
        f"release_memory {fig('release_time_first_s') * 1e3:8.2f} ms -> {fig('release_time_last_s') * 1e3:8.2f} ms   "
        f"ratio {rel_ratio:.3f} (target <= {SOAK_TARGETS['release_time_ratio']})  {mark(rel_ratio <= SOAK_TARGETS['release_time_ratio'])}"
    )
    out.print(
        f"RSS            {fig('rss_start_mb'):8.1f} MB -> {fig('rss_end_mb'):8.1f} MB   "
        f"drift {drift:+.1%} (target <= {SOAK_TARGETS['rss_drift_fraction']:.0%})  {mark(drift <= SOAK_TARGETS['rss_drift_fraction'])}"
    )
    for label, key in (("threads", "threads"), ("open fds", "fds"), ("asyncio tasks", "tasks")):
        a, b = f[f"{key}_start"], f[f"{key}_end"]
        out.print(f"{label:<14} {a!s:>8}    -> {b!s:>8}      (target: constant)  {mark(a == b)}")


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    exit_on_signals()  # until a run starts: exit at once, never a traceback from an import
    try:
        app()
    except Exception as exc:  # a bug no command handled (outside a run): one line, the traceback kept in a file
        print(f"error: {type(exc).__name__}: {_one_line(exc)}{_keep_traceback_elsewhere(exc)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
