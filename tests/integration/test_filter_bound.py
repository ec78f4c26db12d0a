"""A run in which no group can ever train fails in one line instead of spinning until the stall
watchdog: a warning (`NoGroupKeptWarning`, once) past half the bound filtered in a row with none
kept, then `FilterBoundError` past `orchestrator.max_filtered_per_step`
(0 = 20 × groups_per_step, at least 200) in a row. A healthy dynamic-sampling run that filters
some groups does neither, whatever the timing."""

from __future__ import annotations

import asyncio
import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from relayrl.analysis.checker import check_run_dir
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.ledger import FilterBoundError, FilterWatch, Ledger, NoGroupKeptWarning
from relayrl.orchestrator.stages.score import RewardFailedWarning
from relayrl.orchestrator.window import DispatchWindow
from relayrl.types import FilterReason, Group, Trajectory
from support.cli import relayrl
from support.simutil import make_program, run_checked, sim_config

WIDE = {"COLUMNS": "160"}  # one line per error, whatever the terminal


def _ledger(groups_per_step: int = 2, bound: int = 0, groups: int = 100) -> Ledger:
    ledger = Ledger(watch=FilterWatch.of(groups_per_step, bound))
    ledger.dispatch([None] * groups, 4)  # type: ignore[list-item]  # ids 0.. (the prompts are not read)
    return ledger


def _filter(ledger: Ledger, gid: int, reason: FilterReason = FilterReason.ZERO_VARIANCE) -> None:
    ledger.filtered(Group(gid, []), reason, DispatchWindow(groups_per_step=1, max_staleness=0, total_steps=1))


# -- the watch ------------------------------------------------------------------------------------


def test_the_watch_warns_once_then_fails_naming_the_step_the_reasons_and_the_key() -> None:
    ledger = _ledger(groups_per_step=4, bound=16)  # warns past 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for gid in range(8):
            _filter(ledger, gid, FilterReason.ALL_FAILED if gid % 2 else FilterReason.ZERO_VARIANCE)
        assert not caught  # 8 = half the bound: not yet
        _filter(ledger, 8)
        assert [str(w.message) for w in caught] == [
            "step 1: 9 groups filtered in a row (zero_variance 5, all_failed 4), none kept; "
            "the run fails when more than 16 are filtered in a row (orchestrator.max_filtered_per_step)"
        ]
        assert caught[0].category is NoGroupKeptWarning and issubclass(NoGroupKeptWarning, RuntimeWarning)
        for gid in range(9, 16):
            _filter(ledger, gid)
        assert len(caught) == 1  # once per run
    with pytest.raises(FilterBoundError) as info:
        _filter(ledger, 16)
    assert str(info.value) == (
        "step 1: 17 groups filtered in a row (zero_variance 13, all_failed 4) and none kept to train: "
        "with dynamic sampling every group of this task ties (algorithm.dynamic_sampling; a constant reward?); "
        "every reward call or environment episode of these groups failed "
        "(summary.json's reward_failures, the error column of trajectories/); "
        "raise orchestrator.max_filtered_per_step (now 16) or check the reward"
    )
    assert ledger.as_dict()["groups_filtered"] == {"zero_variance": 13, "all_failed": 4}  # settled before it raised


def test_the_default_bound_and_the_warning_comes_first() -> None:
    assert (FilterWatch.of(1, 0).bound, FilterWatch.of(1, 0).warn_after) == (200, 100)
    assert (FilterWatch.of(32, 0).bound, FilterWatch.of(32, 0).warn_after) == (640, 320)
    assert (FilterWatch.of(32, 10).bound, FilterWatch.of(32, 10).warn_after) == (10, 5)
    assert FilterWatch.of(4, 1).warn_after == 0


def test_a_kept_group_restarts_the_count_whatever_the_commits() -> None:
    """A run whose samplers run ahead of a slow trainer filters many groups between two commits;
    as long as groups are kept among them it is making progress and must not fail."""
    ledger = _ledger(groups_per_step=2, bound=6, groups=1000)
    gid = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would fail the test
        for _ in range(50):  # 150 groups filtered and no commit at all: 3 in a row at most (it warns past 3)
            for _ in range(3):
                _filter(ledger, gid)
                gid += 1
            ledger.kept()
    assert ledger.watch is not None and ledger.watch.step == 1  # steps are numbered from 1
    ledger.drain_filtered()  # a commit: the messages name the next step
    with pytest.warns(NoGroupKeptWarning, match=r"^step 2: 4 groups filtered in a row \(stale 4\), none kept;"):
        for _ in range(6):
            _filter(ledger, gid, FilterReason.STALE)
            gid += 1
    with pytest.raises(FilterBoundError, match=r"^step 2: 7 groups filtered in a row \(stale 7\) and none kept to train: .*"):
        _filter(ledger, gid, FilterReason.STALE)


