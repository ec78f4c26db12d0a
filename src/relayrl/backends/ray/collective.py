"""The collective weight transport on Ray (`rollout.weight_transport = "collective"`): a
torch.distributed process group of the trainer actor (rank 0) and every sampler actor (ranks
1..R), over which each version is broadcast from the trainer's committed snapshot.

Set up once, when the actors are ready (`join`): the trainer actor picks a free port on its node
and the backend (NCCL when its weights live on CUDA, else gloo), serves a TCP store there and sets
the payload's layout in it; every member joins through that store (`Member.join`), bounded by
JOIN_TIMEOUT_S (a member that does not join, or fails to, fails the build naming it). Each group
is made from the store directly (`OwnGroup`), never the default process group, so any process
can join beside groups of its own: a sampler actor whose vLLM engine was started with relayrl's
weight-transfer engine has that engine's worker join as the receiver in its place
(`relayrl.backends.vllm.transfer`), so each version lands in the engine, not in the actor and a
file. Each collective after that is bounded by the group's timeout
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
fail then too (their sockets to it close) rather than at their timeout. A trainer whose
broadcast failed reports it (`Broadcast.error`); a receiver whose receive failed (in the actor or
in its engine) fetches the trainer's version from the object store instead (the trainer actor's
`export_weights`), so its load still lands; either way the driver
(`RayBroadcast`) broadcasts no more and the weight publisher uses the object store from then on.
A round that does not load every member (a replica restarting or retired; a restarted actor is a
new process, no member) is not broadcast either (`RayBroadcast.covers`).

Streaming from the sharded trainer (train.world_size = N > 1, `StreamLayout`): no rank gathers
the model. Each rank's `ShardSpec` says which rows of dim 0 of each tensor it holds (FSDP2's
`Shard(0)`: contiguous runs in rank order, the last ones possibly short or empty; a tensor not
sharded is rank 0's); the receivers' buckets are cut as one trainer's payload would be, and per
bucket each rank sends its rows of the bucket's tensors as one flat tensor (a `Send`). A rank's
committed snapshot is its sends (`pack_shards`, 1/N of a version), broadcast as they are (no
staging). The group is one process group per rank, of its own (`OwnGroup`: built from a TCP
store that rank 0 serves, since the ranks hold the default group for FSDP), of that rank (its
rank 0) and every receiver (rank 1 + its index): rank 0 broadcasts the header in its group, then
the sends travel in the layout's order, each in its rank's group; a receiver copies each send's
pieces into the rows of its buckets (`place`; a send of one piece is received in place, the others
through one staging bucket per dtype), so it holds the trainer's weights bit for bit. A member
that fails leaves all its groups at once (their peers' collectives fail then), as above; rank 0
names the ranks whose part failed in its `Broadcast.error`.

Bytes staged in host memory (`relayrl.backends.transports.STAGED`): each bucket packed or
received on the CPU (streaming: each send received on the CPU; a rank's snapshot is no staging).
"""

from __future__ import annotations

import math
import pickle
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import torch

from relayrl.backends.protocols import PendingExport
from relayrl.backends.transports import STAGED
from relayrl.types import Weights

