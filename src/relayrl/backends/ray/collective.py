"""The collective weight transport on Ray (`rollout.weight_transport = "collective"`): a
torch.distributed process group of the trainer actor (rank 0) and every sampler actor (ranks
1..R), over which each version is broadcast from the trainer's committed snapshot.

Set up once, when the actors are ready (`join`): the trainer actor picks a free port on its node
and the backend (NCCL when its weights live on CUDA, else gloo), every member joins the group
through a TCP store there, bounded by JOIN_TIMEOUT_S (a member that does not join, or fails to,
fails the build naming it), and the trainer sends the payload's layout once
(`broadcast_object_list`). Each collective after that is bounded by the group's timeout
(rollout.weight_load_timeout_s; 0: OP_TIMEOUT_S). The group is torn down when each actor closes.

A version: the trainer broadcasts a header (round, version), then the payload in flat buckets,
each of one dtype and at most BUCKET_BYTES (tensors are packed into a bucket in the layout's
order; tied names travel once). The trainer packs each bucket into one reused staging buffer per
dtype (so its memory beyond the snapshot is one bucket per dtype); a receiver receives into
buckets it allocated at the join (one version's bytes) and its worker copies out of their views,
so the bytes a worker loads are bit-identical to the trainer's snapshot. Buckets travel as bytes
(a uint8 view), so every dtype (bfloat16 included) goes over gloo and NCCL alike.

Failure: a collective that raises (a member died, a timeout) breaks the group for good on that
member (`Member.broken`), which leaves the group at once, so that its peers' pending collectives
fail then too (their sockets to it close) rather than at their timeout. A trainer whose broadcast failed reports it (`Broadcast.error`); a
receiver whose receive failed fetches the trainer's version from the object store instead
(the trainer actor's `export_weights`), so its load still lands; either way the driver
(`RayBroadcast`) broadcasts no more and the weight publisher uses the object store from then on.
A round that does not load every member (a replica restarting or retired; a restarted actor is a
new process, no member) is not broadcast either (`RayBroadcast.covers`).

Bytes staged in host memory (`relayrl.backends.transports.STAGED`): each bucket packed or
received on the CPU.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from relayrl.backends.protocols import PendingExport
from relayrl.backends.transports import STAGED
from relayrl.types import Weights

BUCKET_BYTES = 256 * 2**20  # a bucket's bytes at most (one tensor larger than this travels alone)
JOIN_TIMEOUT_S = 120.0  # every member must have joined the group within this
OP_TIMEOUT_S = 600.0  # a collective's bound when rollout.weight_load_timeout_s = 0


@dataclass(slots=True, frozen=True)
class Entry:
    """One distinct tensor of the payload: its bucket, offset and count (elements) and shape."""

    name: str
    bucket: int
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class Layout:
    """A version's tensors grouped into flat buckets of one dtype each; `aliases`: a tied name ->
    the name whose tensor it shares (sent once); `names`: every name in the payload's order."""

    names: tuple[str, ...]
    entries: tuple[Entry, ...]
    buckets: tuple[tuple[torch.dtype, int], ...]  # (dtype, elements)
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(n * torch.empty((), dtype=d).element_size() for d, n in self.buckets)


