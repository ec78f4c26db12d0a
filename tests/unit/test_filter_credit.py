"""Filtering a group returns its dispatch credit, at each of the three places a group is filtered:
dispatch (a prompt too long for the context), the advantage stage (a trajectory too long for a
row, tied rewards under dynamic sampling, every reward call failed) and the train loop's group
taker (stale). One call does both (`Ledger.filtered(group, reason, window)`); a filtered group
whose credit is not returned shrinks the dispatch window for good and, after enough, stalls the
run. Each test drives the stage itself and checks the window's credit once the group is filtered
equals its credit before the group was dispatched."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.stages.advantage import advantage_stage
from relayrl.orchestrator.stages.dispatch import PromptTooLongWarning, dispatch_stage
from relayrl.orchestrator.stages.train_loop import GroupTaker
from relayrl.orchestrator.window import DispatchWindow
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Drawn, FilterReason, Group, Prompt, SampleRequest, Trajectory
from support.trajectories import trajectory


class _Drained(Exception):
    """The stage asked for a second batch: the test's batch is settled."""


class _OneBatch(asyncio.Queue[list[Group]]):
    """An inbox that stops the stage (raising `_Drained`) once its batches are taken."""

    async def get(self) -> list[Group]:
        if self.empty():
            raise _Drained
        return self.get_nowait()


def _traj(sample: int, *, reward: float, version: int = 0, tokens: int = 3, failed: bool = False) -> Trajectory:
    return trajectory(
        sample=sample,
        prompt=Prompt("p", "t", "1"),
        prompt_tokens=[1] * tokens,
        completion_tokens=[2] * tokens,
        logprob=-1.0,
        text="1",
        version=version,
        reward=reward,
        failed=failed,
    )


def test_a_prompt_too_long_at_dispatch_returns_its_credit() -> None:
    window = DispatchWindow(groups_per_step=3, max_staleness=0, total_steps=1)
    ledger = Ledger()
    before = window.available()

    async def main() -> None:
        prompts = iter([Drawn(0, Prompt("long", "x" * 30, "1"))])  # then the stream ends: the stage stops
        outbox: asyncio.Queue[list[SampleRequest]] = asyncio.Queue()
        await dispatch_stage(
            prompts,
            lambda text: [7] * len(text),
            window,
            ledger,
            outbox,
            num_generations=4,
            prompts_per_request=1,
            max_prompt_tokens=10,
        )

    with pytest.warns(PromptTooLongWarning), pytest.raises(RuntimeError, match="prompt stream ended"):
        asyncio.run(main())
    assert ledger.as_dict()["groups_filtered"] == {"too_long": 1}
    # the stage took one more credit, for the prompt the ended stream no longer had
    assert window.available() + 1 == before


@pytest.mark.parametrize(
    ("reason", "group", "dynamic_sampling", "row_tokens"),
    [
        (FilterReason.TOO_LONG, Group(0, [_traj(0, reward=0.0), _traj(1, reward=1.0, tokens=20)]), False, 16),
        (FilterReason.ZERO_VARIANCE, Group(0, [_traj(0, reward=1.0), _traj(1, reward=1.0)]), True, None),
        (FilterReason.ALL_FAILED, Group(0, [_traj(0, reward=0.0, failed=True), _traj(1, reward=0.0, failed=True)]), False, None),
    ],
    ids=["too_long", "zero_variance", "all_failed"],
)
def test_a_group_filtered_by_the_advantage_stage_returns_its_credit(
    reason: FilterReason, group: Group, dynamic_sampling: bool, row_tokens: int | None
) -> None:
    window = DispatchWindow(groups_per_step=2, max_staleness=0, total_steps=1)
    ledger = Ledger()
    before = window.available()

    async def main() -> asyncio.Queue[Group]:
        assert await window.acquire(1) == 1  # dispatch the group
        ledger.dispatch([Drawn(0, Prompt("p", "t", "1"))], 2)
        assert window.available() == before - 1
        inbox = _OneBatch()
        inbox.put_nowait([group])
        outbox: asyncio.Queue[Group] = asyncio.Queue()
        with pytest.raises(_Drained):
            await advantage_stage(inbox, outbox, ledger, window, kind="grpo", dynamic_sampling=dynamic_sampling, row_tokens=row_tokens)
        return outbox

    outbox = asyncio.run(main())
    assert outbox.empty() and ledger.as_dict()["groups_filtered"] == {reason.value: 1}
    assert window.available() == before


def test_a_stale_group_dropped_by_the_train_loop_returns_its_credit() -> None:
    window = DispatchWindow(groups_per_step=2, max_staleness=0, total_steps=10)
    ledger = Ledger()
    stale, fresh = Group(0, [_traj(0, reward=1.0, version=0)]), Group(1, [_traj(0, reward=1.0, version=1)])

    async def main() -> list[Group]:
        assert await window.acquire(1) == 1  # the fresh group
        before = window.available()
        assert await window.acquire(1) == 1  # the stale one
        ledger.dispatch([Drawn(0, Prompt("p0", "t", "1")), Drawn(1, Prompt("p1", "t", "1"))], 1)
        queue: asyncio.Queue[Group] = asyncio.Queue()
        queue.put_nowait(stale)  # sampled by version 0: too old for step 2 (trained from version 1) with max_staleness 0
        queue.put_nowait(fresh)
        taker = GroupTaker(queue, ledger, window, Tracer(None, {}), groups_per_step=1, max_staleness=0)
        groups, _ = await taker.take(2)
        assert window.available() == before
        return groups

    assert asyncio.run(main()) == [fresh]
    assert ledger.as_dict()["groups_filtered"] == {"stale": 1}


def test_the_window_has_no_public_way_to_return_a_credit_alone() -> None:
    public = {name for name in dir(DispatchWindow) if not name.startswith("_")}
    assert public == {"acquire", "available", "set_synced"}