def test_a_ledger_without_a_watch_never_fails() -> None:
    ledger = Ledger()
    ledger.dispatch([None] * 1000, 4)  # type: ignore[list-item]
    for gid in range(1000):
        _filter(ledger, gid)
    assert ledger.as_dict()["groups_filtered"] == {"zero_variance": 1000}


def test_max_filtered_per_step_is_a_non_negative_int() -> None:
    assert sim_config().orchestrator.max_filtered_per_step == 0
    assert sim_config("orchestrator.max_filtered_per_step=7").orchestrator.max_filtered_per_step == 7
    with pytest.raises(ValueError, match="max_filtered_per_step"):
        sim_config("orchestrator.max_filtered_per_step=-1")


# -- runs -----------------------------------------------------------------------------------------


def _raises(t: Trajectory) -> float:
    raise KeyError("answer")


CASES: dict[str, tuple[Callable[[Trajectory], object], str]] = {
    "constant": (lambda t: 1.0, "zero_variance"),
    "raises": (_raises, "all_failed"),
    "nan": (lambda t: math.nan, "all_failed"),
    "none": (lambda t: None, "all_failed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_in_which_no_group_can_train_fails_in_one_line_after_the_bound(tmp_path: Path, case: str) -> None:
    reward, reason = CASES[case]
    cfg = sim_config("algorithm.dynamic_sampling=true", "orchestrator.max_filtered_per_step=30")  # 4 groups a step
    program = build_program(cfg, run_dir=tmp_path / "run", reward_fns=[reward])  # type: ignore[list-item]  # deliberately not a float
    with pytest.warns(NoGroupKeptWarning, match=rf"^step 1: 16 groups filtered in a row \({reason} 16\), none kept;"):
        with pytest.raises(FilterBoundError) as info:
            asyncio.run(asyncio.wait_for(program.run(), 60))  # (the stall watchdog would wait 1800 s)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"step 1: 31 groups filtered in a row ({reason} 31) and none kept to train: ")
    assert message.endswith("raise orchestrator.max_filtered_per_step (now 30) or check the reward")
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == f"FilterBoundError: {message}"
    ledger = summary["ledger"]
    assert ledger["groups_trained"] == 0 and ledger["groups_filtered"] == {reason: 31}
    assert ledger["groups_dispatched"] == 31 + ledger["groups_unused"]
    assert check_run_dir(run).ok  # the trace of the failed run checks


def test_a_failing_reward_is_named_with_its_exception_once_and_in_the_runs_failure(tmp_path: Path) -> None:
    """The first failed call of a reward function prints its exception once (the run goes on);
    a run that its failures stop names the function and that exception, not only the bound."""
    cfg = sim_config("algorithm.dynamic_sampling=true", "orchestrator.max_filtered_per_step=30")
    program = build_program(cfg, run_dir=tmp_path / "run", reward_fns=[_raises])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(FilterBoundError) as info:
            asyncio.run(asyncio.wait_for(program.run(), 60))
    failed = [str(w.message) for w in caught if issubclass(w.category, RewardFailedWarning)]
    assert len(failed) == 1, failed  # 31 groups × 4 failed calls: one warning
    assert "_raises" in failed[0] and "raised: KeyError: 'answer'" in failed[0]
    message = str(info.value)
    assert "(first failures: " in message and "_raises" in message and "raised: KeyError: 'answer'" in message


def test_a_healthy_dynamic_sampling_run_that_filters_some_groups_neither_warns_nor_fails(tmp_path: Path) -> None:
    cfg = sim_config("run.steps=12", "algorithm.dynamic_sampling=true", "sim.base_success=0.7", "sim.learn_rate=0.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoGroupKeptWarning)
        result = run_checked(make_program(cfg, tmp_path))
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == 48 and ledger["groups_filtered"]["zero_variance"] > 0  # type: ignore[index]


def test_the_cli_exits_1_with_one_line_naming_the_step_and_the_reasons(tmp_path: Path) -> None:
    (tmp_path / "const.py").write_text("def one(t):\n    return 1.0\n")
    sets = ["run.name=ties", "run.steps=3", "task.kind=synthetic", "rollout.groups_per_step=8", "rollout.prompts_per_request=8"]
    sets += ["algorithm.dynamic_sampling=true", 'task.reward_functions=["const.py:one"]']
    args = [arg for s in sets for arg in ("--set", s)]
    res = relayrl("train", "--backend", "sim", *args, cwd=tmp_path, env=WIDE)
    assert res.returncode == 1, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors == [line for line in res.stderr.splitlines() if "Error" in line or line.startswith("error")]  # no traceback
    (error,) = errors
    assert error.startswith("error: step 1: 201 groups filtered in a row (zero_variance 201) and none kept to train: ")
    assert error.endswith("raise orchestrator.max_filtered_per_step (now 200) or check the reward")  # 20 × 8 groups a step < 200
    assert "NoGroupKeptWarning: step 1: 101 groups filtered in a row (zero_variance 101), none kept" in res.stderr  # warned first
    assert res.stderr.index("NoGroupKeptWarning") < res.stderr.index("error:")
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
