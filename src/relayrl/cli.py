"""Command line: `relayrl train | check-trace | report | runs | bench ...`.

Invariant: bad input (config key, file, value) prints one line naming what and where and exits 2;
a failed check exits 1; a run stopped by Ctrl-C (exit 130) or SIGTERM (exit 143) is cancelled
cleanly (summary "cancelled") and names the checkpoint to resume from; nothing else is printed as
an error.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional, TypeVar

import typer
from rich.console import Console

from relayrl.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from relayrl.program import Program, RunResult

T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="relayrl: asynchronous RL post-training for language models.")
bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")

out = Console(highlight=False, soft_wrap=True)


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def default_recipe() -> Path:
    return Path(str(resources.files("relayrl") / "recipes" / "default.toml"))


@app.command()
def train(
    config: Annotated[Optional[Path], typer.Argument(help="Recipe TOML (default: the shipped default recipe).")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a key: section.key=value (repeatable).")] = [],
    backend: Annotated[Optional[str], typer.Option("--backend", help="sim | local")] = None,
    resume: Annotated[
        Optional[Path], typer.Option("--resume", help="Continue RUN_DIR from its newest checkpoint (with its config.toml and any --set).")
    ] = None,
) -> None:
    """Run a training recipe and write its run directory, or resume one (--resume RUN_DIR)."""
    import asyncio

    from relayrl.checkpoint import CheckpointError
    from relayrl.packing import PackingError
    from relayrl.run import build_program, run_dir_for
    from relayrl.telemetry.progress import ProgressPrinter

    overrides = list(set_)
    if backend is not None:
        overrides.append(f"run.backend={backend}")
    try:  # everything a user can get wrong is checked here, before the run starts
        if resume is not None:
            if config is not None:
                _fail("give either a recipe or --resume RUN_DIR (a resumed run uses RUN_DIR/config.toml)")
            cfg = load_config(resume / "config.toml", overrides)
            run_dir = resume
        else:
            cfg = load_config(config or default_recipe(), overrides)
            run_dir = run_dir_for(cfg)
        progress = ProgressPrinter(cfg.run.steps, out)
        program = build_program(cfg, [progress], run_dir, resume=resume is not None)
    except (ValueError, FileNotFoundError) as exc:  # config, task data, reward names, model path
        _fail(str(exc))
    start = f"from step {program.start_step} " if program.start_step else ""
    out.print(f"relayrl: {cfg.run.steps} steps {start}on the {cfg.run.backend} backend → {run_dir}")
    try:
        result = asyncio.run(_run_until_terminated(program))
    except (PackingError, CheckpointError) as exc:  # a trajectory longer than train.row_tokens; a bad checkpoint
        _fail(str(exc))
    except KeyboardInterrupt:  # Ctrl-C
        progress.close()
        _stopped(run_dir, cfg, 130)
    except _Terminated:  # SIGTERM (e.g. a scheduler preempting the job)
        progress.close()
        _stopped(run_dir, cfg, 143)
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


class _Terminated(Exception):
    """The run was cancelled because the process received SIGTERM."""


async def _run_until_terminated(program: Program) -> RunResult:
    """The run, cancelled cleanly on SIGTERM as on Ctrl-C: its summary says "cancelled", its trace
    is closed and no task or worker thread is left. Only the first SIGTERM cancels; a
    CancelledError that no signal caused propagates as the bug it is."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        if not terminated:
            terminated = True
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (NotImplementedError, RuntimeError):  # no signal handlers on this platform / thread
        return await program.run()
    try:
        return await program.run()
    except asyncio.CancelledError:
        if terminated:
            raise _Terminated() from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _stopped(run_dir: Path, cfg: Config, code: int) -> NoReturn:
    from relayrl.checkpoint import CHECKPOINTS, complete_checkpoints

    newest = complete_checkpoints(run_dir / CHECKPOINTS)
    if newest:
        hint = f"; continue from {newest[-1].name} with: relayrl train --resume {run_dir}"
    elif cfg.orchestrator.checkpoint_every:
        hint = " before its first checkpoint"
    else:
        hint = " (no checkpoints: orchestrator.checkpoint_every is 0)"
    print(f"stopped{hint}", file=sys.stderr)
    raise typer.Exit(code)


