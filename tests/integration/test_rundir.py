"""The run directory as a hostile user and environment would treat it: relayrl deletes only
directories it can prove are its own, one run holds a run directory at a time, a dead run is told
from a live one, a resume refuses what it cannot apply and never drops a metrics row silently,
file-system errors and signals end a run with one line, and sizes that cannot fit are refused."""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from relayrl.analysis.report import list_runs
from relayrl.backends.sim.workers import SimSampler
from relayrl.config.schema import ConfigError, load_config
from relayrl.config.sizing import check_fits
from relayrl.rundir.lock import MARKER, RunDirError, RunDirLock, is_live
from relayrl.types import GenerateResult, SampleRequest, Weights
from support.cli import child_env, relayrl, relayrl_argv

QUICK = ["--backend", "sim", "--set", "run.steps=3", "--set", "rollout.groups_per_step=2", "--set", "rollout.num_generations=2"]
# a sim run that keeps going long enough to be interfered with (a checkpoint every 2 steps)
LONG = [
    "--backend",
    "sim",
    "--set",
    "run.steps=400",
    "--set",
    "sim.train_step=0.02",
    "--set",
    "rollout.groups_per_step=2",
    "--set",
    "rollout.num_generations=2",
    "--set",
    "orchestrator.checkpoint_every=2",
]


def start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        relayrl_argv(*args), cwd=cwd, env=child_env({"PYTHONUNBUFFERED": "1"}), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def wait_for(predicate: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.1)


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.mark.parametrize("name", ['""', "..", ".", "ABSOLUTE", "a/b", '"a\\nb"', '" x"'])
def test_a_run_name_that_is_not_a_plain_name_is_refused_and_nothing_is_deleted(tmp_path: Path, name: str) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"  # never a real absolute path: old code deleted it
    (work / "runs").mkdir(parents=True)
    (work / "runs" / "user-file.txt").write_text("mine")
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("mine too")
    name = str(elsewhere) if name == "ABSOLUTE" else name
    res = relayrl("train", *QUICK, "--set", f"run.name={name}", cwd=work)
    assert res.returncode == 2
    assert "run.name" in one_error_line(res) and "plain name" in res.stderr
    assert sorted(p.name for p in work.iterdir()) == ["runs"]
    assert [p.name for p in (work / "runs").iterdir()] == ["user-file.txt"]
    assert [p.name for p in elsewhere.iterdir()] == ["precious.txt"]


def test_a_directory_relayrl_did_not_write_is_never_cleared(tmp_path: Path) -> None:
    theirs = tmp_path / "runs" / "theirs"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("not a run")
    res = relayrl("train", *QUICK, "--set", "run.name=theirs", cwd=tmp_path)
    assert res.returncode == 2 and "not a relayrl run directory" in one_error_line(res)
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def test_a_fresh_run_replaces_its_own_directory_only(tmp_path: Path) -> None:
    assert relayrl("train", *QUICK, "--set", "run.name=mine", cwd=tmp_path).returncode == 0
    run_dir = tmp_path / "runs" / "mine"
    assert (run_dir / MARKER).is_file()
    (run_dir / "stale.txt").write_text("left by the old run")
    res = relayrl("train", *QUICK, "--set", "run.name=mine", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert not (run_dir / "stale.txt").exists() and (run_dir / "summary.json").exists()


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["run.name=afile"], "is a file, not a directory"),
        (["run.output_dir=afile"], "Not a directory"),
    ],
)
def test_a_run_directory_in_the_way_of_a_file_is_one_line(tmp_path: Path, sets: list[str], message: str) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "afile").write_text("x")
    (tmp_path / "afile").write_text("x")
    res = relayrl("train", *QUICK, *[a for s in sets for a in ("--set", s)], cwd=tmp_path)
    assert res.returncode == 2 and message in one_error_line(res)