def layout_of(payload: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> Layout:
    """The layout of `payload` (a state dict): its distinct tensors by dtype, in order, cut into
    buckets of at most `bucket_bytes`."""
    first: dict[tuple[object, ...], str] = {}
    aliases: dict[str, str] = {}
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in payload.items():
        view = (int(t.untyped_storage()._cdata), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in first:
            aliases[name] = first[view]
            continue
        first[view] = name
        by_dtype.setdefault(t.dtype, []).append((name, t))
    entries: list[Entry] = []
    buckets: list[tuple[torch.dtype, int]] = []
    for dtype, tensors in by_dtype.items():
        size = torch.empty((), dtype=dtype).element_size()
        filled = None  # elements in the open bucket (None: none open)
        for name, t in tensors:
            n = t.numel()
            if filled is None or (filled + n) * size > bucket_bytes:
                buckets.append((dtype, 0))
                filled = 0
            entries.append(Entry(name, len(buckets) - 1, filled, n, tuple(t.shape)))
            filled += n
            buckets[-1] = (dtype, filled)
    return Layout(tuple(payload), tuple(entries), tuple(buckets), aliases)


def _check(layout: Layout, payload: Mapping[str, torch.Tensor]) -> None:
    if tuple(payload) != layout.names or any(tuple(payload[e.name].shape) != e.shape for e in layout.entries):
        raise ValueError("the exported weights do not match the layout the collective group was set up with")


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def backend_for(payload: Mapping[str, torch.Tensor]) -> str:
    """NCCL when the weights live on CUDA, else gloo."""
    return "nccl" if any(t.is_cuda for t in payload.values()) else "gloo"


@dataclass(slots=True, frozen=True)
class Broadcast:
    """`Weights.payload` of a version being broadcast: each receiver takes round `round` from the
    group. The trainer's result carries the same with `error` set when its broadcast failed."""

    round: int
    error: str | None = None


@dataclass(slots=True, frozen=True)
class Received:
    """A sampler actor's load result in a broadcast round: the version loaded, and whether its
    receive failed (it loaded that version from the object store instead)."""

    version: int
    fell_back: bool


class Member:
    """This process's membership of the group (one per actor)."""

    def __init__(self, rank: int, world: int, backend: str, layout: Layout, device: torch.device) -> None:
        self.rank, self.world, self.backend, self.layout, self.device = rank, world, backend, layout, device
        self.broken: str | None = None  # why a collective failed here (then none runs again)
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # the trainer's, per dtype: one bucket
        self._buckets: list[torch.Tensor] = []  # a receiver's, one version's
        self._views: dict[str, torch.Tensor] = {}

    @staticmethod
    def join(address: str, rank: int, world: int, backend: str, timeout_s: float, layout: Layout | None) -> Member:
        """Join the group at `address` (tcp://host:port) as `rank` (blocking; the trainer, rank 0,
        gives the `layout`, which the others receive)."""
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        box: list[Any] = [layout]
        dist.broadcast_object_list(box, src=0, device=device if backend == "nccl" else None)
        return Member(rank, world, backend, box[0], device)

    def _header(self, values: Sequence[int]) -> list[int]:
        import torch.distributed as dist

        header = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        return [int(x) for x in header.tolist()]

    def send(self, round_: int, version: int, payload: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: broadcast `payload` (the committed snapshot) as round `round_`. Raises (and
        breaks the group) when a collective fails."""
        import torch.distributed as dist

        self._usable()
        _check(self.layout, payload)
        try:
            self._header([round_, version])
            by_bucket: dict[int, list[Entry]] = {}
            for e in self.layout.entries:
                by_bucket.setdefault(e.bucket, []).append(e)
            for index, (dtype, numel) in enumerate(self.layout.buckets):
                staging = self._staging.get(dtype)
                if staging is None or staging.numel() < numel:
                    staging = self._staging[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
                flat = staging.narrow(0, 0, numel)
                for e in by_bucket.get(index, []):
                    flat.narrow(0, e.offset, e.numel).copy_(payload[e.name].reshape(-1))
                if flat.device.type == "cpu":
                    STAGED.add(flat.numel() * flat.element_size())
                dist.broadcast(flat.view(torch.uint8), src=0)
        except Exception as exc:
            self._abort(exc)
            raise

    def receive(self, round_: int) -> tuple[int, dict[str, torch.Tensor]]:
        """Ranks > 0: receive round `round_`; returns its version and the payload (views of this
        member's buckets, valid until the next receive). Raises (and breaks the group) when a
        collective fails or the round is not the one expected."""
        import torch.distributed as dist

        self._usable()
        try:
            got, version = self._header([0, 0])
            if got != round_:
                raise RuntimeError(f"the collective group is out of step: received round {got}, expected {round_}")
            if not self._buckets:
                self._buckets = [torch.empty(n, dtype=d, device=self.device) for d, n in self.layout.buckets]
                views = {e.name: self._buckets[e.bucket].narrow(0, e.offset, e.numel).view(e.shape) for e in self.layout.entries}
                self._views = {name: views[self.layout.aliases.get(name, name)] for name in self.layout.names}
            for bucket in self._buckets:
                dist.broadcast(bucket.view(torch.uint8), src=0)
                if bucket.device.type == "cpu":
                    STAGED.add(bucket.numel() * bucket.element_size())
        except Exception as exc:
            self._abort(exc)
            raise
        return version, dict(self._views)

    def _abort(self, exc: BaseException) -> None:
        """The group is broken: leave it at once, so that the peers' pending collectives fail now
        (their sockets to this member close) instead of at their timeout."""
        import torch.distributed as dist

        self.broken = f"{type(exc).__name__}: {exc}"
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass

    def _usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"the collective weight group is broken: {self.broken}")

    def close(self) -> None:
        """Leave the group (this process's default group)."""
        import torch.distributed as dist

        self._buckets, self._views, self._staging = [], {}, {}
        if dist.is_initialized():
            dist.destroy_process_group()


class RayBroadcast:
    """The driver's side of the collective transport (`relayrl.backends.transports.WeightBroadcast`)
    over a `RayTrainer` and the `RaySampler`s whose actors joined the group."""

    name = "collective"

    def __init__(self, trainer: Any, samplers: Sequence[Any]) -> None:
        self._trainer = trainer  # a RayTrainer
        self._samplers = list(samplers)  # RaySampler, replica i = rank i + 1
        self._round = 0
        self.broken: str | None = None

    def covers(self, replicas: Sequence[int]) -> bool:
        if self.broken is not None or sorted(replicas) != list(range(len(self._samplers))):
            return False
        return all(s.collective_member for s in self._samplers)

    async def export_ahead(self) -> PendingExport:
        self._round += 1
        pending: PendingExport = await self._trainer.broadcast_ahead(self._round)
        return PendingExport(pending.weights, self._done(pending))

    async def _done(self, pending: PendingExport) -> Weights:
        weights = await pending.done
        if isinstance(weights.payload, Broadcast) and weights.payload.error is not None:
            self.broken = weights.payload.error
        return weights


def join(trainer: Any, samplers: Sequence[Any], timeout_s: float) -> RayBroadcast:
    """Set up the group over a `RayTrainer` and `RaySampler`s (their actors ready); raises
    naming the member that did not join within JOIN_TIMEOUT_S, or why one failed to."""
    import ray

    host, port, backend = ray.get(trainer.actor.collective_address.remote(), timeout=JOIN_TIMEOUT_S)
    address = f"tcp://{host}:{port}"
    world = 1 + len(samplers)
    op_timeout = timeout_s if timeout_s > 0 else OP_TIMEOUT_S
    refs = [trainer.actor.join_collective.remote(address, 0, world, backend, op_timeout, None)]
    refs += [s.actor.join_collective.remote(address, i + 1, world, backend, op_timeout, trainer.actor) for i, s in enumerate(samplers)]
    names = ["the trainer actor", *(f"sampler actor {i}" for i in range(len(samplers)))]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=JOIN_TIMEOUT_S)
    where = f"rollout.weight_transport = 'collective': the weight process group ({backend}, {address}, {world} members)"
    late = [names[i] for i, r in enumerate(refs) if r not in ready]
    if late:  # (the build kills every actor on its failure)
        raise RuntimeError(f"{where}: {', '.join(late)} did not join within {JOIN_TIMEOUT_S:.0f}s")
    for name, ref in zip(names, refs, strict=True):
        try:
            ray.get(ref)
        except Exception as exc:
            raise RuntimeError(f"{where}: {name} failed to join: {type(exc).__name__}: {exc}") from exc
    for s in samplers:
        s.collective_member = True
    return RayBroadcast(trainer, samplers)


__all__ = ["BUCKET_BYTES", "Broadcast", "Layout", "Member", "RayBroadcast", "Received", "backend_for", "free_port", "join", "layout_of"]
