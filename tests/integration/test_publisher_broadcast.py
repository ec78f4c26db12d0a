"""The weight publisher with a collective transport (issue 31 §1, `WeightPublisher(broadcast=...)`):
a round that loads every replica the broadcast covers goes by broadcast (the trainer's export is
not called), any other round, a restart and a caller that needs loadable weights go through the
trainer's export; a broadcast version is never what a restarted replica loads."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from relayrl.backends.protocols import PendingExport
from relayrl.backends.sim.workers import SimSampler, SimTrainer
from relayrl.orchestrator.publisher import WeightPublisher
from relayrl.orchestrator.replicas import ReplicaPool
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Weights
from support.simutil import sim_config

BROADCAST = "broadcast-payload"


class FakeBroadcast:
    name = "collective"

    def __init__(self, trainer: SimTrainer) -> None:
        self.trainer = trainer
        self.rounds = 0
        self.asked: list[list[int]] = []

    def covers(self, replicas: Sequence[int]) -> bool:
        self.asked.append(sorted(replicas))
        return sorted(replicas) == [0, 1]

    async def export_ahead(self) -> PendingExport:
        self.rounds += 1
        version = self.trainer.version

        async def done() -> Weights:
            return Weights(version, BROADCAST)

        return PendingExport(Weights(version, BROADCAST), done())


class Recording(SimSampler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.payloads: list[object] = []

    async def load_weights(self, weights: Weights) -> None:
        self.payloads.append(weights.payload)
        await super().load_weights(weights)

    def restartable(self, exc: BaseException) -> bool:
        return True

    async def restart(self) -> None:  # (alive again at once, holding no weights)
        return None


class CountsExports(SimTrainer):
    exports = 0

    async def export_weights(self) -> Weights:
        self.exports += 1
        return await super().export_weights()


def _setup() -> tuple[WeightPublisher, ReplicaPool, list[Recording], CountsExports, FakeBroadcast]:
    cfg = sim_config()
    trainer = CountsExports(cfg.sim)
    samplers = [Recording(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=i) for i in range(2)]
    pool = ReplicaPool.of(samplers, failover=True)
    broadcast = FakeBroadcast(trainer)
    publisher = WeightPublisher(trainer, pool, Tracer(None, {}), load_timeout_s=5.0, broadcast=broadcast)
    return publisher, pool, samplers, trainer, broadcast


def test_a_round_loading_every_member_is_broadcast_and_the_trainer_exports_nothing() -> None:
    async def main() -> None:
        publisher, pool, samplers, trainer, broadcast = _setup()
        trainer.version = 1
        weights = await publisher.publish_newest()
        assert weights.version == 1 and weights.payload == BROADCAST
        assert broadcast.rounds == 1 and trainer.exports == 0
        assert all(s.payloads == [BROADCAST] for s in samplers)
        assert [slot.version for slot in pool.slots] == [1, 1] and pool.target == 1
        # a caller that loads the weights elsewhere (a resume's owed evaluation) gets the trainer's export
        trainer.version = 2
        loadable = await publisher.publish_newest(loadable=True)
        assert loadable.version == 2 and loadable.payload != BROADCAST and trainer.exports == 1

    asyncio.run(main())


def test_a_round_that_skips_a_restarting_replica_and_the_restart_use_the_trainer_s_export() -> None:
    async def main() -> None:
        publisher, pool, samplers, trainer, broadcast = _setup()
        trainer.version = 1
        await publisher.publish_newest()  # broadcast
        slot0, slot1 = pool.slots
        slot1.restarting = True
        trainer.version = 2
        weights = await publisher.publish_newest()
        assert broadcast.asked[-1] == [0] and broadcast.rounds == 1  # not covered: no broadcast
        assert weights.payload != BROADCAST and trainer.exports == 1
        assert samplers[0].payloads[-1] != BROADCAST and slot0.version == 2
        slot1.restarting = False
        assert await publisher.restart(slot1, RuntimeError("died"), "generate") is None
        assert samplers[1].payloads[-1] != BROADCAST and slot1.version == 2  # the newest export, never a broadcast's

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asyncio.run(main())


def test_a_restart_after_a_broadcast_round_exports_again() -> None:
    async def main() -> None:
        publisher, pool, samplers, trainer, _ = _setup()
        trainer.version = 1
        await publisher.publish_newest()
        assert trainer.exports == 0
        slot = pool.slots[0]
        assert await publisher.restart(slot, RuntimeError("died"), "generate") is None
        assert trainer.exports == 1 and samplers[0].payloads[-1] != BROADCAST and slot.version == 1

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asyncio.run(main())
