"""Sample: one task per sampler replica pulls request batches and generates them.

Invariant: each generate call is traced on its replica's lane with the version that sampled it
(from the results; the replica number and, for an empty result, the version come from the
orchestrator's `SamplerSlot`, never from the worker);
results leave in the order the call returned them. A replica whose `generate` raises is retired
(see `relayrl.replicas`) and its requests go back to the queue for the other replicas: no group
is lost or sampled twice. A replica whose worker died and can be restarted (`Restartable`, the
Ray backend) re-queues its requests, restarts holding the version the sync stage pushes or newer,
and samples again; one that cannot be restarted is retired.
"""

from __future__ import annotations

import asyncio

from relayrl.deadlines import bounded
from relayrl.replicas import ReplicaPool, Restartable, SamplerSlot
from relayrl.telemetry.tracer import Tracer
from relayrl.types import GenerateResult, SampleRequest


async def sampler_stage(
    slot: SamplerSlot,
    inbox: asyncio.Queue[list[SampleRequest]],
    outbox: asyncio.Queue[list[GenerateResult]],
    tracer: Tracer,
    pool: ReplicaPool,
    timeout_s: float = 0.0,
) -> None:
    """Serve `slot`'s replica: each generate call bounded by `timeout_s` (0: none); one that
    exceeds it fails the replica like one that raised."""
    lane, sampler = f"sampler/{slot.replica}", slot.worker
    while pool.serves(slot):
        requests = await inbox.get()
        if not pool.serves(slot):  # retired by a failed weight load while it waited
            await inbox.put(requests)
            return
        start = tracer.now()
        try:
            results = await bounded(
                sampler.generate(requests), timeout_s, f"sampler replica {slot.replica}: generate", "rollout.generate_timeout_s"
            )
        except Exception as exc:
            tracer.complete(lane, "generate_failed", start, tracer.now(), n=len(requests), error=f"{type(exc).__name__}: {exc}")
            if isinstance(sampler, Restartable) and sampler.restartable(exc):
                await inbox.put(requests)  # the other replicas sample them while this one restarts
                failed = await _restart(slot, sampler, exc, tracer, pool)
                if failed is None:
                    continue
                pool.retire(slot, failed, "restart", [r.group_id for r in requests])
                return
            pool.retire(slot, exc, "generate", [r.group_id for r in requests])
            await inbox.put(requests)  # another replica samples them
            return
        version = results[0].policy_version if results else slot.version
        tracer.complete(lane, "generate", start, tracer.now(), n=len(requests), version=version)
        await outbox.put(results)


async def _restart(slot: SamplerSlot, sampler: Restartable, exc: Exception, tracer: Tracer, pool: ReplicaPool) -> Exception | None:
    """Bring a replica whose worker died back into service holding the version the sync stage
    pushes (`pool.target`) or newer; returns why it cannot be restarted (None: it serves again)."""
    lane = f"sampler/{slot.replica}"
    slot.restarting = True  # sync rounds skip it: it loads the newest weights itself
    start = tracer.now()
    try:
        version = await sampler.restart(pool.target)
        while version < pool.target:  # a round started (for a newer commit) while it was loading
            version = await sampler.restart(pool.target)
    except Exception as restart_exc:
        tracer.complete(lane, "restart_failed", start, tracer.now(), error=f"{type(restart_exc).__name__}: {restart_exc}")
        return restart_exc
    finally:
        slot.restarting = False
    slot.version = version
    tracer.complete(lane, "restart", start, tracer.now(), version=version)
    pool.record_restart(slot, exc, "generate", version)
    return None
