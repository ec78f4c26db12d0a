"""The sharded trainer on Ray (`train.world_size = N > 1` with `ray.enabled`): N trainer actors,
one per rank, in one placement group, rank 0 being the trainer actor the driver talks to.

Placement: one bundle per rank, each `ray.trainer_resources` (or `{CPU: 1}` when that is empty:
Ray refuses empty bundles, and a rank computes), strategy PACK: Ray puts the ranks on one node
when one has room for all (their per-layer collectives then stay inside the node), and on
several otherwise, which the process group supports (the rendezvous is at rank 0's node address).
STRICT_PACK would leave a trainer that outgrows a node unplaceable.

Start-up: the driver starts the rank actors 1..N-1 (`RankActor`; each only keeps its factory),
then rank 0, the `TrainerActor` whose worker `ShardedRayFactory` builds: it picks its node's IP
address and a free port, asks each other rank to join there (`RankActor.join`), joins itself
(gloo on the CPU, NCCL on CUDA) and builds its `ShardedCompute` (the same FSDP2 compute as the
local ranks': `relayrl.backends.local.ranks`) while they build theirs; a rank that fails to start
fails rank 0's constructor, naming it.

Serving: rank 0's worker is a `RankedTrainer` (rounds and answers as the local sharded trainer's):
each request goes to rank 0's own compute thread and, as an actor call, to the other ranks (their
"compute" group runs them one at a time, in order; a checkpoint runs in their "ckpt" group beside
it); a micro-batch crosses as numpy arrays (`relayrl.backends.ray.transport`). Weights travel
as with one rank: rank 0's full state dict, put into the object store (as numpy arrays) once per
version by the trainer actor; the other ranks send none.

Streaming (rollout.weight_transport = "collective", `stream`): a rank's committed version is a
copy of its own shards (`ShardedCompute(stream=True)`), and every rank is a source of the weight
stream (`relayrl.backends.ray.collective`), the other ranks in their "weights" concurrency group
(beside training). Rank 0 runs one weight operation at a time: it waits until no commit is out to
the ranks, takes the committed version and pins it (each commit sent while it is pinned tells
every rank to keep that snapshot: `optim_step(keep)`), then asks every rank for its part: its
sends (`broadcast`) or, for the object store's export, its snapshot sent to rank 0 over the ranks'
own gloo group (`gather`, assembled there on the CPU). A rank without the version leaves its group
and the round fails, naming it.

Invariants: every rank gets the same sequence of compute requests (and, streaming, of weight
requests, each naming the version all of them send); a rank actor that dies fails the call in
flight, and every later one, with a `RankFailed` naming the rank; closing rank 0's worker ends the
other ranks' actors (the driver removes the placement group).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import ray

from relayrl.backends.local.ranks import RankParts, ShardedCompute, join_group, serve
from relayrl.backends.local.sharded import RankedTrainer, RankFailed, free_port
from relayrl.backends.ray.collective import Member
from relayrl.backends.ray.transport import decode, encode
from relayrl.errors import RunFailed
from relayrl.types import Weights

_T = TypeVar("_T")


class RankFactory(Protocol):
    """A compute kind's trainer factory that can build one rank's parts (in the rank's actor)."""

    def rank_parts(self) -> RankParts: ...


def _build(factory: RankFactory, rank: int, world_size: int, addr: str, port: int, stream: bool) -> ShardedCompute:
    import torch

    parts = factory.rank_parts()
    torch.set_num_threads(parts.settings.torch_threads or 1)
    join_group(rank, world_size, addr, port, parts.device)
    return ShardedCompute(parts.model, parts.settings, parts.ref_model, parts.device, stream=stream)


class _RankActor:
    """Rank `rank` ≥ 1 of the sharded trainer: its compute, built when rank 0 says where to join."""

    def __init__(self, factory: RankFactory, rank: int, world_size: int, stream: bool = False) -> None:
        self._factory = factory
        self.rank = rank
        self.world_size = world_size
        self.stream = stream  # the collective transport streams each rank's shards (see the module)
        self._compute: ShardedCompute | None = None
        self._member: Member | None = None

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="compute")
    def join(self, addr: str, port: int) -> None:
        self._compute = _build(self._factory, self.rank, self.world_size, addr, port, self.stream)

    @ray.method(concurrency_group="compute")
    def request(self, op: str, arg: Any) -> object:
        assert self._compute is not None, "rank actor: a request before join"
        if op == "train":
            tb, idle = arg
            arg = (dataclasses.replace(tb, payload=decode(tb.payload, writable=True)), idle)
        return serve(self._compute, op, arg)

    @ray.method(concurrency_group="ckpt")
    def save(self, directory: str) -> None:
        assert self._compute is not None, "rank actor: a checkpoint before join"
        self._compute.save_state(Path(directory))

    @ray.method(concurrency_group="weights")
    def join_weights(self, host: str, port: int, backend: str, timeout_s: float, receivers: int) -> None:
        """Join the collective weight stream as source `rank` (its own group with the receivers)."""
        self._member = Member.join(host, port, backend, timeout_s, receivers, source=self.rank)

    @ray.method(concurrency_group="weights")
    def send_weights(self, round_: int, version: int) -> None:
        """Stream this rank's shards of `version` as round `round_` (rank 0 sent the call)."""
        assert self._compute is not None and self._member is not None, "rank actor: a broadcast before joining"
        send_own(self._member, self._compute, round_, version)

    @ray.method(concurrency_group="weights")
    def gather_weights(self, version: int) -> None:
        """Send this rank's shards of `version` to rank 0 (the object store's export)."""
        assert self._compute is not None, "rank actor: an export before join"
        self._compute.gather_shards(version)


