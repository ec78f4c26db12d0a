"""A failed reward call is no reward: its trajectory gets advantage 0, takes no part in its group's
statistics (mean, std, RLOO baseline, n, the dynamic-sampling tie) and is never packed, so it adds
no token to the loss or its normaliser; it is still logged (status "failed") and counted."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from relayrl.algorithms.advantages import AdvantageKind, group_advantages, rewards_tie
from relayrl.backends.registry import build_backend
from relayrl.backends.sim import SimTrainer
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.program import RunResult
from relayrl.orchestrator.stages.advantage import advantage_stage, filter_reason
from relayrl.orchestrator.window import DispatchWindow
from relayrl.telemetry.trajlog import read_trajectories
from relayrl.types import FilterReason, Group, TrainBatch, Trajectory
from support.simutil import run_checked, sim_config
from support.trajectories import trajectory

KINDS: tuple[AdvantageKind, ...] = ("grpo", "drgrpo", "rloo")


def _traj(sample: int, reward: float, failed: bool = False, group: int = 0) -> Trajectory:
    n = sample + 1
    return trajectory(group=group, sample=sample, completion_tokens=[3] * n, text="x", reward=reward, failed=failed)


def _stage(groups: list[Group], kind: AdvantageKind = "grpo", dynamic_sampling: bool = False) -> tuple[list[Group], Ledger]:
    """Groups (ids 0, 1, ...) through the advantage stage: (those it kept, with advantages; the ledger)."""
    ledger = Ledger()
    ledger.dispatch([None] * len(groups), 4)  # type: ignore[list-item]  # ids 0.. (the prompts are not read)

    async def main() -> list[Group]:
        inbox: asyncio.Queue[list[Group]] = asyncio.Queue()
        outbox: asyncio.Queue[Group] = asyncio.Queue()
        window = DispatchWindow(groups_per_step=4, max_staleness=0, total_steps=10)
        await inbox.put(groups)
        task = asyncio.create_task(advantage_stage(inbox, outbox, ledger, window, kind=kind, dynamic_sampling=dynamic_sampling))
        for _ in range(5):  # the stage takes the batch and settles every group without suspending
            await asyncio.sleep(0)
        assert inbox.empty() and not task.done()
        task.cancel()
        return [outbox.get_nowait() for _ in range(outbox.qsize())]

    return asyncio.run(main()), ledger


# -- the advantages -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_member_takes_no_part_in_its_groups_statistics(kind: AdvantageKind) -> None:
    # the case: rewards ±1, three wrong answers and one failed call (placeholder reward 0)
    assert group_advantages([-1.0, -1.0, -1.0, 0.0], kind, scored=[True, True, True, False]) == [0.0] * 4
    # the others are computed as if the failed one were absent: mean, std, RLOO baseline and n
    adv = group_advantages([1.0, 0.0, 0.0, 0.0, 1.0], kind, scored=[True, False, True, True, False])
    alone = group_advantages([1.0, 0.0, 0.0], kind)
    assert adv == [alone[0], 0.0, alone[1], alone[2], 0.0]
    assert math.isclose(sum(adv), 0.0, abs_tol=1e-9) and adv[0] > 0 > adv[2]
    # a right answer whose call failed is not punished with [0, 1] rewards
    assert group_advantages([1.0, 0.0, 1.0, 0.0], kind, scored=[True, False, True, True])[1] == 0.0
    assert group_advantages([0.0, 0.0], kind, scored=[False, False]) == [0.0, 0.0]
    assert group_advantages([1.0, 0.0, 0.0], kind, scored=[True, False, False]) == [0.0, 0.0, 0.0]  # one scored: no baseline
    with pytest.raises(ValueError, match="2 scored flags for 3 rewards"):
        group_advantages([1.0, 0.0, 0.0], kind, scored=[True, False])


def test_the_tie_test_ignores_failed_members() -> None:
    assert rewards_tie([-1.0, -1.0, 0.0], scored=[True, True, False])
    assert not rewards_tie([-1.0, -1.0, 0.0])
    assert rewards_tie([1.0, 0.0], scored=[False, False])


def test_the_stage_gives_failed_trajectories_advantage_0_and_the_others_their_groups_statistics() -> None:
    wrong_but_one_failed = Group(0, [_traj(0, -1.0), _traj(1, -1.0), _traj(2, -1.0), _traj(3, 0.0, failed=True)])
    mixed = Group(1, [_traj(0, 1.0, group=1), _traj(1, 0.0, failed=True, group=1), _traj(2, 0.0, group=1), _traj(3, 1.0, group=1)])
    kept, ledger = _stage([wrong_but_one_failed, mixed], "grpo")
    assert [g.group_id for g in kept] == [0, 1] and not ledger.drain_filtered()
    assert [t.advantage for t in kept[0].trajectories] == [0.0] * 4  # was [-0.5, -0.5, -0.5, +1.5]
    expected = group_advantages([1.0, 0.0, 1.0], "grpo")
    assert [t.advantage for t in kept[1].trajectories] == [expected[0], 0.0, expected[1], expected[2]]


def test_under_dynamic_sampling_a_group_whose_scored_members_tie_is_filtered() -> None:
    ties_but_one_failed = Group(0, [_traj(0, -1.0), _traj(1, -1.0), _traj(2, 0.0, failed=True)])
    all_failed = Group(1, [_traj(0, 0.0, failed=True, group=1), _traj(1, 0.0, failed=True, group=1)])
    varied = Group(2, [_traj(0, 1.0, group=2), _traj(1, 0.0, group=2), _traj(2, 0.0, failed=True, group=2)])
    assert filter_reason(ties_but_one_failed, dynamic_sampling=True) is FilterReason.ZERO_VARIANCE  # the failure no longer un-ties it
    assert filter_reason(ties_but_one_failed, dynamic_sampling=False) is None
    assert filter_reason(all_failed, dynamic_sampling=True) is FilterReason.ALL_FAILED
    assert filter_reason(varied, dynamic_sampling=True) is None
    # a failed trajectory is never packed: its length cannot make its group too long
    long_failed = Group(3, [_traj(0, 1.0, group=3), _traj(1, 0.0, group=3), _traj(9, 0.0, failed=True, group=3)])
    assert filter_reason(long_failed, dynamic_sampling=False, row_tokens=8) is None
    kept, ledger = _stage([ties_but_one_failed, all_failed, varied], dynamic_sampling=True)
    assert [g.group_id for g in kept] == [2]
    assert [(f.group.group_id, f.reason) for f in ledger.drain_filtered()] == [
        (0, FilterReason.ZERO_VARIANCE),
        (1, FilterReason.ALL_FAILED),
    ]


# -- a run ----------------------------------------------------------------------------------------


class RecordingTrainer(SimTrainer):
    """The sim trainer, keeping every micro-batch it received."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.batches: list[TrainBatch] = []

    async def train_step(self, batch: TrainBatch) -> None:
        self.batches.append(batch)
        await super().train_step(batch)


