"""The trainer's side of the collective transport with vLLM engines (relayrl.backends.vllm.broadcast),
without vLLM: stand-in replicas join the gloo group and receive each round as relayrl's engine in
vLLM's worker does, as a `Member` receiver (tests/vllm/test_vllm_collective.py runs the real
engines). A round arrives bit for bit; a group that cannot be set up warns once, hands the
replicas the plain snapshot (they load it by file) and covers no later round."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from relayrl.backends.protocols import Trainer
from relayrl.types import Weights

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


class Replica:
    """A stand-in `VllmSampler`: joins and receives over the group as relayrl's engine does."""

    def __init__(self, fail_join: bool = False) -> None:
        self.fail_join = fail_join
        self.transfer_member = False
        self.loaded: Weights | None = None
        self._member: Any = None

    def loadable(self, weights: Weights) -> dict[str, Any]:
        return dict(cast(dict[str, Any], weights.payload))

    def transfer_refusal(self) -> str | None:
        return "its engine was started without relayrl's weight-transfer engine" if self.fail_join else None

    async def join_transfer(self, host: str, port: int, receiver: int, world: int, backend: str, timeout_s: float) -> None:
        from relayrl.backends.ray.collective import Member

        self._member = await asyncio.to_thread(Member.join, host, port, backend, timeout_s, world - 1, receiver=receiver)
        self.transfer_member = True

    async def leave_transfer(self) -> None:
        if self._member is not None:
            self._member.close()
        self.transfer_member = False

    async def load_weights(self, weights: Weights) -> None:
        from relayrl.backends.vllm.broadcast import Round

        if not isinstance(weights.payload, Round):  # (the file transport's payload: the snapshot itself)
            self.loaded = weights
            return
        version, views = await asyncio.to_thread(self._member.receive, weights.payload.number)
        assert version == weights.version
        self.loaded = Weights(version, {k: v.clone() for k, v in views.items()})


class Commits:
    def __init__(self) -> None:
        self.weights = Weights(0, {})

    def commit(self, version: int) -> None:
        gen = torch.Generator().manual_seed(version)
        self.weights = Weights(
            version,
            {
                "embed": torch.randn(16, 8, generator=gen),
                "norm": torch.randn(8, generator=gen).to(torch.bfloat16),
                "proj": torch.randn(8, 8, generator=gen),
            },
        )

    async def export_weights(self) -> Weights:
        return self.weights


async def _round(broadcast: Any, replicas: list[Replica]) -> Weights:
    pending = await broadcast.export_ahead()
    loads = [asyncio.ensure_future(r.load_weights(pending.weights)) for r in replicas]
    weights = await pending.done
    await asyncio.gather(*loads)
    return cast(Weights, weights)


def test_each_round_reaches_every_replica_bit_for_bit() -> None:
    from relayrl.backends.vllm.broadcast import VllmBroadcast

    async def main() -> None:
        trainer, replicas = Commits(), [Replica(), Replica()]
        broadcast = VllmBroadcast(cast(Trainer, trainer), cast(Any, replicas), timeout_s=60)
        for version in (1, 2):
            trainer.commit(version)
            assert broadcast.covers([0, 1])
            await _round(broadcast, replicas)
            for r in replicas:
                assert r.loaded is not None and r.loaded.version == version
                got, want = cast(dict[str, Any], r.loaded.payload), cast(dict[str, Any], trainer.weights.payload)
                assert list(got) == list(want)
                assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
        assert broadcast.broken is None
        for r in replicas:
            await r.leave_transfer()

    asyncio.run(main())


def test_a_group_that_cannot_be_set_up_warns_once_and_every_version_goes_by_file() -> None:
    from relayrl.backends.vllm.broadcast import VllmBroadcast, WeightGroupWarning

    async def main() -> None:
        trainer, replicas = Commits(), [Replica(), Replica(fail_join=True)]
        broadcast = VllmBroadcast(cast(Trainer, trainer), cast(Any, replicas), timeout_s=60)
        trainer.commit(1)
        with pytest.warns(WeightGroupWarning, match=r"weight group \(gloo, .*3 members\): its engine was started without"):
            await _round(broadcast, replicas)
        assert all(r.loaded is trainer.weights for r in replicas)  # the snapshot itself: each loads it by file
        assert not any(r.transfer_member for r in replicas)  # none joined: nobody waits for a member that will not come
        assert broadcast.broken is not None and "rollout.weight_transport = 'collective'" in broadcast.broken
        assert not broadcast.covers([0, 1])

    asyncio.run(main())