RankActor: Any = ray.remote(concurrency_groups={"compute": 1, "ckpt": 1, "weights": 1})(_RankActor)


def send_own(member: Member, compute: ShardedCompute, round_: int, version: int) -> None:
    """Broadcast this rank's snapshot of `version`; a rank without it leaves the group (the peers'
    collectives fail now, not at their timeout) and raises."""
    try:
        flats = compute.shards(version)
    except Exception as exc:
        member.fail(exc)
        raise
    member.send_shards(round_, version, flats)


def _encoded(op: str, arg: Any) -> Any:
    """A request's argument as it crosses to a rank actor: a micro-batch's tensors as numpy
    arrays (`relayrl.backends.ray.transport`), as between the driver and the trainer actor."""
    if op != "train":
        return arg
    tb, idle = arg
    return dataclasses.replace(tb, payload=encode(tb.payload)), idle


def _died(rank: int, exc: BaseException) -> RankFailed:
    return RankFailed(f"sharded trainer rank {rank} (Ray actor) died: {type(exc).__name__}")


class ShardedRayFactory:
    """Rank 0's worker factory (called in the trainer actor): joins the ranks' group with the
    other ranks' actors and returns the `RayShardedTrainer` (see the module)."""

    def __init__(self, factory: RankFactory, ranks: Sequence[Any], stream: bool = False) -> None:
        self.factory = factory
        self.ranks = list(ranks)  # the actors of ranks 1..N-1
        self.stream = stream

    def __call__(self) -> RayShardedTrainer:
        world_size = 1 + len(self.ranks)
        addr = ray.util.get_node_ip_address()
        port = free_port(addr)
        joins = {actor.join.remote(addr, port): r for r, actor in enumerate(self.ranks, start=1)}
        built: concurrent.futures.Future[ShardedCompute] = concurrent.futures.Future()

        def own() -> None:
            try:
                built.set_result(_build(self.factory, 0, world_size, addr, port, self.stream))
            except BaseException as exc:
                built.set_exception(exc)

        # rank 0's own start in a thread (it waits for the others in the rendezvous), so that a
        # rank that fails to start is reported instead of waited for
        threading.Thread(target=own, name="relayrl-rank0-start", daemon=True).start()
        pending = list(joins)
        while pending:
            if built.done():
                built.result()  # (raises rank 0's own failure: the others would wait for it for ever)
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:
                    raise RankFailed(f"sharded trainer rank {joins[ref]} could not start: {exc}") from exc
        return RayShardedTrainer(built.result(), self.ranks)


