"""Weight publisher: the one way a policy version reaches the sampler replicas.

Three paths use it: the sync stage after each commit (`publish_newest`), a replica whose worker
died and was restarted (`restart`: the worker only comes back alive, without weights, and the
publisher loads the current version into it) and a resume (`publish_newest` once the trainer
state is restored, see `relayrl.orchestrator.checkpointing.restore`). Samplers never hold the
trainer: the weights they load always come from here.

It gets a version's weights from the trainer once (`export_weights`, through the trainer it was
given: the program's `BoundedTrainer`, so bounded by `train.call_timeout_s`) and keeps the newest
export, which a restarted replica loads; a trainer that can (`export_ahead`: the Ray trainer)
has a round's loads started with its export, each waiting for it where it runs, and a failed
export fails the round as the trainer's error (its loads cancelled, no replica blamed); it loads them into each replica bounded by
`rollout.weight_load_timeout_s`. A load that raises or exceeds its bound fails its replica: one
whose worker died and can be restarted (`Sampler.restartable`) stays in service, holding its old version,
and restarts when it next samples; any other is retired (`ReplicaPool.retire`, which fails the
run with the replica's own error when failover is off or no replica is left). Each failed load
is traced as `load_weights_failed` on the replica's lane.

Invariant: `pool.target` is the newest version exported (the version the current or last round
pushes); a replica's `SamplerSlot.version` changes only when a load of that version into it
returned; a replica being restarted is skipped by rounds and loads `pool.target` or newer before
it samples again; at most one export per round, none for a restart while a version is held.

Weight transports (`rollout.weight_transport`, `relayrl.backends.transports`): the trainer's
export and each replica's load move the bytes as the backend's transport does (direct, file, object
store); the collective one (`broadcast`, a `WeightBroadcast`) replaces a round's export and loads
when the round loads every replica it `covers`: the trainer broadcasts the version and each
replica receives it in its `load_weights` (the payload it is handed names the broadcast). A round
it does not cover, a restart and the evaluation go through the trainer's export instead. A
broadcast version is not kept as `_newest` (it holds no tensors): a restart exports again. The
rest of this class — which replicas load, the bounds, failover, restarts, tracing — and every
caller stay as they are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

from relayrl.backends.protocols import PendingExport, Trainer
from relayrl.backends.transports import WeightBroadcast
from relayrl.orchestrator.deadlines import bounded
from relayrl.orchestrator.replicas import ReplicaPool, SamplerSlot
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Weights

LOAD_KEY = "rollout.weight_load_timeout_s"


class WeightPublisher:
    """Publishes the trainer's versions to the replicas of `pool` (see module)."""

    def __init__(
        self, trainer: Trainer, pool: ReplicaPool, tracer: Tracer, *, load_timeout_s: float, broadcast: WeightBroadcast | None = None
    ) -> None:
        self._trainer = trainer  # bounded by train.call_timeout_s (the program's BoundedTrainer)
        self.pool = pool
        self._tracer = tracer
        self._load_timeout_s = load_timeout_s  # 0: no bound
        self._newest: Weights | None = None  # the newest export: what a restarted replica loads
        self._broadcast = broadcast  # the collective transport (None: the trainer's export moves every version)

    async def _export(self) -> Weights:
        """The trainer's newest weights, kept as the version replicas must hold from now on."""
        return self._keep(await self._trainer.export_weights())

    def _keep(self, weights: Weights, loadable: bool = True) -> Weights:
        """Keep exported `weights` as the version replicas must hold from now on (`loadable`
        False: a broadcast's, which a restarted replica cannot load: it exports again)."""
        if self._newest is None or weights.version >= self._newest.version:
            self._newest = weights if loadable else None
        self.pool.target = max(self.pool.target, weights.version)  # a replica restarting now loads this or newer
        return weights

    async def _load(self, slot: SamplerSlot, weights: Weights) -> None:
        # the worker's call is made in here: a round cancelled before this load started leaves no
        # coroutine that was never awaited
        await self._bounded(slot, slot.worker.load_weights(weights))

    async def _bounded(self, slot: SamplerSlot, load: Awaitable[None]) -> None:
        await bounded(load, self._load_timeout_s, f"sampler replica {slot.replica}: load_weights", LOAD_KEY)

    async def publish_newest(self, *, loadable: bool = False) -> Weights:
        """Export the trainer's newest version and load it into every replica in service but those
        being restarted; fail over each replica whose load fails (see module). Returns the weights
        (`loadable`: weights another engine can load, exported again after a broadcast)."""
        weights = await self._publish_newest()
        if loadable and self._newest is not weights:
            weights = await self._export()
        return weights

    async def _publish_newest(self) -> Weights:
        start = self._tracer.now()
        broadcast = self._broadcast
        covered = self._loading()
        pending: PendingExport | None
        if broadcast is not None and broadcast.covers([s.replica for s in covered]):
            pending = await broadcast.export_ahead()  # every covered replica loads it (below), even one restarting meanwhile
        else:
            broadcast = None
            pending = await self._trainer.export_ahead()
        outcomes: Sequence[object]
        if pending is None:
            weights = await self._export()
            slots = self._loading()
            outcomes = await asyncio.gather(*(self._load(s, weights) for s in slots), return_exceptions=True)
        else:  # the loads start now and wait for the export where they run, each bounded from its end
            slots = covered if broadcast is not None else self._loading()
            loads = [asyncio.ensure_future(s.worker.load_weights(pending.weights)) for s in slots]
            try:
                weights = await pending.done
                if weights.version < pending.weights.version:
                    raise RuntimeError(
                        f"the trainer exported version {weights.version}, older than its committed version {pending.weights.version}"
                    )
            except BaseException:  # the trainer's failure (or the round's cancellation), not the replicas'
                for load in loads:
                    load.cancel()
                await asyncio.gather(*loads, return_exceptions=True)
                raise
            self._keep(weights, loadable=broadcast is None)
            # a replica whose restart ended during the export holds an older version: it loads this one too
            late = [s for s in self._loading() if s not in slots and s.version < weights.version]
            if late and broadcast is not None:  # (it was no member of the broadcast: the trainer's export)
                weights = await self._export()
            outcomes = await asyncio.gather(
                *(self._bounded(s, load) for s, load in zip(slots, loads, strict=True)),
                *(self._load(s, weights) for s in late),
                return_exceptions=True,
            )
            slots += late
        for slot, outcome in zip(slots, outcomes, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise outcome  # the caller is being cancelled
                outcome = RuntimeError(f"load_weights was cancelled by the sampler: {outcome!r}")
            if isinstance(outcome, Exception):
                error = f"{type(outcome).__name__}: {outcome}"
                self._tracer.complete(
                    f"sampler/{slot.replica}", "load_weights_failed", start, self._tracer.now(), version=weights.version, error=error
                )
                if not slot.worker.restartable(outcome):
                    self.pool.retire(slot, outcome, "load_weights")  # raises unless another replica serves
                # else its worker died: it refuses to generate until it has restarted and loaded the newest weights
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                slot.version = weights.version
        return weights

    def _loading(self) -> list[SamplerSlot]:
        """The replicas a round loads: those in service but the ones being restarted (a restarting
        replica loads the newest weights itself)."""
        return [s for s in self.pool.slots if not s.restarting]

    async def restart(self, slot: SamplerSlot, exc: Exception, during: str) -> Exception | None:
        """Bring `slot`'s replica, whose worker died during `during` (raising `exc`), back into
        service: wait for its worker to be alive again (`slot.worker.restart()`), then load the newest
        version into it, again while a round pushed a newer one meanwhile. Returns why it cannot
        be restarted (None: it serves again, holding `pool.target` or newer)."""
        lane = f"sampler/{slot.replica}"
        slot.restarting = True  # sync rounds skip it: it loads the newest weights here
        start = self._tracer.now()
        try:
            await slot.worker.restart()
            weights = self._newest if self._newest is not None else await self._export()
            while True:
                await self._load(slot, weights)
                slot.version = weights.version
                if slot.version >= self.pool.target:
                    break
                newer = self._newest  # a round started (for a newer commit) while it was loading
                if newer is None or newer.version <= weights.version:
                    raise RuntimeError(
                        f"sampler replica {slot.replica}: the trainer's newest weights are version {weights.version}, "
                        f"older than the synced version {self.pool.target}"
                    )
                weights = newer
        except Exception as restart_exc:
            self._tracer.complete(lane, "restart_failed", start, self._tracer.now(), error=f"{type(restart_exc).__name__}: {restart_exc}")
            return restart_exc
        finally:
            slot.restarting = False
        self._tracer.complete(lane, "restart", start, self._tracer.now(), version=slot.version)
        self.pool.record_restart(slot, exc, during, slot.version)
        return None
