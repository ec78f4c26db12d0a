"""Sample: one task per sampler replica pulls request batches and generates them.

Invariant: each generate call is traced on its replica's lane with the version that sampled it
(from the results; the replica number and, for an empty result, the version come from the
orchestrator's `SamplerSlot`, never from the worker);
results leave in the order the call returned them. A replica whose `generate` raises is retired
(see `relayrl.replicas`) and its requests go back to the queue for the other replicas: no group
is lost or sampled twice.
"""

from __future__ import annotations

import asyncio

from relayrl.replicas import ReplicaPool, SamplerSlot
from relayrl.telemetry.tracer import Tracer
from relayrl.types import GenerateResult, SampleRequest


async def sampler_stage(
    slot: SamplerSlot,
    inbox: asyncio.Queue[list[SampleRequest]],
    outbox: asyncio.Queue[list[GenerateResult]],
    tracer: Tracer,
    pool: ReplicaPool,
) -> None:
    lane, sampler = f"sampler/{slot.replica}", slot.worker
    while pool.serves(slot):
        requests = await inbox.get()
        if not pool.serves(slot):  # retired by a failed weight load while it waited
            await inbox.put(requests)
            return
        start = tracer.now()
        try:
            results = await sampler.generate(requests)
        except Exception as exc:
            tracer.complete(lane, "generate_failed", start, tracer.now(), n=len(requests), error=f"{type(exc).__name__}: {exc}")
            pool.retire(slot, exc, "generate", [r.group_id for r in requests])
            await inbox.put(requests)  # another replica samples them
            return
        version = results[0].policy_version if results else slot.version
        tracer.complete(lane, "generate", start, tracer.now(), n=len(requests), version=version)
        await outbox.put(results)