BUCKET_BYTES = 256 * 2**20  # a bucket's bytes at most (one tensor larger than this travels alone)
JOIN_TIMEOUT_S = 120.0  # every member must have joined the group within this
GROUP_PREFIX = "weights/"  # source s's group meets under "weights/s/" in the store
LAYOUT_KEY = "layout"  # the store's key of the version layout (source 0 sets it)
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
    distinct: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for name, t in payload.items():
        view = (int(t.untyped_storage()._cdata), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in first:
            aliases[name] = first[view]
            continue
        first[view] = name
        distinct.append((name, t.dtype, tuple(t.shape)))
    return _cut(tuple(payload), distinct, aliases, bucket_bytes)


def _cut(
    names: tuple[str, ...], distinct: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], aliases: Mapping[str, str], bucket_bytes: int
) -> Layout:
    """The layout of the `distinct` tensors (name, dtype, shape): grouped by dtype, in order, cut
    into buckets of at most `bucket_bytes` (one larger tensor alone)."""
    by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, dtype, shape in distinct:
        by_dtype.setdefault(dtype, []).append((name, shape))
    entries: list[Entry] = []
    buckets: list[tuple[torch.dtype, int]] = []
    for dtype, tensors in by_dtype.items():
        size = torch.empty((), dtype=dtype).element_size()
        filled = None  # elements in the open bucket (None: none open)
        for name, shape in tensors:
            n = math.prod(shape)
            if filled is None or (filled + n) * size > bucket_bytes:
                buckets.append((dtype, 0))
                filled = 0
            entries.append(Entry(name, len(buckets) - 1, filled, n, shape))
            filled += n
            buckets[-1] = (dtype, filled)
    return Layout(names, tuple(entries), tuple(buckets), dict(aliases))


def check_layout(layout: Layout, payload: Mapping[str, torch.Tensor]) -> None:
    """Raises unless `payload` has `layout`'s names, in order, and shapes."""
    if tuple(payload) != layout.names or any(tuple(payload[e.name].shape) != e.shape for e in layout.entries):
        raise ValueError("the exported weights do not match the layout the collective group was set up with")


def send_buckets(
    layout: Layout,
    payload: Mapping[str, torch.Tensor],
    staging: dict[torch.dtype, torch.Tensor],
    device: torch.device,
    send: Callable[[torch.Tensor], object],
) -> None:
    """Pack `payload` into `layout`'s buckets one at a time, each in the reused staging buffer of its
    dtype (`staging`, grown here, on `device`), and `send` each as bytes (a uint8 view); a bucket
    packed on the CPU counts as staged in host memory."""
    by_bucket: dict[int, list[Entry]] = {}
    for e in layout.entries:
        by_bucket.setdefault(e.bucket, []).append(e)
    for index, (dtype, numel) in enumerate(layout.buckets):
        buffer = staging.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = staging[dtype] = torch.empty(numel, dtype=dtype, device=device)
        flat = buffer.narrow(0, 0, numel)
        for e in by_bucket.get(index, []):
            flat.narrow(0, e.offset, e.numel).copy_(payload[e.name].reshape(-1))
        if flat.device.type == "cpu":
            STAGED.add(flat.numel() * flat.element_size())
        send(flat.view(torch.uint8))


# -- streaming from the sharded trainer (train.world_size = N > 1) ------------------------------


@dataclass(slots=True, frozen=True)
class ShardSpec:
    """What one trainer rank holds of the payload: every name (payload order), the tied names
    (`aliases`: name -> the name sent instead), and per distinct tensor (name, dtype, full shape,
    rows of dim 0 held here). A 0-d tensor counts as one row; one held whole by every rank
    (not sharded) is sent by rank 0 alone (the others hold 0 of its rows)."""

    names: tuple[str, ...]
    aliases: Mapping[str, str]
    tensors: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]


@dataclass(slots=True, frozen=True)
class Piece:
    """One source rank's rows of one tensor inside one of its sends: at `offset` (elements) in
    the send's flat bucket, at `start` (elements) in the full tensor, `numel` elements."""

    name: str
    offset: int
    start: int
    numel: int


@dataclass(slots=True, frozen=True)
class Send:
    """A flat bucket trainer rank `src` broadcasts: its rows of the tensors of the receivers'
    full bucket `bucket` (of `dtype`, `numel` elements)."""

    src: int
    bucket: int
    dtype: torch.dtype
    numel: int
    pieces: tuple[Piece, ...]


@dataclass(slots=True, frozen=True)
class StreamLayout:
    """A version as the sharded trainer's `sources` ranks stream it: the receivers' `full`
    layout (the whole tensors, as one trainer would send them) and the `sends` in the order they
    travel: per full bucket, each rank's rows of its tensors (a rank holding none sends nothing)."""

    full: Layout
    sends: tuple[Send, ...]
    sources: int

    def staging(self) -> dict[torch.dtype, int]:
        """Per dtype, the largest send a receiver stages (one holding a single piece lands in
        place, unstaged)."""
        out: dict[torch.dtype, int] = {}
        for s in self.sends:
            if len(s.pieces) > 1:
                out[s.dtype] = max(out.get(s.dtype, 0), s.numel)
        return out