@app.command("check-trace")
def check_trace(run_dir: Annotated[Path, typer.Argument(help="Run directory (or trace.json).")]) -> None:
    """Verify step-boundary rules 1–6 and the staleness bound from a run's trace."""
    from relayrl.telemetry.checker import check_run_dir

    try:
        report = check_run_dir(run_dir)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    if not report.ok:
        more = f" (+{len(report.violations) - 1} more)" if len(report.violations) > 1 else ""
        print(f"violation: {report.violations[0]}{more}", file=sys.stderr)
        raise typer.Exit(1)
    state = "completed" if report.completed else "not completed (partial trace)"
    out.print(f"ok: {report.steps} committed steps, run {state}; rules 1–6 and staleness hold")


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="Run directory (finished, running or crashed).")]) -> None:
    """Write report.html and PNG plots into a run directory."""
    from relayrl.telemetry.report import write_report

    try:
        path = write_report(run_dir)
    except FileNotFoundError as exc:
        _fail(str(exc))
    out.print(f"wrote {path}")


@app.command()
def runs(root: Annotated[Path, typer.Argument(help="Folder holding run directories.")] = Path("runs")) -> None:
    """List run directories with their key figures."""
    from rich.table import Table

    from relayrl.telemetry.report import format_value, list_runs

    found = list_runs(root)
    if not found:
        out.print(f"no runs under {root}")
        return
    columns = {"name": "run", "status": "status", "steps": "steps", "wall_time_s": "wall s", "samples_per_s": "samples/s",
               "trainer_busy_fraction": "busy", "accuracy_before": "acc before", "accuracy_after": "acc after", "reward_last": "reward"}
    table = Table(*columns.values())
    for run in found:
        table.add_row(*(format_value(run.get(key)) for key in columns))
    out.print(table)


def _bench(run: Callable[[], T], as_json: bool) -> T:
    """Run a benchmark; with --json print its figures as one object and stop there."""
    try:
        figures = run()
    except ConfigError as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(figures))
        raise typer.Exit(0)
    return figures


@bench_app.command("boundary")
def bench_boundary(
    steps: int = typer.Option(6, help="Steps per configuration."),
    time_scale: float = typer.Option(1.0, help="Multiply every simulated cost (e.g. 0.1 for a quick run)."),
    set_: Annotated[list[str], typer.Option("--set", help="Extra override for both runs, e.g. telemetry.sinks=[\"wandb\"].")] = [],
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Inline vs overlapped step boundary on the seed's large-model cost profile."""
    from relayrl.bench import run_boundary

    figures = _bench(lambda: run_boundary(steps=steps, time_scale=time_scale, extra=list(set_)), as_json)
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
    from relayrl.bench import run_control_plane

    figures = _bench(lambda: run_control_plane(steps=steps), as_json)
    out.print(
        f"{figures['trajectories']} trajectories in {figures['wall_s']:.2f} s on {figures['cores']} core(s): "
        f"{figures['trajectories_per_s']:,.0f} trajectories/s"
    )


@bench_app.command("e2e")
def bench_e2e(
    steps: int = typer.Option(8, help="Steps per configuration."),
    recipe: Annotated[Optional[Path], typer.Option(help="Recipe (default: the shipped default recipe).")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Extra override for every configuration.")] = [],
    repeats: int = typer.Option(1, help="Run A, B, C round-robin this many times; print medians."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The shortened default recipe: (A) synchronous + inline bookkeeping, (B) synchronous +
    overlapped bookkeeping, (C) the default."""
    from relayrl.bench import run_e2e

    figures = _bench(lambda: run_e2e(steps=steps, recipe=recipe, extra=list(set_), repeats=repeats), as_json)
    for label, f in figures.items():
        out.print(
            f"({label}) {f['samples_per_s']:8.1f} completions/s   trainer busy {f['trainer_busy']:6.1%}   "
            f"sampler busy {f['sampler_busy']:6.1%}   gap median {f['gap_median_s'] * 1e3:8.2f} ms   "
            f"exposed bookkeeping {f['exposed_bookkeeping_s']:.3f} s"
        )
    out.print(f"completions/s ratio C/A: {figures['C']['samples_per_s'] / figures['A']['samples_per_s']:.2f}")


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
