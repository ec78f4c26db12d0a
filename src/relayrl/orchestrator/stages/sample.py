"""Sample: one task per sampler replica pulls request batches and rolls them out into groups:
single completions (`SingleTurn`: one `generate` call) or multi-turn episodes with an environment
(`MultiTurn`: orchestrator/stages/episodes.py, one `generate_turns` call per turn).

Invariant: each sampling call is traced on its replica's lane with the version that sampled it
(from the results: the oldest; with rollout.interruptible, `versions` lists every version that
sampled a token when a weight load landed during the call; the replica number and, for an empty result, the version come from the
orchestrator's `SamplerSlot`, never from the worker), each bounded by `timeout_s`;
groups leave in the order the call returned them. An environment's error that fails the run
(EnvironmentStepError: a wrong type, strict_environment, stuck calls), an agent's under
strict_agents (AgentError), or a prompt that leaves an episode no room, fails it as the task's
error, not the replica's. A replica whose `generate` raises is retired (see
`relayrl.orchestrator.replicas`) and its requests go back to the queue for the other replicas:
no group is lost or sampled twice; with several batches in flight on a replica (agent runs:
rollout.agent_batches_per_replica), all of those not finished go back. A replica whose worker
died and can be restarted (`Sampler.restartable`, the Ray backend) re-queues its requests,
restarts (the weight publisher loads the version the sync stage pushes, or newer, into it) and
samples again; one that cannot be restarted is retired.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Protocol

from relayrl.orchestrator.deadlines import bounded
from relayrl.orchestrator.publisher import WeightPublisher
from relayrl.orchestrator.replicas import ReplicaPool, SamplerSlot, forget_episodes
from relayrl.orchestrator.stages.agents import AgentError
from relayrl.orchestrator.stages.collect import to_group
from relayrl.orchestrator.stages.episodes import EnvironmentStepError, EpisodePromptTooLong, EpisodeRunner
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Group, SampleRequest, TurnRequest, TurnResult, generate_sizes


class Rollout(Protocol):
    async def __call__(self, slot: SamplerSlot, requests: list[SampleRequest]) -> list[Group]:
        """Sample `requests` on `slot`'s replica into groups, tracing each sampling call."""
        ...


class SingleTurn:
    """One completion per sample: one `generate` call per batch, bounded by `timeout_s` (0: none)."""

    def __init__(self, tracer: Tracer, *, timeout_s: float = 0.0) -> None:
        self._tracer = tracer
        self._timeout_s = timeout_s

    async def __call__(self, slot: SamplerSlot, requests: list[SampleRequest]) -> list[Group]:
        start = self._tracer.now()
        results = await bounded(
            slot.worker.generate(requests), self._timeout_s, f"sampler replica {slot.replica}: generate", "rollout.generate_timeout_s"
        )
        version = min((r.policy_version for r in results), default=slot.version)
        used = sorted({v for r in results for c in r.completions if c.versions for _, v in c.versions})
        extra: dict[str, object] = {"versions": used} if len(used) > 1 else {}  # rollout.interruptible: a load landed meanwhile
        extra.update(generate_sizes(results))  # the decode batch's rows and passes (relayrl.plan's cost model)
        self._tracer.complete(f"sampler/{slot.replica}", "generate", start, self._tracer.now(), n=len(requests), version=version, **extra)
        return [to_group(r) for r in results]


class MultiTurn:
    """Multi-turn episodes (orchestrator/stages/episodes.py): one `generate_turns` call per turn, each bounded
    by `timeout_s` (0: none)."""

    def __init__(self, runner: EpisodeRunner, *, timeout_s: float = 0.0) -> None:
        self._runner = runner
        self._timeout_s = timeout_s

    async def __call__(self, slot: SamplerSlot, requests: list[SampleRequest]) -> list[Group]:
        sampler, what = slot.worker, f"sampler replica {slot.replica}: generate_turns"

        async def turn(asks: list[TurnRequest]) -> list[TurnResult]:
            return await bounded(sampler.generate_turns(asks), self._timeout_s, what, "rollout.generate_timeout_s")

        return await self._runner.run(requests, turn, lane=f"sampler/{slot.replica}", end=functools.partial(forget_episodes, sampler))


