"""The error bases (relayrl/errors.py) decide what the command line does: a `UserError` is bad
input (exit 2, one line, nothing kept), a `RunFailed` a run that failed for a reason the user can
act on (exit 1, one line, no traceback), and anything else, a plain ValueError from a bug while
building the run included, is unexpected (exit 1, one line naming its type, its traceback kept).
And the scorer reports the first error of a failed task group, never the group."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from relayrl.errors import RunFailed, UserError, first_error, leaf_errors
from relayrl.rewards.pool import RewardPoolError
from relayrl.rewards.registry import resolve_rewards
from relayrl.rewards.scoring import RewardError, Scorer, ScorerSettings
from relayrl.rundir.lock import MARKER
from relayrl.threads import OrchestratorThreads
from relayrl.types import Trajectory
from support.cli import relayrl, run_python
from support.trajectories import trajectory

WIDE = {"COLUMNS": "160"}  # one line per error, whatever the terminal
SIM = ["--backend", "sim", "--set", "task.kind=synthetic", "--set", "run.steps=3", "--set", "run.name=r", "--set", "eval.enabled=false"]

# Runs the command line after a patch (PATCH) that stands in for a bug or a failure somewhere.
SCRIPT = """
import sys
from relayrl.errors import RunFailed, UserError

class Failing(RunFailed):
    pass

class Final(RunFailed):
    resumable = False

{patch}
sys.argv = ["relayrl", *sys.argv[1:]]
from relayrl.cli.main import main
main()
"""

BUILD_TASK_RAISES = """
import relayrl.orchestrator.build as build
def build_task(cfg):
    raise {error}
build.build_task = build_task
"""

PROGRAM_RAISES = """
import relayrl.orchestrator.build as build
def program(*args, **kwargs):
    raise ValueError("a bug in Program")
build.Program = program
"""

STEP_END_RAISES = """
from relayrl.telemetry.progress import ProgressPrinter
on_step_end = ProgressPrinter.on_step_end
def failing(self, step, result):
    on_step_end(self, step, result)
    if step == 1:
        raise {error}