def test_a_directory_as_recipe_is_one_line(tmp_path: Path) -> None:
    res = relayrl("train", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and str(tmp_path) in one_error_line(res)


def test_a_second_run_or_resume_of_a_held_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    # more steps than it can run before the test kills it: it holds the directory however slowly
    # the two refused runs start on a loaded machine
    first = start("train", *LONG, "--set", "run.steps=1000000", "--set", "run.name=shared", cwd=tmp_path)
    run_dir = tmp_path / "runs" / "shared"
    try:
        wait_for(lambda: (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()))
        fresh = relayrl("train", *QUICK, "--set", "run.name=shared", cwd=tmp_path)
        assert fresh.returncode == 2 and f"in use by another run (pid {first.pid}" in one_error_line(fresh)
        again = relayrl("train", "--resume", str(run_dir), cwd=tmp_path)
        assert again.returncode == 2 and f"pid {first.pid}" in one_error_line(again)
        assert first.poll() is None  # the first run goes on, its directory untouched
        assert (run_dir / "metrics.jsonl").exists()
        assert is_live(run_dir) is True
        assert [r["status"] for r in list_runs(tmp_path / "runs")] == ["running"]
    finally:
        first.kill()
        first.wait()
    assert is_live(run_dir) is False  # SIGKILL: the lock went with the process
    assert [r["status"] for r in list_runs(tmp_path / "runs")] == ["incomplete"]


def test_the_lock_is_exclusive_within_one_process_too(tmp_path: Path) -> None:
    a, b = RunDirLock(tmp_path / "r"), RunDirLock(tmp_path / "r")
    a.acquire()
    with pytest.raises(RunDirError, match="in use by another run"):
        b.acquire()
    a.release()
    b.acquire()
    b.release()


def _killed_run(tmp_path: Path, name: str, steps: int = 10) -> Path:
    res = relayrl(
        "train",
        *QUICK,
        "--set",
        f"run.steps={steps}",
        "--set",
        "orchestrator.checkpoint_every=4",
        "--set",
        f"run.name={name}",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    return tmp_path / "runs" / name


def test_resume_refuses_a_change_it_cannot_apply_and_records_one_it_can(tmp_path: Path) -> None:
    run_dir = _killed_run(tmp_path, "changes")
    config = (run_dir / "config.toml").read_text()
    res = relayrl("train", "--resume", str(run_dir), "--set", "run.steps=12", "--set", "rollout.num_generations=4", cwd=tmp_path)
    assert res.returncode == 2 and "cannot change rollout.num_generations (2 → 4)" in one_error_line(res)
    assert (run_dir / "config.toml").read_text() == config  # nothing rewritten
    res = relayrl("train", "--resume", str(run_dir), "--set", "run.steps=12", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (run_dir / "config_changes.jsonl").read_text().splitlines()]
    assert rows == [{"from_step": 11, "key": "run.steps", "old": 10, "new": 12}]  # steps 1-10 done: 11 is the first with 12
    assert "steps = 12" in (run_dir / "config.toml").read_text()


def test_a_template_with_a_newline_round_trips_through_config_toml(tmp_path: Path) -> None:
    res = relayrl(
        "train",
        *QUICK,
        "--set",
        "orchestrator.checkpoint_every=2",
        "--set",
        'task.prompt_template="Q:\\n{text}\\tA:"',
        "--set",
        "run.name=nl",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    cfg = load_config(tmp_path / "runs" / "nl" / "config.toml")
    assert cfg.task.prompt_template == "Q:\n{text}\tA:"


def test_a_truncated_metrics_file_is_repaired_from_the_checkpoint_or_refused(tmp_path: Path) -> None:
    run_dir = _killed_run(tmp_path, "torn")
    metrics = run_dir / "metrics.jsonl"
    whole = metrics.read_bytes()
    metrics.write_bytes(whole[:-30])  # step 10's row torn: checkpoint step-10 carries it
    res = relayrl("train", "--resume", str(run_dir), "--set", "run.steps=12", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 13))
    lines = metrics.read_text().splitlines()
    del lines[1]  # step 2: older than any checkpoint kept
    metrics.write_text("\n".join(lines) + "\n")
    res = relayrl("train", "--resume", str(run_dir), "--set", "run.steps=14", cwd=tmp_path)
    assert res.returncode == 2 and "step(s) 2 are missing or torn" in one_error_line(res)
    assert len(metrics.read_text().splitlines()) == 11  # refused: nothing rewritten


@pytest.mark.slow
def test_a_file_size_limit_ends_the_run_with_one_line_naming_the_file_and_the_checkpoint(tmp_path: Path) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    res = relayrl("train", *LONG, "--set", "run.name=full", cwd=tmp_path, preexec_fn=limit)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2, res.stderr
    assert lines[0].startswith("error: ") and "File too large (errno 27, EFBIG)" in lines[0]
    assert "runs/full/" in lines[0]  # the file is named
    assert lines[1].startswith("stopped; continue after step ")
    run_dir = tmp_path / "runs" / "full"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "File too large" in summary["error"]
    resumed = relayrl("train", "--resume", str(run_dir), cwd=tmp_path)  # the limit is gone
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def start_blocked(tmp_path: Path, name: str, grace_s: int) -> subprocess.Popen[str]:
    """A run whose inline bookkeeping burns 60 s of CPU on the event loop, caught in it."""
    sets = ["run.steps=3", "orchestrator.overlap_bookkeeping=false", "sim.release_memory=60", f"orchestrator.stop_grace_s={grace_s}"]
    proc = start("train", "--backend", "sim", *[a for s in [*sets, f"run.name={name}"] for a in ("--set", s)], cwd=tmp_path)
    assert proc.stdout is not None
    assert "steps on the sim backend" in proc.stdout.readline()
    # step 0's metrics row is written by its inline bookkeeping, on the event loop, which then
    # burns the 60 s without returning to the loop: once the row is there, the loop is caught
    metrics = tmp_path / "runs" / name / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.read_text().endswith("\n"))
    return proc


def test_sigterm_is_answered_while_the_event_loop_is_blocked(tmp_path: Path) -> None:
    """The old handler (a loop callback) waited for the blocked loop; the signal handler now
    schedules the cancellation and exits after the grace."""
    proc = start_blocked(tmp_path, "blocked", grace_s=1)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)  # far below the 60 s the loop is blocked for
    finally:
        proc.kill()
    assert proc.returncode == 143
    assert "did not wind down within orchestrator.stop_grace_s=1 s" in err
    assert is_live(tmp_path / "runs" / "blocked") is False


