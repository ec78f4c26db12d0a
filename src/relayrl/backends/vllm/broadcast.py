"""The collective weight transport with vLLM engines in one process (`rollout.weight_transport =
"collective"`, rollout.engine = "vllm", ray.enabled false): the trainer (this process, rank 0)
broadcasts each version to every replica's vLLM worker, which receives it through vLLM's own
weight-transfer API in relayrl's engine (`relayrl.backends.vllm.transfer`): no file, no
safetensors round trip; on CUDA (NCCL) no host copy at all.

Set up at the first round, on the orchestrator's loop (where the samplers' calls run): the layout
of the committed version's loadable tensors (`VllmSampler.loadable`: what the file transport
would load), served with a TCP store on a free local port; the group (the Ray transport's
`relayrl.backends.ray.collective.Member`, this process its source: gloo on the CPU, NCCL when the
trainer's weights live on CUDA, which needs every engine on a GPU of its own: NCCL refuses two
ranks on one GPU) joined here in a thread while each replica's engine joins it
(`VllmSampler.join_transfer`, vLLM's `init_weight_transfer_engine`), all bounded by
JOIN_TIMEOUT_S; a replica that cannot join (`transfer_refusal`: its engine started without
relayrl's weight-transfer engine, or closed) is found before anyone waits. A group that cannot be
set up is warned about once (why) and every version goes by file from then on.

A round (`export_ahead`): the committed snapshot is broadcast from a thread (a header (round,
version), then each bucket packed into one reused staging buffer per dtype); each replica
receives it in its `load_weights`, which takes the sampler's gate as a file load does and then
drives its engine's start / update / finish. The round loads every replica at once: a replica
whose calls end first waits in its engine for the others (a broadcast needs every member), as with
vLLM's own NCCL engine. The round's payload (`Round`) carries the snapshot, so a replica whose
receive fails loads the version from its file instead; a failure on either side breaks the group
for good (the failing member leaves it, so the others' collectives fail at once, not at their
timeout), and the publisher uses the file from the next round on (`covers`).

Bytes staged in host memory (`STAGED`): each bucket packed on the CPU here, each bucket received
on the CPU in a worker.
"""

from __future__ import annotations

import asyncio
import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from relayrl.backends.local.streams import receive
from relayrl.backends.protocols import PendingExport, Trainer
from relayrl.backends.ray.collective import JOIN_TIMEOUT_S, OP_TIMEOUT_S, Member, backend_for, free_port, layout_of
from relayrl.types import Weights

if TYPE_CHECKING:
    from relayrl.backends.vllm.sampler import VllmSampler

__all__ = ["Round", "VllmBroadcast", "WeightGroupWarning"]

HOST = "127.0.0.1"  # the engines are this process's children, on this host


class WeightGroupWarning(RuntimeWarning):
    """The collective weight group with the vLLM engines could not be set up or broke: versions go by file."""


@dataclass(frozen=True, slots=True)
class Round:
    """`Weights.payload` of a version broadcast to the vLLM replicas: round `number`, and the
    committed `snapshot`, which a replica whose receive fails loads from its file instead."""

    number: int
    snapshot: Weights


class VllmBroadcast:
    """The weight publisher's `WeightBroadcast` over the trainer of this process and its
    `VllmSampler` replicas (see the module); `timeout_s`: each collective's bound
    (rollout.weight_load_timeout_s; 0: OP_TIMEOUT_S)."""

    name = "collective"

    def __init__(self, trainer: Trainer, samplers: Sequence[VllmSampler], timeout_s: float) -> None:
        self._trainer = trainer
        self._samplers = list(samplers)
        self._timeout_s = timeout_s if timeout_s > 0 else OP_TIMEOUT_S
        self._member: Member | None = None  # this process's, the group's source
        self._round = 0
        self.broken: str | None = None

    def covers(self, replicas: Sequence[int]) -> bool:
        if self.broken is not None or sorted(replicas) != list(range(len(self._samplers))):
            return False
        return self._member is None or all(s.transfer_member for s in self._samplers)

    async def export_ahead(self) -> PendingExport:
        weights = await self._trainer.export_weights()
        state = self._samplers[0].loadable(weights)
        if self._member is None:
            await self._join(state)
        if self.broken is not None:  # (the group could not be set up: this round goes by file too)
            return PendingExport(weights, _ready(weights))
        self._round += 1
        sent = asyncio.ensure_future(asyncio.to_thread(self._send, self._round, weights, state))
        return PendingExport(Weights(version=weights.version, payload=Round(self._round, weights)), self._done(sent, weights))

    async def _done(self, sent: asyncio.Future[None], weights: Weights) -> Weights:
        try:
            await asyncio.shield(sent)
        except Exception as exc:
            self._break(f"the trainer's broadcast failed: {type(exc).__name__}: {exc}")
        return weights

    def _send(self, round_: int, weights: Weights, state: Mapping[str, torch.Tensor]) -> None:
        """(thread) Broadcast `state`, the loadable tensors of the committed `weights`, as round `round_`."""
        member = self._member
        if member is None:
            raise RuntimeError("the weight group is not set up")
        try:
            receive(weights.ready, state.values(), member.device)  # (CUDA: after the commit's event)
            member.send(round_, weights.version, state)
        except BaseException:
            self._leave()  # (the receivers' collectives fail now, not at their timeout)
            raise

    async def _join(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set up the group (see the module); on failure, `broken` says why."""
        layout = layout_of(state)
        backend = backend_for(state)
        device = next(iter(state.values())).device
        port = free_port()
        world = 1 + len(self._samplers)
        names = ["this process (the trainer)", *(f"sampler replica {i}" for i in range(len(self._samplers)))]
        where = f"rollout.weight_transport = 'collective': the vLLM engines' weight group ({backend}, {HOST}:{port}, {world} members)"
        refusals = [r for r in (s.transfer_refusal() for s in self._samplers) if r is not None]
        if refusals:  # (before anyone waits in the group for a member that will not come)
            self._break(f"{where}: {refusals[0]}")
            return
        results: list[object] = []
        try:
            join = functools.partial(Member.join, HOST, port, backend, self._timeout_s, world - 1, source=0, layout=layout, device=device)
            own = asyncio.ensure_future(asyncio.to_thread(join))
            joins = [s.join_transfer(HOST, port, i, world, backend, self._timeout_s) for i, s in enumerate(self._samplers)]
            results = await asyncio.wait_for(asyncio.gather(own, *joins, return_exceptions=True), JOIN_TIMEOUT_S)
        except Exception as exc:
            results = [exc]
        failed = [(names[i], r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if not failed:
            self._member = cast(Member, results[0])
            return
        if isinstance(results[0], Member):
            results[0].close()
        await asyncio.gather(*(s.leave_transfer() for s in self._samplers), return_exceptions=True)
        who, error = failed[0]
        self._break(f"{where}: {who} failed to join: {type(error).__name__}: {error}")

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            warnings.warn(f"{why}; every version is loaded from a file from now on", WeightGroupWarning, stacklevel=2)
        self._leave()

    def _leave(self) -> None:
        member, self._member = self._member, None
        if member is not None:
            member.close()


async def _ready(weights: Weights) -> Weights:
    return weights