async def _wrong_and_sometimes_hanging(t: Trajectory) -> float:
    """Every completion is wrong (-1); the verifier hangs on sample 0 of every group (a timeout)."""
    if t.sample_index == 0:
        await asyncio.sleep(60)
    return -1.0


def _run(tmp_path: Path, *overrides: str) -> tuple[RunResult, RecordingTrainer, list[dict[str, Any]]]:
    cfg = sim_config("run.steps=2", "task.reward_timeout_s=1", *overrides)
    trainer = RecordingTrainer(cfg.sim)
    backend = build_backend(cfg, threading.Event(), evaluate=False)
    backend.trainer = trainer
    program = build_program(cfg, run_dir=tmp_path / "run", reward_fns=[_wrong_and_sometimes_hanging], backend=backend)
    result = run_checked(program)
    return result, trainer, read_trajectories(tmp_path / "run").to_pylist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_reward_that_hangs_on_some_wrong_answers_never_reinforces_them(tmp_path: Path, kind: str) -> None:
    """The failed completion used to get its group's only positive advantage (+1.5 with GRPO)."""
    result, _, rows = _run(tmp_path, f"algorithm.advantage={kind}")
    assert len(rows) == 2 * 4 * 4
    assert max(float(r["advantage"]) for r in rows) <= 0.0  # no trajectory is reinforced
    failed = [r for r in rows if r["status"] == "failed"]
    assert [r["sample_index"] for r in failed] == [0] * 8 and all("timeout" in str(r["error"]) for r in failed)
    assert all(r["advantage"] == 0.0 and r["reward"] == 0.0 for r in failed)
    assert all(r["advantage"] == 0.0 and r["reward"] == -1.0 for r in rows if r["status"] == "ok")
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == 8 and ledger["trajectories_failed"] == 8  # logged and counted
    assert ledger["trajectories_trained"] == 8 * 3  # the failed ones were not trained on
    assert [r.metrics["reward_mean"] for r in result.results] == [-1.0, -1.0]  # not -0.75: a failure's 0 is no reward
    assert [r.metrics["failed_trajectories"] for r in result.results] == [4, 4]


@pytest.mark.slow
def test_the_loss_normaliser_counts_only_the_scored_trajectories(tmp_path: Path) -> None:
    """token_mean divides by the step's completion tokens, the seq_mean aggregations by its
    sequences: both are the scored trajectories', and no failed trajectory is packed."""
    _, trainer, rows = _run(tmp_path)
    for step in (1, 2):
        ok = [r for r in rows if r["step"] == step and r["status"] == "ok"]
        every = [r for r in rows if r["step"] == step]
        batches = [b for b in trainer.batches if b.step == step]
        assert sum(b.num_sequences for b in batches) == len(ok) == 12  # 16 with the failed ones
        tokens = sum(len(r["completion_tokens"]) for r in ok)
        assert tokens < sum(len(r["completion_tokens"]) for r in every)
        assert {b.step_completion_tokens for b in batches} == {tokens}
        assert {b.step_sequences for b in batches} == {len(ok)}