def test_a_second_sigint_exits_at_once(tmp_path: Path) -> None:
    proc = start_blocked(tmp_path, "twice", grace_s=120)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "second signal" in err


@pytest.mark.torch  # its child loads the default recipe: the local backend and the shipped model
@pytest.mark.parametrize("after_s", [0.3, 1.0, 2.5])
def test_a_signal_before_the_run_starts_exits_without_a_traceback(tmp_path: Path, after_s: float) -> None:
    # the default recipe through the `relayrl` entry point: imports typer, torch, transformers, loads the model
    proc = subprocess.Popen(relayrl_argv("train"), cwd=tmp_path, env=child_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Error" not in err


@pytest.mark.parametrize("gens", ["100000", "10000000000000000000000"])
def test_sizes_that_cannot_fit_are_refused_up_front(tmp_path: Path, gens: str) -> None:
    res = relayrl("train", "--backend", "sim", "--set", f"rollout.num_generations={gens}", cwd=tmp_path)
    assert res.returncode == 2
    line = one_error_line(res)
    assert f"rollout.num_generations={gens}" in line and "GB of host memory" in line
    assert not (tmp_path / "runs").exists()


def test_the_memory_budget_is_configurable() -> None:
    cfg = load_config(None, ["rollout.num_generations=1000", "rollout.groups_per_step=100", "orchestrator.max_host_memory_gb=0.01"])
    with pytest.raises(ConfigError, match="orchestrator.max_host_memory_gb"):
        check_fits(cfg)
    check_fits(load_config(None, ["rollout.num_generations=1000", "rollout.groups_per_step=100"]))  # fits half of 2 cores' 24 GB


class HoldsGenerationAt(SimSampler):
    """A sim sampler that, once it holds weights of version `version` or newer, sets `reached` at
    its next generate call and never returns from it (the run's cancellation ends the call)."""

    def __init__(self, version: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.version = version
        self.loaded = 0
        self.reached = asyncio.Event()

    async def load_weights(self, weights: Weights) -> None:
        await super().load_weights(weights)
        self.loaded = weights.version

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        if self.loaded >= self.version:
            self.reached.set()
            await asyncio.Event().wait()
        return await super().generate(requests)


def test_a_run_cancelled_between_a_commit_and_its_logs_reports_only_logged_steps(tmp_path: Path) -> None:
    """On-policy (staleness 0): after step 1 commits, its bookkeeping waits for step 2's first
    micro-batch, which waits for data sampled with step 1's weights (version 2). The sampler holds
    that generation, so the run is cancelled there, whatever the machine's speed: the summary must
    not count step 1 in the ledger while its metrics row was never written. (Version 2 exists only
    once optim_step(1) returned, and the sampler gets it only after that commit.)"""
    from support.simutil import make_program, sim_config

    cfg = sim_config("run.steps=6", "rollout.max_staleness=0")
    program = make_program(cfg, tmp_path)
    sampler = HoldsGenerationAt(2, cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed)
    program.backend.samplers[0] = sampler

    async def main() -> None:
        task = asyncio.create_task(program.run())
        await sampler.reached.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert summary["status"] == "cancelled"
    assert summary["steps_completed"] == len(rows) == 1
    assert summary["steps_unlogged"] == 1
    ledger = summary["ledger"]
    assert ledger["groups_trained"] == summary["steps_completed"] * cfg.rollout.groups_per_step
    assert ledger["groups_dispatched"] == ledger["groups_trained"] + sum(ledger["groups_filtered"].values()) + ledger["groups_unused"]
