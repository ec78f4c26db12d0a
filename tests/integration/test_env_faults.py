"""Environments that misbehave, through the command line (sim backend, a user environment file):
no call of theirs hangs the run or ends it with a traceback or their own exit code.

- a step past `rollout.env_step_timeout_s` fails its episode (counted under `environment` in
  `reward_failures`) and the run goes on; with no bound, the stall watchdog ends the run (exit 1,
  StallError) and the stuck call does not keep the process alive;
- what a step raises (SystemExit included) fails its episode, or the run under
  `rollout.strict_environment`; a wrong type returned fails the run: one `error:` line naming the
  environment, the prompt and the turn, exit 1.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import relayrl
from support import cli

SIM_RECIPE = Path(relayrl.__file__).parent / "recipes" / "sim.toml"  # synthetic prompts, no dynamic sampling

ENV_FILE = '''
import asyncio
import threading

from relayrl.envs.base import EnvStep


def act(mode: str, first: bool) -> EnvStep:
    """What a step does in `mode`; `first`: this is the run's first episode."""
    if mode == "exit_once" and first or mode == "exit":
        raise SystemExit(3)
    if mode == "str_reward":
        return EnvStep("obs", reward="1.0")
    if mode == "none_reward":
        return EnvStep("obs", reward=None)
    if mode == "tuple":
        return ("obs", 1.0)
    if mode == "bytes_observation":
        return EnvStep(b"obs")
    return EnvStep(None, reward=1.0, solved=True)


class SyncEpisode:
    def __init__(self, mode: str, first: bool) -> None:
        self.mode, self.first = mode, first

    def step(self, action: str) -> EnvStep:
        if self.mode == "hang" or self.mode == "hang_once" and self.first:
            threading.Event().wait()  # never returns, never checks an abort flag
        return act(self.mode, self.first)


class AsyncEpisode(SyncEpisode):
    async def step(self, action: str) -> EnvStep:
        if self.mode == "hang" or self.mode == "hang_once" and self.first:
            await asyncio.Event().wait()
        return act(self.mode, self.first)


class Sync:
    def __init__(self, mode: str) -> None:
        self.mode, self.started = mode, 0

    def start(self, prompt):
        self.started += 1
        if self.mode == "start_none":
            return None
        return SyncEpisode(self.mode, self.started == 1)


class Async(Sync):
    async def start(self, prompt):
        self.started += 1
        return AsyncEpisode(self.mode, self.started == 1)