async def sampler_stage(
    slot: SamplerSlot,
    inbox: asyncio.Queue[list[SampleRequest]],
    outbox: asyncio.Queue[list[Group]],
    tracer: Tracer,
    pool: ReplicaPool,
    rollout: Rollout,
    *,
    publisher: WeightPublisher,
    width: int = 1,
) -> None:
    """Serve `slot`'s replica, rolling out at most `width` request batches at once (agent runs:
    rollout.agent_batches_per_replica; else 1): a sampling call that raises or exceeds its bound
    fails the replica, and every batch it was rolling out goes back to the queue; an
    environment's error fails the run. A replica whose worker died is restarted through
    `publisher`, which loads it with the current weights."""
    while pool.serves(slot):
        failed = await serve_batches(slot, inbox, outbox, tracer, pool, rollout, width=width)
        if failed is None:  # retired meanwhile (a failed weight load)
            return
        exc, requests = failed
        group_ids = [r.group_id for r in requests]
        if slot.worker.restartable(exc):
            await inbox.put(requests)  # the other replicas sample them while this one restarts
            reason = await publisher.restart(slot, exc, "generate")
            if reason is None:
                continue
            pool.retire(slot, reason, "restart", group_ids)
            return
        pool.retire(slot, exc, "generate", group_ids)
        await inbox.put(requests)  # another replica samples them
        return


async def serve_batches(
    slot: SamplerSlot,
    inbox: asyncio.Queue[list[SampleRequest]],
    outbox: asyncio.Queue[list[Group]],
    tracer: Tracer,
    pool: ReplicaPool,
    rollout: Rollout,
    *,
    width: int,
) -> tuple[Exception, list[SampleRequest]] | None:
    """Roll out batches from `inbox` on `slot`, at most `width` at once, until one fails the
    replica: the others are then cancelled, and the failure is returned with the requests of
    every batch that did not finish. None: the replica was retired meanwhile (a batch taken
    since is put back; those it was rolling out finish). An error of the task fails the run
    (raised); cancelling this cancels the batches in flight."""
    lane = f"sampler/{slot.replica}"
    running: dict[asyncio.Task[list[Group]], tuple[list[SampleRequest], float]] = {}
    getter: asyncio.Task[list[SampleRequest]] | None = None
    try:
        while True:
            if getter is None and len(running) < width and pool.serves(slot):
                getter = asyncio.create_task(inbox.get(), name=f"{lane}/inbox")
            if getter is None and not running:  # retired (a failed weight load) once its batches ended
                return None
            waiting: set[asyncio.Task[Any]] = {*running, *([getter] if getter is not None else [])}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            failure: Exception | None = None
            for task in [t for t in running if t in done]:
                requests, start = running.pop(task)
                try:
                    groups = task.result()
                except (EnvironmentStepError, EpisodePromptTooLong, AgentError):
                    raise
                except Exception as exc:
                    tracer.complete(lane, "generate_failed", start, tracer.now(), n=len(requests), error=f"{type(exc).__name__}: {exc}")
                    failure = failure or exc
                    running[task] = (requests, start)  # not finished: back to the queue with the rest
                    continue
                await outbox.put(groups)
            if failure is not None:
                lost = await _cancel(running, outbox)
                if getter is not None:
                    lost.extend(await _cancel_get(getter) or [])
                    getter = None
                return failure, lost
            if getter is not None and getter in done:
                requests = getter.result()
                getter = None
                if not pool.serves(slot):  # retired by a failed weight load while it waited
                    await inbox.put(requests)
                    continue
                task = asyncio.create_task(rollout(slot, requests), name=f"{lane}/rollout")
                running[task] = (requests, tracer.now())
    finally:  # cancelled, or the run fails: nothing is put back (the run ends)
        if getter is not None:
            await _cancel_get(getter)
        await _cancel(running, None)


async def _cancel_get(getter: asyncio.Task[list[SampleRequest]]) -> list[SampleRequest] | None:
    """Cancel a pending `inbox.get()`; the batch it had taken meanwhile, if any."""
    getter.cancel()
    await asyncio.wait([getter])
    return None if getter.cancelled() else getter.result()


async def _cancel(
    running: dict[asyncio.Task[list[Group]], tuple[list[SampleRequest], float]], outbox: asyncio.Queue[list[Group]] | None
) -> list[SampleRequest]:
    """Cancel and wait for the batches in `running` (emptied); those that finished meanwhile go
    to `outbox` (None: dropped, the run ends); returns the requests of the others."""
    tasks = list(running)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    lost: list[SampleRequest] = []
    for task in tasks:
        requests, _ = running.pop(task)
        if not task.cancelled() and task.exception() is None:
            if outbox is not None:
                await outbox.put(task.result())
        else:
            lost.extend(requests)
    return lost
