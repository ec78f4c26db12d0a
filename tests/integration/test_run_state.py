"""The run's state (orchestrator/state.py) and building a run (orchestrator/build.py): a fresh and
a restored state have one shape; a run refused by its last check (building its workers) leaves
the run directory as it found it (no config.toml, trace.json or config change written)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from relayrl.errors import UserError
from relayrl.orchestrator import build
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.state import RunState
from relayrl.rundir.checkpoint import load_resume_point
from relayrl.types import Prompt, StepResult
from support.simutil import make_program, run_checked, sim_config


def _prompts() -> itertools.count[Prompt]:  # type: ignore[type-var]
    return (Prompt(f"p{i}", f"{i}+0=", str(i)) for i in itertools.count())  # type: ignore[return-value]


def test_a_fresh_state_starts_with_no_step_done_and_takes_step_ones_reward_mean_once() -> None:
    state = RunState.fresh(iter(_prompts()))
    assert (state.start_step, state.resumed, state.evals, state.reward_mean_first) == (0, False, [], None)
    assert next(state.prompts).index == 0
    state.on_step_end(2, StepResult(2, 2, {"reward_mean": 0.9}))  # not step 1 (the first): ignored
    assert state.reward_mean_first is None
    state.on_step_end(1, StepResult(1, 1, {"reward_mean": 0.25}))
    state.on_step_end(1, StepResult(1, 1, {"reward_mean": 0.75}))  # set once
    assert state.reward_mean_first == 0.25


def test_a_restored_state_continues_the_checkpoint(tmp_path: Path) -> None:
    cfg = sim_config("run.steps=3", "orchestrator.checkpoint_every=1", "eval.every_steps=0")
    run_checked(make_program(cfg, tmp_path))
    point = load_resume_point(tmp_path / "run")
    state = RunState.restored(iter(_prompts()), point)
    assert state.resumed and state.point is point
    assert state.start_step == point.step == 3  # steps 1-3 done
    assert state.ledger.checkpoint() == point.ledger  # the settled ledger, as checkpointed
    assert state.reward_mean_first == point.reward_mean_first is not None
    assert state.elapsed() >= point.elapsed_s > 0.0
    replayed = [d.index for d in point.in_flight]
    assert [next(state.prompts).index for _ in replayed] == replayed  # in-flight prompts first, same indices
    assert next(state.prompts).index == point.prompts_drawn  # then the stream where it stopped


def _failing_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the workers fails (e.g. a model directory that cannot be loaded): the last check a
    run passes before its run directory is touched."""

    def build_backend(*args: object, **kwargs: object) -> object:
        raise UserError("model.path: cannot load the model")

    monkeypatch.setattr(build, "build_backend", build_backend)


def test_a_fresh_run_refused_when_its_workers_cannot_be_built_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_backend(monkeypatch)
    with pytest.raises(UserError, match="cannot load the model"):
        build_program(sim_config("run.steps=2"), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # no config.toml, no trace.json, not even the directory


def test_a_refused_resume_leaves_the_run_directory_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_checked(make_program(sim_config("run.steps=2", "orchestrator.checkpoint_every=1"), tmp_path))
    run_dir = tmp_path / "run"
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".relayrl-run"}
    more = sim_config("run.steps=4", "orchestrator.checkpoint_every=1")
    with monkeypatch.context() as m:
        _failing_backend(m)
        with pytest.raises(UserError, match="cannot load the model"):
            build_program(more, run_dir=run_dir, resume=True)
    after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".relayrl-run"}
    assert after == before  # config.toml not rewritten, no config_changes.jsonl, nothing rewound
    resumed = build_program(more, run_dir=run_dir, resume=True)  # the lock was released: a good resume goes on
    result = asyncio.run(asyncio.wait_for(resumed.run(), 60))
    assert result.summary["status"] == "completed" and result.summary["resumed_from_step"] == 2
