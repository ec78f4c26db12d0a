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
error, not the replica's. A replica whose `generate` raises is retired
(see `relayrl.orchestrator.replicas`) and its requests go back to the queue for the other replicas: no group
is lost or sampled twice. A replica whose worker died and can be restarted (`Sampler.restartable`,
the Ray backend) re-queues its requests, restarts (the weight publisher loads the version the
sync stage pushes, or newer, into it) and samples again; one that cannot be restarted is retired.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Protocol

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
) -> None:
    """Serve `slot`'s replica: a sampling call that raises or exceeds its bound fails the
    replica; an environment's error fails the run. A replica whose worker died is restarted
    through `publisher`, which loads it with the current weights."""
    lane = f"sampler/{slot.replica}"
    sampler = slot.worker
    while pool.serves(slot):
        requests = await inbox.get()
        if not pool.serves(slot):  # retired by a failed weight load while it waited
            await inbox.put(requests)
            return
        start = tracer.now()
        try:
            groups = await rollout(slot, requests)
        except (EnvironmentStepError, EpisodePromptTooLong, AgentError):
            raise
        except Exception as exc:
            tracer.complete(lane, "generate_failed", start, tracer.now(), n=len(requests), error=f"{type(exc).__name__}: {exc}")
            if sampler.restartable(exc):
                await inbox.put(requests)  # the other replicas sample them while this one restarts
                failed = await publisher.restart(slot, exc, "generate")
                if failed is None:
                    continue
                pool.retire(slot, failed, "restart", [r.group_id for r in requests])
                return
            pool.retire(slot, exc, "generate", [r.group_id for r in requests])
            await inbox.put(requests)  # another replica samples them
            return
        await outbox.put(groups)