def local_shards(payload: Mapping[str, torch.Tensor], rank: int) -> tuple[ShardSpec, dict[str, torch.Tensor]]:
    """Trainer rank `rank`'s `ShardSpec` of `payload` (a sharded model's state dict with its
    parameters, `state_dict(keep_vars=True)`: tied names map to one object) and its local tensors
    by distinct name (FSDP2's `Shard(0)` DTensors: the local rows; anything else: whole on rank 0,
    no rows elsewhere). Raises on a placement that is neither."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    tensors: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
    local: dict[str, torch.Tensor] = {}
    for name, t in payload.items():
        if id(t) in seen:
            aliases[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        shape = tuple(t.shape)
        if isinstance(t, DTensor):
            placements = tuple(t.placements)
            part = t.to_local().detach()
            if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0 and t.dim() > 0:
                if tuple(part.shape[1:]) != shape[1:]:
                    raise ValueError(f"{name}: local shard {tuple(part.shape)} is no row range of {shape}")
                tensors.append((name, t.dtype, shape, int(part.shape[0])))
                local[name] = part
                continue
            if not all(isinstance(p, Replicate) for p in placements):
                raise ValueError(f"{name}: placements {placements}: only Shard(0) or replicated tensors can be streamed")
            whole = part
        else:
            whole = t.detach()
        rows = (shape[0] if shape else 1) if rank == 0 else 0
        tensors.append((name, t.dtype, shape, rows))
        local[name] = whole if rank == 0 else whole.reshape(-1)[:0]
    return ShardSpec(tuple(payload), aliases, tuple(tensors)), local


def stream_layout(specs: Sequence[ShardSpec], bucket_bytes: int = BUCKET_BYTES) -> StreamLayout:
    """The `StreamLayout` of the sources' `specs` (rank order): the full tensors cut into
    buckets as `layout_of` cuts one trainer's payload; rank r's rows of a tensor follow rank
    r-1's (FSDP2's Shard(0): each rank a contiguous run of rows, the last ones possibly empty).
    Raises when the specs disagree (names, dtypes, shapes, rows that do not add up)."""
    first = specs[0]
    full = _cut(first.names, [(n, d, s) for n, d, s, _ in first.tensors], first.aliases, bucket_bytes)
    rows: list[dict[str, int]] = []
    for r, spec in enumerate(specs):
        if spec.names != first.names or [t[:3] for t in spec.tensors] != [t[:3] for t in first.tensors]:
            raise ValueError(f"trainer rank {r}'s weights differ from rank 0's (names, dtypes or shapes)")
        rows.append({n: k for n, _, _, k in spec.tensors})
    by_bucket: dict[int, list[Entry]] = {}
    for e in full.entries:
        total = e.shape[0] if e.shape else 1
        if sum(r[e.name] for r in rows) != total:
            raise ValueError(f"{e.name}: the ranks hold {[r[e.name] for r in rows]} rows of {total}")
        by_bucket.setdefault(e.bucket, []).append(e)
    sends: list[Send] = []
    for b, (dtype, _) in enumerate(full.buckets):
        for src in range(len(specs)):
            pieces: list[Piece] = []
            filled = 0
            for e in by_bucket.get(b, []):
                row = math.prod(e.shape[1:]) if e.shape else 1
                first_row = sum(rows[r][e.name] for r in range(src))
                n = rows[src][e.name] * row
                if n:
                    pieces.append(Piece(e.name, filled, first_row * row, n))
                    filled += n
            if pieces:
                sends.append(Send(src, b, dtype, filled, tuple(pieces)))
    return StreamLayout(full, tuple(sends), len(specs))


def pack_shards(layout: StreamLayout, rank: int, local: Mapping[str, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    """Trainer rank `rank`'s committed snapshot: a copy of its rows, one flat tensor per send of
    its (send index -> tensor), broadcast as they are (no staging)."""
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for i, s in enumerate(layout.sends):
            if s.src != rank:
                continue
            flat = torch.empty(s.numel, dtype=s.dtype, device=device)
            for p in s.pieces:
                part = local[p.name]
                if part.numel() != p.numel:
                    raise ValueError(f"{p.name}: rank {rank} holds {part.numel()} elements, the layout says {p.numel}")
                flat.narrow(0, p.offset, p.numel).copy_(part.reshape(-1))
            out[i] = flat
    return out


def _entries(layout: Layout) -> dict[str, Entry]:
    return {e.name: e for e in layout.entries}


def place(layout: StreamLayout, send: Send, flat: torch.Tensor, buckets: Sequence[torch.Tensor]) -> None:
    """Copy a received `send` (its flat bucket `flat`) into the full `buckets` (the receivers'
    buckets of `layout.full`)."""
    entries = _entries(layout.full)
    for p in send.pieces:
        e = entries[p.name]
        buckets[e.bucket].narrow(0, e.offset + p.start, p.numel).copy_(flat.narrow(0, p.offset, p.numel))


def full_views(layout: Layout, buckets: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The payload as views of `layout`'s `buckets`, every name (a tied one: the same view)."""
    views = {e.name: buckets[e.bucket].narrow(0, e.offset, e.numel).view(e.shape) for e in layout.entries}
    return {name: views[layout.aliases.get(name, name)] for name in layout.names}


