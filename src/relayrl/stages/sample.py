"""Sample: one task per sampler replica pulls request batches and generates them.

Invariant: each generate call is traced on its replica's lane with the version that sampled it;
results leave in the order the call returned them.
"""

from __future__ import annotations

import asyncio

from relayrl.backends.protocols import Sampler
from relayrl.telemetry.tracer import Tracer
from relayrl.types import GenerateResult, SampleRequest


async def sampler_stage(
    sampler: Sampler,
    inbox: asyncio.Queue[list[SampleRequest]],
    outbox: asyncio.Queue[list[GenerateResult]],
    tracer: Tracer,
) -> None:
    lane = f"sampler/{sampler.replica}"
    while True:
        requests = await inbox.get()
        start = tracer.now()
        results = await sampler.generate(requests)
        version = results[0].policy_version if results else sampler.version
        tracer.complete(lane, "generate", start, tracer.now(), n=len(requests), version=version)
        await outbox.put(results)
