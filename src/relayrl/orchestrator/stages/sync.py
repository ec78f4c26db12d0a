"""Weight sync: after each commit, push the newest version's weights to every sampler, through
the weight publisher (`relayrl.orchestrator.publisher`, which exports, loads, bounds and fails over).

Invariant: rounds never overlap (one task runs them one after another); a round that starts
after several commits pushes only the newest version; the window learns a version only after
every sampler in service has loaded it (one that fails to is retired, see `relayrl.orchestrator.replicas`);
the version each replica holds is recorded on its orchestrator-side `SamplerSlot`. A round waits
for each replica's load only: with rollout.interruptible (at max_staleness > 0) a replica loads
between two decode steps of a running generation, so the round does not wait for generations
(which go on with the new weights); otherwise a replica loads between calls, so the round waits
for its running `generate`. A replica
being restarted (see `relayrl.orchestrator.stages.sample`) is skipped: the publisher loads `pool.target`
or newer into it before it samples again.
"""

from __future__ import annotations

import asyncio

from relayrl.orchestrator.publisher import WeightPublisher
from relayrl.orchestrator.window import DispatchWindow
from relayrl.telemetry.tracer import Tracer


class VersionSignal:
    """The trainer's latest committed version, awaitable by the sync stage."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._changed = asyncio.Event()

    def set(self, version: int) -> None:
        self.version = version
        self._changed.set()

    async def newer_than(self, version: int) -> int:
        while self.version <= version:
            self._changed.clear()
            await self._changed.wait()
        return self.version


class SyncTimes:
    """Durations of completed sync rounds, drained by each step's record."""

    def __init__(self) -> None:
        self._pending: list[float] = []

    def add(self, seconds: float) -> None:
        self._pending.append(seconds)

    def drain(self) -> float:
        total, self._pending = sum(self._pending), []
        return total


async def sync_stage(
    *,
    publisher: WeightPublisher,
    committed: VersionSignal,
    window: DispatchWindow,
    tracer: Tracer,
    times: SyncTimes,
    synced: int,
) -> None:
    """Push each version committed after `synced` (the version the replicas already hold) to
    every replica in service, through `publisher` (which bounds each load by
    `rollout.weight_load_timeout_s` and fails over a replica whose load fails)."""
    while True:
        await committed.newer_than(synced)
        start = tracer.now()
        weights = await publisher.publish_newest()
        end = tracer.now()
        tracer.complete("orchestrator", "weight_sync", start, end, version=weights.version)
        times.add(end - start)
        synced = weights.version
        window.set_synced(synced)