def assemble(layout: StreamLayout, flats: Mapping[int, torch.Tensor], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The full payload from every source's snapshot (`flats`: send index -> its flat bucket),
    in new buckets on `device` (the sharded trainer's export for the object store)."""
    buckets = [torch.empty(n, dtype=d, device=device) for d, n in layout.full.buckets]
    for i, s in enumerate(layout.sends):
        place(layout, s, flats[i].to(device), buckets)
    return full_views(layout.full, buckets)


class OwnGroup:
    """A process group of one source (rank 0) and the receivers, made from a store directly
    (`ProcessGroupGloo` / `ProcessGroupNCCL`), not the default group: a sharded trainer's ranks
    already hold theirs. Each collective is bounded by `timeout`."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int, backend: str, timeout: timedelta) -> None:
        import torch.distributed as dist

        scoped = dist.PrefixStore(prefix, store)
        self.pg: Any
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(scoped, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(scoped, rank, size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        if self.pg is None:
            raise RuntimeError("the group was left")
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.pg.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Leave: this member's connections close (a peer's pending collective fails now)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:
                pass


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
    """A sampler actor's load result in a broadcast round: the version loaded, whether its
    receive failed (it loaded that version from the object store instead), and whether its vLLM
    engine's worker received it in the actor's place (`in_engine`)."""

    version: int
    fell_back: bool
    in_engine: bool = False


def read_layout(host: str, port: int) -> Layout:
    """The full layout (`Layout`; a stream's `full`) of the weight group whose store is at
    `host`:`port` (blocking, bounded by JOIN_TIMEOUT_S): what each receiver holds of a version."""
    import torch.distributed as dist

    got = _stored_layout(dist.TCPStore(host, port, None, False, timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False))
    return got.full if isinstance(got, StreamLayout) else got


def _stored_layout(store: Any) -> Layout | StreamLayout:
    """The layout source 0 set in the group's `store` (waits for it, within the store's timeout)."""
    got: Layout | StreamLayout = pickle.loads(bytes.fromhex(store.get(LAYOUT_KEY).decode()))
    return got


class Member:
    """This process's membership of the weight groups (see the module): a source (a trainer, or a
    rank of the sharded trainer) or a receiver (a sampler actor, or a vLLM engine's worker)."""

    def __init__(
        self,
        rank: int,
        world: int,
        backend: str,
        layout: Layout,
        device: torch.device,
        stream: StreamLayout | None,
        groups: Sequence[OwnGroup],
        store: Any,
    ) -> None:
        self.rank, self.world, self.backend, self.layout, self.device = rank, world, backend, layout, device
        # streaming from the sharded trainer: its layout. The groups: a source's one (its rank 0),
        # a receiver's one per source (rank 1 + its index in each)
        self.stream, self._groups = stream, list(groups)
        self.broken: str | None = None  # why a collective failed here (then none runs again)
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # a source's per dtype (one bucket); a receiver's for sends of several pieces
        self._buckets: list[torch.Tensor] = []  # a receiver's, one version's
        self._views: dict[str, torch.Tensor] = {}
        self._store = store  # the store the groups met at (source 0 serves it)

    @staticmethod
    def join(
        host: str,
        port: int,
        backend: str,
        timeout_s: float,
        receivers: int,
        *,
        source: int | None = None,
        receiver: int | None = None,
        layout: Layout | StreamLayout | None = None,
        device: torch.device | None = None,
    ) -> Member:
        """Join the weight groups at `host`:`port` (blocking) beside `receivers` receivers: source
        `source` joins its own group as its rank 0 (source 0 serves the store and gives the
        `layout`: one trainer's `Layout`, or the sharded trainer's `StreamLayout`), receiver
        `receiver` one group per source, as rank 1 + `receiver` of each. `device`: where a
        receiver's buckets live (default: the current CUDA device for NCCL, else the CPU). The
        store's waits are bounded by JOIN_TIMEOUT_S, each collective after by `timeout_s`."""
        import torch.distributed as dist

        if (source is None) == (receiver is None):
            raise ValueError("Member.join: a member is either a source or a receiver")
        store = dist.TCPStore(host, port, None, source == 0, timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)
        if source == 0:
            assert layout is not None, "Member.join: source 0 gives the layout"
            store.set(LAYOUT_KEY, pickle.dumps(layout).hex())
        got = _stored_layout(store)
        stream = got if isinstance(got, StreamLayout) else None
        sources = stream.sources if stream is not None else 1
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        op = timedelta(seconds=timeout_s)
        size = 1 + receivers  # each group: one source and every receiver
        if source is not None:
            groups = [OwnGroup(store, f"{GROUP_PREFIX}{source}/", 0, size, backend, op)]
            rank = source
        else:
            assert receiver is not None
            groups = [OwnGroup(store, f"{GROUP_PREFIX}{s}/", 1 + receiver, size, backend, op) for s in range(sources)]
            rank = sources + receiver
        full = stream.full if stream is not None else cast(Layout, got)
        return Member(rank, sources + receivers, backend, full, device, stream, groups, store)

    def _header(self, values: Sequence[int]) -> list[int]:
        header = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        self._groups[0].broadcast(header)
        return [int(x) for x in header.tolist()]

    def send_shards(self, round_: int, version: int, flats: Mapping[int, torch.Tensor]) -> None:
        """A source rank: broadcast its snapshot's sends (`flats`, `pack_shards`) of round
        `round_` (source 0 first sends the header). Raises (and leaves its group) when a
        collective fails."""
        self._usable()
        stream = self.stream
        assert stream is not None and len(self._groups) == 1, "send_shards: this member is no source of a stream"
        try:
            if self.rank == 0:
                self._header([round_, version])
            for i, s in enumerate(stream.sends):
                if s.src == self.rank:
                    self._groups[0].broadcast(flats[i].view(torch.uint8))
        except Exception as exc:
            self.fail(exc)
            raise

    def _receive_stream(self, stream: StreamLayout) -> None:
        """A receiver: every source's sends, in the layout's order, into this member's buckets
        (a send of one piece lands in place; the others through one staging bucket per dtype)."""
        entries = _entries(stream.full)
        for s in stream.sends:
            if len(s.pieces) == 1:
                p = s.pieces[0]
                e = entries[p.name]
                self._groups[s.src].broadcast(self._buckets[e.bucket].narrow(0, e.offset + p.start, p.numel).view(torch.uint8))
            else:
                staging = self._staging.get(s.dtype)
                if staging is None:
                    staging = self._staging[s.dtype] = torch.empty(stream.staging()[s.dtype], dtype=s.dtype, device=self.device)
                flat = staging.narrow(0, 0, s.numel)
                self._groups[s.src].broadcast(flat.view(torch.uint8))
                place(stream, s, flat, self._buckets)
            if self.device.type == "cpu":
                STAGED.add(s.numel * torch.empty((), dtype=s.dtype).element_size())

    def send(self, round_: int, version: int, payload: Mapping[str, torch.Tensor]) -> None:
        """One trainer (source 0 of a `Layout`): broadcast `payload` (the committed snapshot) as
        round `round_`. Raises (and leaves the group) when a collective fails."""
        self._usable()
        check_layout(self.layout, payload)
        try:
            self._header([round_, version])
            send_buckets(self.layout, payload, self._staging, self.device, self._groups[0].broadcast)
        except Exception as exc:
            self.fail(exc)
            raise

    def receive(self, round_: int) -> tuple[int, dict[str, torch.Tensor]]:
        """A receiver: receive round `round_`; returns its version and the payload (views of this
        member's buckets, valid until the next receive). Raises (and leaves the group) when a
        collective fails or the round is not the one expected."""
        self._usable()
        try:
            got, version = self._header([0, 0])
            if got != round_:
                raise RuntimeError(f"the collective group is out of step: received round {got}, expected {round_}")
            if not self._buckets:
                self._buckets = [torch.empty(n, dtype=d, device=self.device) for d, n in self.layout.buckets]
                self._views = full_views(self.layout, self._buckets)
            if self.stream is not None:
                self._receive_stream(self.stream)
            else:
                for bucket in self._buckets:
                    self._groups[0].broadcast(bucket.view(torch.uint8))
                    if bucket.device.type == "cpu":
                        STAGED.add(bucket.numel() * bucket.element_size())
        except Exception as exc:
            self.fail(exc)
            raise
        return version, dict(self._views)

    def fail(self, exc: BaseException) -> None:
        """The group is broken here (a collective failed, or this member cannot take part in the
        round under way): leave it at once, so that the peers' pending collectives fail now
        (their sockets to this member close) instead of at their timeout."""
        self.broken = f"{type(exc).__name__}: {exc}"
        self._leave_groups()

    def _leave_groups(self) -> None:
        groups, self._groups = self._groups, []
        for group in groups:
            group.close()
        self._store = None

    def _usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"the collective weight group is broken: {self.broken}")

    def close(self) -> None:
        """Leave the groups."""
        self._buckets, self._views, self._staging = [], {}, {}
        self._leave_groups()


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

    host, port, backend, sources = ray.get(trainer.actor.collective_address.remote(), timeout=JOIN_TIMEOUT_S)
    receivers = len(samplers)
    op_timeout = timeout_s if timeout_s > 0 else OP_TIMEOUT_S
    refs = [trainer.actor.join_collective.remote(host, port, backend, op_timeout, receivers)]
    refs += [s.actor.join_collective.remote(host, port, backend, op_timeout, receivers, i, trainer.actor) for i, s in enumerate(samplers)]
    names = ["the trainer actor", *(f"sampler actor {i}" for i in range(receivers))]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=JOIN_TIMEOUT_S)
    members = f"{1 + receivers} members" if not sources else f"{sources} trainer ranks streaming to {receivers} sampler actors"
    where = f"rollout.weight_transport = 'collective': the weight process group ({backend}, {host}:{port}, {members})"
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


__all__ = [
    "BUCKET_BYTES",
    "GROUP_PREFIX",
    "LAYOUT_KEY",
    "Broadcast",
    "Layout",
    "Member",
    "OwnGroup",
    "RayBroadcast",
    "Received",
    "backend_for",
    "check_layout",
    "free_port",
    "full_views",
    "join",
    "read_layout",
    "layout_of",
    "send_buckets",
]