'''


def train(tmp_path: Path, cls: str, mode: str, *sets: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    (tmp_path / "envs.py").write_text(ENV_FILE)
    options = [
        f"task.environment=envs.py:{cls}",
        f'task.environment_config={{ mode = "{mode}" }}',
        "rollout.max_turns=2",
        "run.steps=2",
        "run.name=env",
        *sets,
    ]
    args = ["train", str(SIM_RECIPE), *[a for s in options for a in ("--set", s)]]
    return cli.relayrl(*args, cwd=tmp_path, env={"COLUMNS": "200"}, timeout=timeout)


def summary(tmp_path: Path) -> dict[str, object]:
    return dict(json.loads((tmp_path / "runs" / "env" / "summary.json").read_text()))


def ledger(tmp_path: Path) -> dict[str, object]:
    return dict(summary(tmp_path)["ledger"])  # type: ignore[call-overload]


def named(tmp_path: Path, cls: str) -> str:
    """How the run names the environment `envs.py:CLS` (its file anchored to the directory it was found in)."""
    return f"environment '{tmp_path.resolve() / 'envs.py'}:{cls}'"


def error_lines(res: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in res.stderr, res.stderr
    return [line for line in res.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("cls", ["Sync", "Async"])
def test_a_step_past_its_bound_fails_its_episode_and_the_run_finishes(tmp_path: Path, cls: str) -> None:
    res = train(tmp_path, cls, "hang_once", "rollout.env_step_timeout_s=0.5")
    assert res.returncode == 0, res.stderr
    s = summary(tmp_path)
    assert s["status"] == "completed" and s["steps_completed"] == 2
    counts = ledger(tmp_path)
    assert counts["reward_failures"] == {"environment": {"timeout": 1}} and counts["trajectories_failed"] == 1


@pytest.mark.parametrize("cls", ["Sync", "Async"])
def test_a_step_that_never_returns_without_a_bound_ends_in_the_stall_error(tmp_path: Path, cls: str) -> None:
    """The stall watchdog fires; the stuck call (a sync one cannot be interrupted) neither holds
    the run's teardown nor the process's exit (the hard timeout of the child would fail the test)."""
    res = train(tmp_path, cls, "hang", "rollout.env_step_timeout_s=0", "orchestrator.stall_timeout_s=2", timeout=120)
    assert res.returncode == 1, res.stderr
    errors = error_lines(res)
    assert len(errors) == 1 and errors[0].startswith("error: StallError: no step committed") and "stall_timeout_s = 2" in errors[0]
    assert (tmp_path / "runs" / "env" / "stall.txt").exists()
    assert summary(tmp_path)["status"] == "failed"


def test_too_many_stuck_sync_steps_fail_the_run_in_one_line(tmp_path: Path) -> None:
    res = train(tmp_path, "Sync", "hang", "rollout.env_step_timeout_s=0.2")
    assert res.returncode == 1, res.stderr
    errors = error_lines(res)
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith(f"error: {named(tmp_path, 'Sync')}: step (prompt 'sim-"), errors[0]
    assert ", turn 1) ran past rollout.env_step_timeout_s = 0.2 s" in errors[0]
    assert "5 of its calls are still running in abandoned threads (at most 4)" in errors[0]


@pytest.mark.parametrize("cls", ["Sync", "Async"])
def test_system_exit_in_a_step_fails_its_episode_not_the_process(tmp_path: Path, cls: str) -> None:
    res = train(tmp_path, cls, "exit_once")
    assert res.returncode == 0, res.stderr
    counts = ledger(tmp_path)
    assert counts["reward_failures"] == {"environment": {"raised": 1}} and counts["trajectories_failed"] == 1
    rows = [json.loads(line) for line in (tmp_path / "runs" / "env" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2


@pytest.mark.parametrize("cls", ["Sync", "Async"])
def test_under_strict_environment_a_raise_fails_the_run_in_one_line(tmp_path: Path, cls: str) -> None:
    res = train(tmp_path, cls, "exit", "rollout.strict_environment=true")
    assert res.returncode == 1, res.stderr
    errors = error_lines(res)
    assert errors == [
        f"error: {named(tmp_path, cls)} failed in step (prompt 'sim-0', sample 0, turn 1): raised: SystemExit: 3 "
        "(rollout.strict_environment = true)"
    ]


@pytest.mark.parametrize(
    ("mode", "where", "what"),
    [
        ("str_reward", "step (prompt 'sim-0', sample 0, turn 1)", "EnvStep.reward is a str, not a number"),
        ("none_reward", "step (prompt 'sim-0', sample 0, turn 1)", "EnvStep.reward is None, not a number"),
        ("tuple", "step (prompt 'sim-0', sample 0, turn 1)", "step() returned a tuple, not an EnvStep"),
        ("bytes_observation", "step (prompt 'sim-0', sample 0, turn 1)", "EnvStep.observation is a bytes, not a str or None"),
        ("start_none", "start (prompt 'sim-0', sample 0)", "start() returned None, not an episode"),
    ],
)
def test_a_wrong_type_returned_fails_the_run_in_one_line(tmp_path: Path, mode: str, where: str, what: str) -> None:
    res = train(tmp_path, "Sync", mode)
    assert res.returncode == 1, res.stderr
    errors = error_lines(res)
    assert len(errors) == 1 and errors[0].startswith(f"error: {named(tmp_path, 'Sync')}: {where}: {what}"), res.stderr