ProgressPrinter.on_step_end = failing
"""


def train(tmp_path: Path, patch: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    code = SCRIPT.format(patch=patch)
    return run_python("-c", code, "train", *SIM, *args, cwd=tmp_path, env={**WIDE, "TMPDIR": str(tmp_path / "tmp")})


def error_lines(res: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("error")]


# -- building a run -----------------------------------------------------------------------------


def test_a_value_error_from_a_bug_while_building_exits_1_with_its_traceback_kept(tmp_path: Path) -> None:
    """Before this, any ValueError while building was reported as bad input: exit 2, no traceback."""
    res = train(tmp_path, BUILD_TASK_RAISES.format(error='ValueError("a bug in build_task")'))
    assert res.returncode == 1, res.stderr
    assert error_lines(res) == ["error: ValueError: a bug in build_task (traceback in runs/r/error.txt)"], res.stderr
    assert "Traceback" not in res.stderr
    kept = (tmp_path / "runs" / "r" / "error.txt").read_text()
    assert "Traceback (most recent call last)" in kept and "in build_task\nValueError: a bug in build_task" in kept
    # the directory made for the traceback is relayrl's: the next run replaces it
    assert sorted(p.name for p in (tmp_path / "runs" / "r").iterdir()) == sorted([MARKER, "error.txt"])
    again = relayrl("train", *SIM, cwd=tmp_path, env=WIDE)
    assert again.returncode == 0 and not (tmp_path / "runs" / "r" / "error.txt").exists(), again.stderr


def test_a_bug_while_building_never_writes_into_another_runs_directory(tmp_path: Path) -> None:
    """A run directory that holds an earlier run (not yet replaced by this one) is left as it is:
    the traceback goes to a temporary file, named in the line."""
    old = tmp_path / "runs" / "r"
    old.mkdir(parents=True)
    (old / MARKER).write_text(json.dumps({"pid": 1, "host": "elsewhere"}) + "\n")
    (old / "metrics.jsonl").write_text('{"step": 0}\n')
    res = train(tmp_path, BUILD_TASK_RAISES.format(error='ValueError("a bug in build_task")'))
    assert res.returncode == 1, res.stderr
    (line,) = error_lines(res)
    kept = sorted((tmp_path / "tmp").glob("relayrl-error-*.txt"))
    assert len(kept) == 1 and line == f"error: ValueError: a bug in build_task (traceback in {kept[0]})"
    assert "a bug in build_task" in kept[0].read_text()
    assert sorted(p.name for p in old.iterdir()) == sorted([MARKER, "metrics.jsonl"])


def test_a_bug_after_the_run_directory_is_claimed_keeps_its_traceback_there(tmp_path: Path) -> None:
    old = tmp_path / "runs" / "r"
    old.mkdir(parents=True)
    (old / MARKER).write_text("")
    (old / "metrics.jsonl").write_text('{"step": 0}\n')  # replaced: run.overwrite is on by default
    res = train(tmp_path, PROGRAM_RAISES)
    assert res.returncode == 1, res.stderr
    assert error_lines(res) == ["error: ValueError: a bug in Program (traceback in runs/r/error.txt)"], res.stderr
    assert "a bug in Program" in (old / "error.txt").read_text()
    metrics = old / "metrics.jsonl"
    assert not metrics.exists() or '"step": 0' not in metrics.read_text()  # the old run's rows were cleared


def test_a_user_error_while_building_exits_2_with_one_line(tmp_path: Path) -> None:
    res = train(tmp_path, BUILD_TASK_RAISES.format(error='UserError("task.path: data.jsonl, row 3: no answer")'))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == ["error: task.path: data.jsonl, row 3: no answer"]
    assert not (tmp_path / "runs").exists() and not list((tmp_path / "tmp").iterdir())  # nothing kept, nothing written


# -- a run that started -------------------------------------------------------------------------


def test_a_run_failed_exits_1_with_one_line_and_names_the_checkpoint_to_resume_from(tmp_path: Path) -> None:
    res = train(tmp_path, STEP_END_RAISES.format(error='Failing("step 1: it failed (some.key = 3)")'))
    assert res.returncode == 1, res.stderr
    assert error_lines(res) == ["error: step 1: it failed (some.key = 3)"], res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "runs" / "r" / "error.txt").exists()
    assert res.stderr.strip().splitlines()[-1].startswith("stopped")  # where to resume from
    assert json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())["status"] == "failed"


def test_a_run_failed_that_resuming_cannot_help_names_no_checkpoint(tmp_path: Path) -> None:
    res = train(tmp_path, STEP_END_RAISES.format(error='Final("step 1: every group filtered")'))
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1] == "error: step 1: every group filtered"
    assert "stopped" not in res.stderr and "Traceback" not in res.stderr


def test_a_value_error_in_a_run_is_unexpected_not_bad_input(tmp_path: Path) -> None:
    res = train(tmp_path, STEP_END_RAISES.format(error='ValueError("a bug at step 1")'))
    assert res.returncode == 1, res.stderr
    assert error_lines(res) == ["error: ValueError: a bug at step 1 (traceback in runs/r/error.txt)"], res.stderr
    assert "a bug at step 1" in (tmp_path / "runs" / "r" / "error.txt").read_text()


# -- the bases ----------------------------------------------------------------------------------


def test_every_error_the_command_line_reports_on_its_own_derives_from_a_base() -> None:
    from relayrl.backends.local.trainer import NonFiniteStepError
    from relayrl.config.extras import MissingExtra
    from relayrl.config.schema import ConfigError
    from relayrl.envs import EnvironmentSpecError
    from relayrl.models.loading import ModelLoadError
    from relayrl.orchestrator.ledger import FilterBoundError
    from relayrl.packing import PackingError
    from relayrl.rewards.registry import RewardSpecError
    from relayrl.rundir.checkpoint import CheckpointError
    from relayrl.rundir.jsonl import JsonlError
    from relayrl.rundir.lock import RunDirError
    from relayrl.tasks.jsonl import TaskDataError
    from relayrl.telemetry.tracer import TraceError

    user = [ConfigError, MissingExtra, TaskDataError, EnvironmentSpecError, RewardSpecError, ModelLoadError, RunDirError]
    user += [CheckpointError, JsonlError, TraceError]
    assert all(issubclass(c, UserError) and issubclass(c, ValueError) for c in user)
    failed = [RewardError, RewardPoolError, FilterBoundError, PackingError, NonFiniteStepError]
    assert all(issubclass(c, RunFailed) and not issubclass(c, UserError) for c in failed)
    # still what callers caught before the bases existed
    assert issubclass(PackingError, ValueError) and issubclass(NonFiniteStepError, FloatingPointError)
    assert issubclass(FilterBoundError, RuntimeError) and issubclass(RewardError, RuntimeError)
    assert not FilterBoundError.resumable and not PackingError.resumable and RewardError.resumable


def test_first_error_flattens_nested_groups_in_order_and_skips_cancellations() -> None:
    a, b, c = KeyError("a"), ValueError("b"), RuntimeError("c")
    group = BaseExceptionGroup("outer", [asyncio.CancelledError(), ExceptionGroup("inner", [a, b]), c])
    assert leaf_errors(group)[1:] == [a, b, c]
    assert first_error(group) is a
    only = BaseExceptionGroup("cancelled", [asyncio.CancelledError()])
    assert isinstance(first_error(only), asyncio.CancelledError)


# -- scoring ------------------------------------------------------------------------------------


async def _later(t: Trajectory) -> float:
    await asyncio.sleep(0)
    return 1.0


@pytest.mark.parametrize("strict", [False, True])
def test_scoring_reports_the_first_error_of_its_task_group_not_the_group(strict: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync part of a batch (run beside its async calls in one TaskGroup) fails with a group
    of its own: the run sees the reward worker error in it, not a group (before: the group)."""
    threads = OrchestratorThreads()
    scorer = Scorer(resolve_rewards(["exact_match", _later]), ScorerSettings(), threads)
    cause = RewardPoolError("reward worker 0 could not start")

    def sync_part(*args: object) -> None:
        raise ExceptionGroup("sync part", [cause])

    monkeypatch.setattr(scorer, "_run_sync", sync_part)
    try:
        with pytest.raises(RewardPoolError) as info:
            asyncio.run(scorer.score([trajectory(sample=0), trajectory(sample=1)], strict=strict))
    finally:
        threads.shutdown()
        scorer.close()
    assert info.value is cause