class RayShardedTrainer(RankedTrainer):
    """Rank 0's worker: its own `ShardedCompute` on a thread of its own, the other ranks'
    through their actors (see the module)."""

    def __init__(self, compute: ShardedCompute, ranks: Sequence[Any]) -> None:
        super().__init__(compute.world_size)
        self.compute = compute
        self._ranks = list(ranks)
        threads = compute.settings.torch_threads or 1
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="relayrl-trainer-rank0", initializer=_set_threads, initargs=(threads,)
        )
        self._snapshot = compute.committed_weights()
        self._slot = compute.metrics()
        self._dead: RankFailed | None = None
        self._closed = False
        # streaming (see the module): the versions a weight operation reads (pinned: a commit sent
        # meanwhile keeps their snapshots), the commits out to the ranks, one weight op at a time
        self.member: Member | None = None
        self._pins: collections.Counter[int] = collections.Counter()
        self._committing = 0
        self._commits = threading.Condition()
        self._weights_lock = threading.Lock()

    @property
    def streams(self) -> bool:
        """Whether a version travels as each rank's shards (the collective transport)."""
        return self.compute.stream_layout is not None

    async def _all(self, args: list[tuple[str, Any]]) -> list[Any]:
        if args[0][0] not in ("optim", "load") or not self.streams:
            return await self._send_all(args)
        with self._commits:  # a commit out: a weight op waits for it, and the ranks keep what one reads
            self._committing += 1
            if args[0][0] == "optim":
                args = [(op, tuple(self._pins)) for op, _ in args]
        try:
            return await self._send_all(args)
        finally:
            with self._commits:
                self._committing -= 1
                self._commits.notify_all()

    async def _send_all(self, args: list[tuple[str, Any]]) -> list[Any]:
        if self._dead is not None:
            raise self._dead
        op, arg = args[0]
        local: asyncio.Future[Any]
        if op == "save":  # beside a running compute request, on each rank
            local = asyncio.ensure_future(asyncio.to_thread(self.compute.save_state, Path(arg)))
            remote = [actor.save.remote(a) for actor, (_, a) in zip(self._ranks, args[1:], strict=True)]
        else:
            local = asyncio.wrap_future(self._executor.submit(serve, self.compute, op, arg))
            remote = [actor.request.remote(o, _encoded(o, a)) for actor, (o, a) in zip(self._ranks, args[1:], strict=True)]
        waits: list[asyncio.Future[Any]] = [local, *(asyncio.ensure_future(self._answer(r, ref)) for r, ref in enumerate(remote, start=1))]
        try:
            # the first failure at once (rank 0's thread may be stuck in a collective with a dead rank)
            return list(await asyncio.gather(*waits))
        finally:
            for w in waits[1:]:
                if not w.done():
                    w.cancel()

    async def _answer(self, rank: int, ref: Any) -> Any:
        try:
            return await ref
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            self._dead = _died(rank, exc)
            raise self._dead from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            if isinstance(cause, RunFailed):  # (e.g. a non-finite step under "fail": every rank's)
                raise cause from exc
            raise RuntimeError(f"sharded trainer rank {rank}: {type(cause).__name__}: {cause}") from exc

    # -- the collective transport's stream (see the module) ----------------------------------
    def _pinned(self, work: Callable[[int], _T]) -> _T:
        """Run `work(version)` on the committed version, once no commit is out to the ranks,
        its snapshots pinned meanwhile; one weight operation at a time (each rank actor serves
        them in the order sent)."""
        with self._weights_lock:
            with self._commits:
                self._commits.wait_for(lambda: self._committing == 0)
                snapshot = self.compute.committed_weights()
                assert snapshot is not None
                version = snapshot.version
                self._pins[version] += 1
            try:
                return work(version)
            finally:
                with self._commits:
                    self._pins[version] -= 1
                    if self._pins[version] <= 0:
                        del self._pins[version]

    def join_weights(self, host: str, port: int, backend: str, timeout_s: float, receivers: int) -> None:
        """Blocking: every rank joins the stream's groups as a source (rank 0 serves the store)."""
        refs = [actor.join_weights.remote(host, port, backend, timeout_s, receivers) for actor in self._ranks]
        layout = self.compute.stream_layout
        self.member = Member.join(host, port, backend, timeout_s, receivers, source=0, layout=layout)
        for r, ref in enumerate(refs, start=1):
            try:
                ray.get(ref)
            except Exception as exc:
                raise RuntimeError(f"sharded trainer rank {r} could not join the weight stream: {exc}") from exc

    def broadcast(self, round_: int) -> int:
        """Blocking: stream the committed version as round `round_` from every rank; returns it.
        Raises naming the ranks whose part failed (each left its group: see collective.py)."""

        def work(version: int) -> int:
            member = self.member
            if member is None:
                raise RuntimeError("the sharded trainer joined no collective weight group")
            refs = [actor.send_weights.remote(round_, version) for actor in self._ranks]
            errors = []
            try:
                send_own(member, self.compute, round_, version)
            except Exception as exc:
                errors.append(f"rank 0: {type(exc).__name__}: {exc}")
            for r, ref in enumerate(refs, start=1):
                try:
                    ray.get(ref)
                except Exception as exc:
                    errors.append(f"rank {r}: {type(exc).__name__}: {exc}")
            if errors:
                raise RuntimeError(f"the sharded trainer's stream of version {version} failed: {'; '.join(errors)}")
            return version

        return self._pinned(work)

    def gather(self) -> Weights:
        """Blocking: the committed version's full weights, gathered from the ranks' snapshots on
        rank 0 (the object store's export: a restart, the evaluation, a fallback)."""

        def work(version: int) -> Weights:
            refs = [actor.gather_weights.remote(version) for actor in self._ranks]
            payload = self.compute.gather_shards(version)
            ray.get(refs)
            assert payload is not None
            return Weights(version=version, payload=payload)

        return self._pinned(work)

    async def export_weights(self) -> Weights:
        """The committed version's full weights (streaming: gathered now, see `gather`)."""
        if not self.streams:
            return await super().export_weights()
        return await asyncio.to_thread(self.gather)

    async def close(self) -> None:
        """End the other ranks' actors; rank 0's thread is not waited for (a collective with a
        dead rank may hold it: it ends with the trainer actor)."""
        if self._closed:
            return
        self._closed = True
        member, self.member = self.member, None
        if member is not None:
            member.close()
        for actor in self._ranks:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def place_ranks(
    factory: RankFactory, world_size: int, bundle: dict[str, float], options: dict[str, Any], stream: bool = False
) -> tuple[Any, Any, list[Any]]:
    """Start the sharded trainer's actors in a new placement group of `world_size` bundles of
    `bundle` (PACK), each with the `ray.remote` `options` of one bundle: (the placement group,
    rank 0's `TrainerActor`, the other ranks' actors). `stream`: the collective transport streams
    each rank's shards. The caller awaits the actors' `ready` and removes the placement group at
    the end."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from relayrl.backends.ray.actors import TrainerActor

    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK", name="")

    def at(index: int) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        return {**options, "scheduling_strategy": strategy}

    ranks = [RankActor.options(**at(r)).remote(factory, r, world_size, stream) for r in range(1, world_size)]
    rank0 = TrainerActor.options(**at(0)).remote(ShardedRayFactory(factory, ranks, stream))
    return group, rank0, ranks
