"""Weight sync: after each commit, push the newest version's weights to every sampler.

Invariant: rounds never overlap (one task runs them one after another); a round that starts
after several commits pushes only the newest version; the window learns a version only after
every sampler in service has loaded it (one that fails to is retired, see `relayrl.orchestrator.replicas`);
the version each replica holds is recorded on its orchestrator-side `SamplerSlot`. A replica
being restarted (see `relayrl.orchestrator.stages.sample`) is skipped: it loads `pool.target` or newer itself
before it samples again.
"""

from __future__ import annotations

import asyncio

from relayrl.backends.protocols import Trainer
from relayrl.orchestrator.deadlines import bounded
from relayrl.orchestrator.replicas import ReplicaPool, SamplerSlot
from relayrl.orchestrator.window import DispatchWindow
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Weights

LOAD_KEY = "rollout.weight_load_timeout_s"


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


async def _load(slot: SamplerSlot, weights: Weights, timeout_s: float) -> None:
    # the worker's call is made in here: a round cancelled before this load started leaves no
    # coroutine that was never awaited
    await bounded(slot.worker.load_weights(weights), timeout_s, f"sampler replica {slot.replica}: load_weights", LOAD_KEY)


async def sync_stage(
    trainer: Trainer,
    pool: ReplicaPool,
    committed: VersionSignal,
    window: DispatchWindow,
    tracer: Tracer,
    times: SyncTimes,
    synced: int = 0,
    load_timeout_s: float = 0.0,
) -> None:
    """Push each newly committed version to every replica in service; a load that raises or
    exceeds `load_timeout_s` (0: no bound) fails its replica."""
    while True:
        await committed.newer_than(synced)
        start = tracer.now()
        weights = await trainer.export_weights()
        pool.target = max(pool.target, weights.version)  # a replica restarting now loads this or newer
        slots = [s for s in pool.slots if not s.restarting]  # a restarting replica loads the newest weights itself
        outcomes = await asyncio.gather(*(_load(s, weights, load_timeout_s) for s in slots), return_exceptions=True)
        for slot, outcome in zip(slots, outcomes):
            if isinstance(outcome, asyncio.CancelledError):
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise outcome  # this stage is being cancelled
                outcome = RuntimeError(f"load_weights was cancelled by the sampler: {outcome!r}")
            if isinstance(outcome, Exception) and slot.worker.restartable(outcome):
                # its worker died: it refuses to generate until it has restarted and loaded the newest weights
                error = f"{type(outcome).__name__}: {outcome}"
                tracer.complete(f"sampler/{slot.replica}", "load_weights_failed", start, tracer.now(), version=weights.version, error=error)
            elif isinstance(outcome, Exception):
                error = f"{type(outcome).__name__}: {outcome}"
                tracer.complete(f"sampler/{slot.replica}", "load_weights_failed", start, tracer.now(), version=weights.version, error=error)
                pool.retire(slot, outcome, "load_weights")  # raises unless another replica serves
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                slot.version = weights.version
        end = tracer.now()
        tracer.complete("orchestrator", "weight_sync", start, end, version=weights.version)
        times.add(end - start)
        synced = weights.version
        window.set_synced(synced)
