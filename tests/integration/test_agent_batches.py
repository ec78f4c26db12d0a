"""Several request batches in flight on one replica (rollout.agent_batches_per_replica): the
sampler stage rolls them out at once and puts every unfinished one back when the replica fails;
agent batches share the replica's sampling calls, and a batch's calls never wait for another
batch's episodes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from relayrl.orchestrator.replicas import ReplicaPool, SamplerSlot
from relayrl.orchestrator.stages.sample import serve_batches  # the stage body, without a publisher
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Group, Prompt, SampleRequest, TurnRequest, TurnResult
from support.agentutil import ScriptedSampler, make_rollout, requests_for, tiny_tokenizer


def _batch(first: int, n: int = 2) -> list[SampleRequest]:
    return [SampleRequest(first + i, Prompt(f"p{first + i}", "1+1=", "2"), [1, 2], 2, f"k{first + i}") for i in range(n)]


class _Rollout:
    """Records how many batches run at once; the batch holding group `fail_on` fails the replica
    once the other batch has started (which then runs until cancelled)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.running = 0
        self.most = 0
        self.started = asyncio.Event()
        self.count = 0

    async def __call__(self, slot: SamplerSlot, requests: list[SampleRequest]) -> list[Group]:
        self.running += 1
        self.count += 1
        self.most = max(self.most, self.running)
        try:
            if self.count == 2:
                self.started.set()
            await asyncio.wait_for(self.started.wait(), 5)  # both batches are in flight before either ends
            if self.fail_on is not None:
                if any(r.group_id == self.fail_on for r in requests):
                    raise RuntimeError("replica broke")
                await asyncio.Event().wait()  # the other batch is still rolling out when the replica fails
            await asyncio.sleep(0)
            return [Group(r.group_id, []) for r in requests]
        finally:
            self.running -= 1


def _pool() -> tuple[ReplicaPool, SamplerSlot]:
    tok = tiny_tokenizer()
    pool = ReplicaPool.of([ScriptedSampler(tok, lambda ctx: "2")], failover=True)
    return pool, pool.slots[0]


def _serve_two(width: int) -> tuple[list[Group], int]:
    """Two batches queued, served at most `width` at once until both are out: the groups sent on
    and the most batches that ran at once."""

    async def main() -> tuple[list[Group], int]:
        pool, slot = _pool()
        inbox: asyncio.Queue[list[SampleRequest]] = asyncio.Queue()
        outbox: asyncio.Queue[list[Group]] = asyncio.Queue()
        for first in (0, 10):
            inbox.put_nowait(_batch(first))
        rollout = _Rollout()
        if width == 1:
            rollout.started.set()  # nothing to wait for: one batch at a time
        serving = asyncio.create_task(serve_batches(slot, inbox, outbox, Tracer(None, {}), pool, rollout, width=width))
        got = [g for _ in range(2) for g in await asyncio.wait_for(outbox.get(), 10)]
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        return got, rollout.most

    return asyncio.run(main())


def test_a_replica_rolls_out_two_batches_at_once_and_sends_each_on() -> None:
    groups, most = _serve_two(width=2)
    assert sorted(g.group_id for g in groups) == [0, 1, 10, 11]
    assert most == 2


def test_with_one_batch_a_time_the_second_waits_for_the_first() -> None:
    groups, most = _serve_two(width=1)
    assert sorted(g.group_id for g in groups) == [0, 1, 10, 11]
    assert most == 1


def test_a_replica_that_fails_returns_every_unfinished_batch_and_loses_nothing() -> None:
    async def main() -> tuple[Exception, list[int], int, int]:
        pool, slot = _pool()
        inbox: asyncio.Queue[list[SampleRequest]] = asyncio.Queue()
        outbox: asyncio.Queue[list[Group]] = asyncio.Queue()
        for first in (0, 10, 20):
            inbox.put_nowait(_batch(first))
        failed = await asyncio.wait_for(serve_batches(slot, inbox, outbox, Tracer(None, {}), pool, _Rollout(fail_on=10), width=2), 10)
        assert failed is not None
        exc, requests = failed
        return exc, sorted(r.group_id for r in requests), inbox.qsize(), outbox.qsize()

    exc, lost, queued, sent = asyncio.run(main())
    assert str(exc) == "replica broke"
    assert lost == [0, 1, 10, 11]  # the failed batch and the one cancelled beside it: the caller puts them back
    assert (queued, sent) == (1, 0)  # the third batch was never taken


class _OneAtATime(ScriptedSampler):
    """A scripted sampler that fails the test if two of its calls ever overlap."""

    busy: bool = False

    async def generate_turns(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        assert not self.busy, "two sampling calls at once on one replica"
        self.busy = True
        try:
            await asyncio.sleep(0.01)
            return await super().generate_turns(requests)
        finally:
            self.busy = False


def test_two_agent_batches_on_one_replica_share_its_calls_and_do_not_wait_for_each_other() -> None:
    tok = tiny_tokenizer()
    a_done = asyncio.Event()

    async def agent(ctx: Any) -> float:
        import openai

        if ctx.prompt.prompt_id.startswith("b"):  # batch B's agents call only once batch A is over
            await asyncio.wait_for(a_done.wait(), 20)
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            for _ in range(2):
                await client.completions.create(model=ctx.model, prompt=ctx.prompt.text, max_tokens=2)
        return 1.0

    rollout = make_rollout(tok, agent, gather_s=30.0)  # a batch waited on for the other's episodes would stall the test
    sampler = _OneAtATime(tok, lambda ctx: "2")
    a = requests_for(tok, [Prompt(f"a{i}", "1+1=", "2") for i in range(2)])
    b = [SampleRequest(10 + r.group_id, Prompt(f"b{r.group_id}", r.prompt.text, "2"), r.prompt_tokens, 2, f"b{r.group_id}") for r in a]

    async def main() -> tuple[list[Group], list[Group]]:
        await rollout.start()
        try:
            slot = SamplerSlot(0, sampler)

            async def first() -> list[Group]:
                try:
                    return await rollout(slot, a)
                finally:
                    a_done.set()

            return await asyncio.wait_for(asyncio.gather(first(), rollout(slot, b)), 20)
        finally:
            await rollout.stop()

    ga, gb = asyncio.run(main())
    trajectories = [t for g in ga + gb for t in g.trajectories]
    assert sorted({(t.group_id, t.sample_index) for t in trajectories}) == [(g, i) for g in (0, 1, 10, 11) for i in (0, 1)]
    assert all(t.error is None and t.agent_reward == 1.0 for t in trajectories)
    assert not rollout._turns  # the replica's batcher ended with its last batch
