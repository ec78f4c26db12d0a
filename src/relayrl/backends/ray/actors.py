"""Ray actors hosting the same workers the in-process backends use, and the driver-side adapters
that implement the `Sampler` / `Trainer` protocols by awaiting actor calls.

Each actor is built from a compute kind's factory run inside the actor's process (the sim's
`SimSampler` / `SimTrainer`; the local kind's `LocalSampler` / `LocalTrainer`, i.e.
`SamplerCompute` / `TrainerCompute` on their worker thread), and awaits that worker's async
methods. The actors forward protocol calls generically (`call(method, ...)`), by one table of
the calls each forwards (`SAMPLER_CALLS`, `TRAINER_CALLS`: the trainer's names the concurrency
group each runs in); only what adds behaviour is written out (the trainer's numbered training
calls and weight export, the sampler's weight load).

Invariants:
- a sampler actor runs one call at a time, in call order (max_concurrency=1), so a load never
  races a generate and a generate reports the version loaded when it started; except with
  rollout.interruptible (`RaySampler(interruptible=True)`): its loads then run in the actor's
  "load" concurrency group (one at a time), beside a running generate, and the worker lands them
  between decode steps (`relayrl.backends.local.gate`, the sim's simulated tokens);
- the trainer actor runs train_step / optim_step / load_state one at a time in the "train"
  concurrency group; get_metrics, export_weights and save_state run in the "io" group, so they
  never wait behind a train step (as LocalTrainer's thread-safe calls do in one process);
- weights travel once per version through the object store: the trainer actor converts a
  version's state dict to numpy arrays (pickled torch tensors are ~10x slower) and `ray.put`s it once;
  `Weights.payload` is then the ObjectRef, which the driver only passes on; each sampler actor
  fetches it (zero-copy on one node) and copies it into its model. In a sync round the payload is
  the export call's own reference (`RayTrainer.export_ahead`, `Exporting`): each sampler actor
  awaits the export, then fetches the weights, with no driver round trip between;
- a sampler actor whose process dies is restarted by Ray (`SAMPLER_MAX_RESTARTS`; its constructor
  builds a fresh worker) and refuses to sample (`SamplerNeedsWeightsError`) until the orchestrator
  has loaded the current weights into it (the sample stage awaits `RaySampler.restart`, then the
  weight publisher loads them: a sampler never holds the trainer; an actor dead for good, or not
  alive again within RESTART_TIMEOUT_S, is retired instead); a
  weight load lost with a dead process does the same on the driver side;
- every call's span inside the actor (`Timed`) is traced onto the driver's clock, next to the
  driver's own span of it (`relayrl.backends.ray.spans`);
- a collated micro-batch crosses to the trainer actor as numpy arrays, as weights do
  (`relayrl.backends.ray.transport`); collating there instead would put the layout's Python loop
  on the trainer's critical path (the batch holds no attention mask: the trainer builds it on its
  device, `relayrl.backends.local.attention`);
- training calls are numbered by the driver and the actor runs them in that order, one at a time
  (`_in_turn`): a micro-batch sent ahead (TRAIN_AHEAD; the next step's first one queued behind
  `optim_step`, `RayTrainer.optim_step_ahead`) starts only once every call sent before it ended,
  so it accumulates only into gradients the previous `optim_step` already zeroed; a training call
  that fails is raised, naming its step and micro-batch (`TrainStepError`), by the next training
  call, which awaits everything sent before it;
- the trainer actor is never restarted: its process dying fails the run with a
  `TrainerActorDiedError` ("trainer actor died: ..."); closing an actor whose process already died
  is no error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import ray

from relayrl.backends.protocols import PendingExport, Sampler, Trainer
from relayrl.backends.ray.collective import Broadcast, Member, Received, backend_for, free_port, layout_of
from relayrl.backends.ray.spans import ActorSpans, Timed
from relayrl.backends.ray.transport import ArrayState, decode, encode
from relayrl.backends.transports import STAGED
from relayrl.telemetry.tracer import Tracer
from relayrl.types import GenerateResult, SampleRequest, TrainBatch, TurnRequest, TurnResult, Weights, generate_sizes


@dataclass(slots=True, frozen=True)
class Exporting:
    """The payload of weights whose export is still running (`RayTrainer.export_ahead`): the
    ObjectRef of the trainer actor's export call, whose `Timed` value is the exported `Weights`.
    Their `version` is the committed one the driver knew when it sent the export: the export's
    own is that or newer (a commit can land in the actor before the export runs), and is the
    version loaded."""

    call: Any


async def resolve(weights: Weights) -> Weights:
    """`weights` with its payload fetched from the object store (when it is a reference; an export
    still running is waited for first) and turned back into what the worker loads."""
    version, payload = weights.version, weights.payload
    if isinstance(payload, Exporting):
        timed: Timed = await payload.call  # the export's failure fails this load too (the publisher raises the export's)
        exported: Weights = timed.value
        version, payload = exported.version, exported.payload  # newer when a commit landed before the export ran
    if isinstance(payload, ray.ObjectRef):
        payload = await payload
    return Weights(version=version, payload=decode(payload))


class SamplerNeedsWeightsError(RuntimeError):
    """A restarted sampler actor (or one whose weight load was lost with its process) was asked to
    sample before it loaded the current weights."""


class TrainerActorDiedError(RuntimeError):
    """The trainer actor's process died: the run cannot go on."""


class TrainStepError(RuntimeError):
    """A train step failed in the trainer actor; raised by the training call after it (which
    awaits it), so the message names the failed step and micro-batch. The actor's error is the
    cause."""


# errors that mean an actor's process died or cannot be reached (it may be restarting)
ACTOR_GONE: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
SAMPLER_MAX_RESTARTS = 3  # Ray restarts a sampler actor whose process died up to this many times
RESTART_TIMEOUT_S = 60.0  # a sampler actor not alive again within this is retired
CLOSE_TIMEOUT_S = 30.0  # an actor whose worker has not closed within this is killed
TRAIN_AHEAD = 1  # micro-batches sent to the trainer actor before the previous one's train_step returned


async def _timed(work: Awaitable[Any]) -> Timed:
    """Run `work`, timed on this process's wall clock (the driver maps it onto the run's)."""
    start = time.time()
    value = await work
    return Timed(value, start, time.time())


# the sampler actor's forwarded calls (one at a time, in call order); True: refused by a restarted
# actor until it loaded the current weights
SAMPLER_CALLS: dict[str, bool] = {
    "generate": True,
    "greedy": True,
    "generate_turns": True,
    "end_episodes": False,
    "load_weights": False,
    "close": False,
}
# the trainer actor's forwarded calls -> their concurrency group: "train" calls run one at a time in
# the driver's numbering (`_TrainerActor._in_turn`); "io" calls never wait behind a train step
TRAINER_CALLS: dict[str, str] = {
    "train_step": "train",
    "optim_step": "train",
    "load_state": "train",
    "get_metrics": "io",
    "export_weights": "io",
    "broadcast_weights": "io",
    "save_state": "io",
    "close": "io",
}


def _forwarded(table: dict[str, Any], method: str) -> None:
    if method not in table:
        raise AttributeError(f"the actor forwards no call named {method!r} (known: {', '.join(table)})")


class _SamplerActor:
    def __init__(self, factory: Callable[[], Any]) -> None:
        self._worker = factory()  # on a restart, Ray runs this again: a fresh worker
        self._loaded: int | None = None
        self._collective: Member | None = None  # rollout.weight_transport = "collective" (never after a restart)
        self._engine_member = False  # the worker's vLLM engine joined the group instead (never after a restart)
        self._trainer: Any = None  # the trainer actor, whose object store export a failed receive falls back to
        self._restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)

    async def ready(self) -> bool:
        return True

    async def ping(self) -> bool:
        return True

    async def clock(self) -> float:
        return time.time()

    async def pid(self) -> int:
        return os.getpid()

    async def call(self, method: str, *args: Any) -> Timed:
        """The worker's `method(*args)` (one of `SAMPLER_CALLS`), timed on this process's clock."""
        _forwarded(SAMPLER_CALLS, method)
        if SAMPLER_CALLS[method] and self._restarted and self._loaded is None:
            raise SamplerNeedsWeightsError("this sampler actor was restarted and has not loaded the current weights")
        if method == "load_weights":
            return await _timed(self._load_weights(*args))
        if method == "close":
            await self._leave()
        return await _timed(getattr(self._worker, method)(*args))

    async def _load_weights(self, weights: Weights) -> int | Received:
        """Load `weights`; returns the version loaded (an export's own: see `Exporting`), as a
        `Received` in a broadcast round."""
        if isinstance(weights.payload, Broadcast):
            received = await self._receive(weights.payload.round)
            self._loaded = received.version
            return received
        resolved = await resolve(weights)
        await self._worker.load_weights(resolved)
        self._loaded = resolved.version
        return resolved.version

    async def _receive(self, round_: int) -> Received:
        """Load broadcast round `round_` (`relayrl.backends.ray.collective`; the version is the
        round's own): received here, or by the vLLM engine's worker when it joined the group in
        this actor's place; when the receive fails, the trainer's version from the object store
        instead."""
        member = self._collective
        if member is None and not self._engine_member:  # a restarted actor (a new process joined no group)
            raise SamplerNeedsWeightsError("this sampler actor was restarted: it is no member of the collective weight group")
        try:
            if self._engine_member:
                return Received(await self._worker.receive_round(round_), fell_back=False, in_engine=True)
            assert member is not None
            got, payload = await asyncio.to_thread(member.receive, round_)
        except Exception:
            self._engine_member = False  # (the engine's worker left the group)
            if self._trainer is None:
                raise
            timed: Timed = await trainer_call(self._trainer, "export_weights")
            resolved = await resolve(timed.value)
            await self._worker.load_weights(resolved)
            return Received(resolved.version, fell_back=True)
        await self._worker.load_weights(Weights(version=got, payload=payload))
        return Received(got, fell_back=False)

    async def join_collective(self, host: str, port: int, backend: str, timeout_s: float, receivers: int, index: int, trainer: Any) -> bool:
        """Join the collective weight group at `host`:`port` as receiver `index` of `receivers`
        (see `relayrl.backends.ray.collective.join`). A vLLM worker started with relayrl's
        weight-transfer engine joins through it in this actor's place: each version then lands
        in the engine's worker, not in this process and a file."""
        self._trainer = trainer
        refusal = getattr(self._worker, "transfer_refusal", None)  # (a VllmSampler's)
        if refusal is not None and refusal() is None:
            await self._worker.join_transfer(host, port, index, 1 + receivers, backend, timeout_s)
            self._engine_member = True
        else:
            join = functools.partial(Member.join, host, port, backend, timeout_s, receivers, receiver=index)
            self._collective = await asyncio.to_thread(join)
        return True

    async def _leave(self) -> None:
        member, self._collective = self._collective, None
        if member is not None:
            await asyncio.to_thread(member.close)

    async def staged_bytes(self) -> int:
        """The bytes this actor's process, and its worker's engine processes (a vLLM replica's),
        staged in host memory so far (`relayrl bench weights`)."""
        engine = getattr(self._worker, "staged_bytes", None)
        return int(await engine()) if engine is not None else STAGED.read()

    async def loaded_version(self) -> int | None:
        """The version of the last weights this actor loaded (None: none yet)."""
        return self._loaded


class _TrainerActor:
    def __init__(self, factory: Callable[[], Any]) -> None:
        self._worker = factory()
        self._exported: Weights | None = None  # the last version put into the object store
        self._collective: Member | None = None  # rollout.weight_transport = "collective": rank 0
        self._turn = asyncio.Condition()  # training calls run in the driver's numbering (`turn`)
        self._next = 0

    async def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="io")
    async def clock(self) -> float:
        return time.time()

    @ray.method(concurrency_group="io")
    async def pid(self) -> int:
        return os.getpid()

    async def call(self, method: str, turn: int | None, *args: Any) -> Timed:
        """The worker's `method(*args)` (one of `TRAINER_CALLS`, sent in its concurrency group),
        timed on this process's clock; a "train" call runs as training call number `turn`."""
        _forwarded(TRAINER_CALLS, method)
        work: Callable[[], Awaitable[Any]]
        if method == "train_step":
            (batch,) = args
            batch = dataclasses.replace(batch, payload=decode(batch.payload, writable=True))
            work = functools.partial(self._worker.train_step, batch)
        elif method == "export_weights":
            work = self._export
        elif method == "broadcast_weights":
            work = functools.partial(self._broadcast, *args)
        elif method == "close":
            await self._leave()
            work = self._worker.close
        else:
            work = functools.partial(getattr(self._worker, method), *args)
        if TRAINER_CALLS[method] == "train":
            assert turn is not None, f"{method} is a training call: it needs its number"
            return await self._in_turn(turn, work)
        return await _timed(work())

    async def _in_turn(self, turn: int, work: Callable[[], Awaitable[Any]]) -> Timed:
        """Run `work` as training call number `turn`: after every earlier one ended (Ray does not
        promise an async actor runs calls in submission order), one at a time."""
        async with self._turn:
            await self._turn.wait_for(lambda: self._next == turn)
        try:
            return await _timed(work())
        finally:
            async with self._turn:
                self._next += 1
                self._turn.notify_all()

    async def _committed(self) -> Weights:  # (its payload: a state dict of tensors)
        """The worker's committed snapshot, its copies done (CUDA: they were queued on the trainer's stream)."""
        weights: Weights = await self._worker.export_weights()
        ready = weights.ready
        if ready is not None:
            await asyncio.to_thread(ready.synchronize)  # type: ignore[attr-defined]
        return weights

    def _streams(self) -> bool:
        """Whether the worker is the sharded trainer streaming its ranks' shards (ray/ranks.py)."""
        return bool(getattr(self._worker, "streams", False))

    @ray.method(concurrency_group="io")
    async def collective_address(self) -> tuple[str, int, str, int]:
        """Where the collective weight group meets (this node, a free port), its backend, and the
        sources that stream a version (the sharded trainer's ranks; 0: this actor broadcasts)."""
        if self._streams():
            cuda = self._worker.compute.device.type == "cuda"
            return ray.util.get_node_ip_address(), free_port(), "nccl" if cuda else "gloo", int(self._worker.world_size)
        weights = await self._committed()
        return ray.util.get_node_ip_address(), free_port(), backend_for(cast(dict[str, Any], weights.payload)), 0

    @ray.method(concurrency_group="io")
    async def join_collective(self, host: str, port: int, backend: str, timeout_s: float, receivers: int) -> bool:
        """Join the collective weight group at `host`:`port` as its source, serving the store and
        giving it the exported weights' layout (the sharded trainer: every rank joins as a source
        of the stream)."""
        if self._streams():
            await asyncio.to_thread(self._worker.join_weights, host, port, backend, timeout_s, receivers)
            return True
        layout = layout_of(cast(dict[str, Any], (await self._committed()).payload))
        join = functools.partial(Member.join, host, port, backend, timeout_s, receivers, source=0, layout=layout)
        self._collective = await asyncio.to_thread(join)
        return True

    async def _broadcast(self, round_: int) -> Weights:
        """Broadcast the committed version as round `round_`; its `Weights` (payload a `Broadcast`,
        whose `error` says why it failed: the receivers then load from the object store)."""
        if self._streams():  # every rank streams its shards
            error = None
            try:
                version = await asyncio.to_thread(self._worker.broadcast, round_)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                version = self._worker.compute.version
            return Weights(version=version, payload=Broadcast(round_, error))
        weights = await self._committed()
        member = self._collective
        error = None
        try:
            if member is None:
                raise RuntimeError("the trainer actor is no member of a collective weight group")
            await asyncio.to_thread(member.send, round_, weights.version, cast(dict[str, Any], weights.payload))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        return Weights(version=weights.version, payload=Broadcast(round_, error))

    async def _leave(self) -> None:
        member, self._collective = self._collective, None
        if member is not None:
            await asyncio.to_thread(member.close)

    async def _export(self) -> Weights:
        weights: Weights = await self._worker.export_weights()
        exported = self._exported
        if exported is None or exported.version != weights.version:
            ready = weights.ready  # (CUDA) recorded on the trainer's stream after the snapshot's copies were queued
            if ready is not None:  # this thread's stream would copy them out before they are written
                await asyncio.to_thread(ready.synchronize)  # type: ignore[attr-defined]
            encoded = encode(weights.payload)
            if isinstance(encoded, ArrayState):  # one copy into the object store (host memory)
                STAGED.add(sum(a.nbytes for a in encoded.arrays.values() if a is not None))
            exported = Weights(version=weights.version, payload=ray.put(encoded))
            self._exported = exported  # the previous version's object is freed once no sampler holds it
        return exported


# the default group runs the calls one at a time; "load" serves an interruptible replica's loads
SamplerActor: Any = ray.remote(max_concurrency=1, concurrency_groups={"load": 1}, max_restarts=SAMPLER_MAX_RESTARTS)(_SamplerActor)
# "train" admits a call queued behind the running one (TRAIN_AHEAD, or the next step's first
# micro-batch queued behind optim_step: never both at once); `_in_turn` runs them one at a time
TrainerActor: Any = ray.remote(concurrency_groups={"train": 1 + TRAIN_AHEAD, "io": 2})(_TrainerActor)


def trainer_call(actor: Any, method: str, *args: Any) -> Any:
    """Send `method` (one of `TRAINER_CALLS`; a "train" call's first argument is its number) to a
    trainer actor, in the method's concurrency group; returns the ObjectRef of its `Timed`."""
    group = TRAINER_CALLS[method]
    return actor.call.options(concurrency_group=group).remote(method, *(args if group == "train" else (None, *args)))


async def _close_actor(actor: Any, close: Any) -> None:
    """Close the hosted worker (`close`: the ObjectRef of its close call), then end the actor's
    process (even when closing failed or took over CLOSE_TIMEOUT_S, e.g. queued behind a call that
    never ends). An actor whose process already died has nothing to close: that is no error (it
    would hide the run's own)."""
    try:
        await asyncio.wait_for(close, CLOSE_TIMEOUT_S)
    except ACTOR_GONE:
        pass
    except TimeoutError:  # stuck behind a call that never ends: killed below
        pass
    finally:
        ray.kill(actor, no_restart=True)


class RaySampler(Sampler):
    """Driver-side `Sampler` / `GreedyEngine` over a `SamplerActor`."""

    def __init__(self, actor: Any, replica: int, restart_timeout_s: float = RESTART_TIMEOUT_S, *, interruptible: bool = False) -> None:
        self.actor = actor
        self.replica = replica
        self.interruptible = interruptible  # loads go to the actor's "load" group, beside a running generate
        self.restart_timeout_s = restart_timeout_s
        self.spans = ActorSpans(f"actor:sampler/{replica}")
        self._stale = False  # a weight load was lost with the actor's process: sample only after a restart and a load
        self._restarts = 0  # a load that fails after a restart completed was lost with the old process
        self._closed = False
        # its actor is a member of the collective weight group (`relayrl.backends.ray.collective`):
        # no longer once a receive failed or the actor was restarted (a new process)
        self.collective_member = False

    def _check(self) -> None:
        if self._stale:
            raise SamplerNeedsWeightsError(f"sampler replica {self.replica} lost a weight load with its actor's process")

    async def _call(self, method: str, *args: Any, group: str | None = None, **span_args: object) -> Any:
        """Await one actor call (in concurrency group `group`; None: the default one) and trace the
        actor's span of it."""
        await self.spans.sync(self.actor)
        start = self.spans.now()
        call = self.actor.call if group is None else self.actor.call.options(concurrency_group=group)
        ref = call.remote(method, *args)
        try:
            timed: Timed = await ref
        except asyncio.CancelledError:
            if method == "load_weights":  # a load waiting for an export that failed: it must not hold the actor
                ray.cancel(ref)
            raise
        value = timed.value
        if method == "load_weights":
            if isinstance(value, Received):  # a broadcast round's
                self.collective_member = self.collective_member and not value.fell_back
                span_args = {**span_args, "transport": "object_store" if value.fell_back else "collective"}
                if not value.fell_back:  # where the broadcast landed: the actor, or its vLLM engine's worker
                    span_args["received_by"] = "engine" if value.in_engine else "actor"
                value = value.version
            span_args = {**span_args, "version": value}  # the version loaded (an export's own)
        elif method == "generate":
            span_args = {**span_args, **generate_sizes(timed.value)}  # the decode batch's rows and passes (relayrl.plan)
        self.spans.record(method, start, timed, **span_args)
        return value

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        batch = list(requests)
        if not batch:
            return []
        self._check()
        result: list[GenerateResult] = await self._call("generate", batch, n=len(batch))
        return result

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        self._check()
        result: list[list[int]] = await self._call("greedy", [list(p) for p in prompts_tokens], max_new_tokens, n=len(prompts_tokens))
        return result

    async def generate_turns(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        batch = list(requests)
        if not batch:
            return []
        self._check()
        result: list[TurnResult] = await self._call("generate_turns", batch, n=len(batch))
        return result

    async def end_episodes(self, episodes: Sequence[str]) -> None:
        await self.actor.call.remote("end_episodes", list(episodes))

    async def load_weights(self, weights: Weights) -> None:
        restarts = self._restarts
        try:
            await self._call("load_weights", weights, group="load" if self.interruptible else None, version=weights.version)
        except ACTOR_GONE:
            self.collective_member = False  # (its process died: a new one joined no group)
            if restarts == self._restarts:  # not already made good by a restart (and the load after it)
                self._stale = True
            raise
        self._stale = False  # the actor holds these weights

    def restartable(self, exc: BaseException) -> bool:
        """Whether `exc` says the actor's process died / came back without weights (and this
        replica can be restarted: the weight publisher then loads the current weights into it)."""
        return not self._closed and isinstance(exc, (*ACTOR_GONE, SamplerNeedsWeightsError))

    async def restart(self) -> None:
        """Wait until Ray has restarted the actor (ping, retried, bounded by `restart_timeout_s`)
        and report it alive; it holds no weights until the orchestrator's weight publisher loads
        the current version into it (the actor refuses to sample until then). Raises when the
        actor is dead for good or not alive again in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.restart_timeout_s
        died = 0  # pings answered "dead" in a row: a restarting actor is "unavailable" instead
        while True:
            try:
                await asyncio.wait_for(self.actor.ping.remote(), max(0.1, deadline - loop.time()))
                break
            except (TimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                died = died + 1 if isinstance(exc, ray.exceptions.ActorDiedError) else 0
                if died >= 2:
                    raise RuntimeError(
                        f"sampler replica {self.replica}'s actor is dead for good (its restarts are used up or it was killed): {exc}"
                    ) from exc
                if loop.time() >= deadline:
                    raise TimeoutError(
                        f"sampler replica {self.replica}'s actor was not alive again within {self.restart_timeout_s:.0f}s"
                    ) from exc
                await asyncio.sleep(0.5)
        self.spans.unsync()  # a new process, perhaps on another node
        self.collective_member = False  # (a new process joined no group)
        self._restarts += 1  # a load sent to the old process and failing from now on changes nothing

    async def loaded_version(self) -> int | None:
        version: int | None = await self.actor.loaded_version.remote()
        return version

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await _close_actor(self.actor, self.actor.call.remote("close"))


@dataclass(slots=True)
class _Sent:
    """A training call sent to the trainer actor and not yet awaited."""

    method: str
    ref: Any  # its ObjectRef
    start: float  # run clock
    span_args: dict[str, object]


class RayTrainer(Trainer):
    """Driver-side `Trainer` over a `TrainerActor`. A micro-batch is collated on the driver (in
    the packing thread, overlapping the previous train step) and crosses as numpy arrays.

    `train_step` sends its micro-batch and returns once the previous micro-batch's train step has
    ended (TRAIN_AHEAD = 1): the next micro-batch is already queued in the actor when one ends, so
    the trainer does not sit idle for a round trip between micro-batches. A train step's error is
    therefore raised by the next training call (`train_step`, `optim_step`, `load_state`), which
    first awaits everything sent before it, as a `TrainStepError` naming the step.

    Across a step boundary the same holds with `optim_step_ahead(ahead)` (see
    `relayrl.backends.protocols.Trainer`; used while `queue_ahead`, i.e. `ray.queue_ahead`): the next
    step's first micro-batch is sent right behind `optim_step`, before the update's result came
    back, and the actor starts it the moment the update ends. `queued_ahead` counts the
    micro-batches sent so."""

    def __init__(self, actor: Any, queue_ahead: bool = True, ranks: int = 1) -> None:
        self.actor = actor
        self.ranks = ranks  # > 1: the actor is rank 0 of the sharded trainer (ray/ranks.py)
        self.spans = ActorSpans("actor:trainer")
        self._queue_ahead = queue_ahead
        self.queued_ahead = 0  # micro-batches sent behind an optim_step so far
        self._closed = False
        self._turn = 0  # training calls sent so far (the actor runs them in this order)
        self._sent: list[_Sent] = []
        self._trained: dict[int, float] = {}  # step -> seconds its train_step calls ran in the actor (their spans)
        self._optimized: dict[int, float] = {}  # step -> seconds its optim_step ran in the actor (its span)
        self._version = 0  # the committed version (optim_step's, load_state's): what an export holds

    @property
    def queue_ahead(self) -> bool:
        return self._queue_ahead

    def _gone(self, exc: BaseException, method: str) -> TrainerActorDiedError:
        which = "" if self.ranks == 1 else f" (sharded trainer rank 0 of {self.ranks})"
        return TrainerActorDiedError(f"trainer actor{which} died: {type(exc).__name__} during {method}: {exc}")

    async def _send(self, method: str, *args: Any, **span_args: object) -> _Sent:
        """Send one training call, numbered in the order the actor must run it."""
        try:
            await self.spans.sync(self.actor)
        except ACTOR_GONE as exc:
            raise self._gone(exc, method) from exc
        start = self.spans.now()  # before the call goes out: the actor may start at once
        sent = _Sent(method, trainer_call(self.actor, method, self._turn, *args), start, span_args)
        self._turn += 1
        return sent

    async def _result(self, sent: _Sent) -> Any:
        """Await a sent call's result and trace the actor's span of it."""
        try:
            timed: Timed = await sent.ref
        except ACTOR_GONE as exc:
            raise self._gone(exc, sent.method) from exc
        except ray.exceptions.RayTaskError as exc:
            if sent.method != "train_step":
                raise
            args = sent.span_args
            ahead = f", queued behind optim_step(step {int(args['step']) - 1})," if args.get("ahead") else ""  # type: ignore[call-overload]
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            raise TrainStepError(
                f"train_step(step {args['step']}, microbatch {args['microbatch']}){ahead} failed in the trainer actor: "
                f"{type(cause).__name__}: {cause}"
            ) from exc
        if sent.method in ("optim_step", "load_state"):
            self._version = int(timed.value)
        if sent.method == "optim_step":
            sent.span_args["step"] = timed.value  # the step whose commit made this version (steps are numbered from 1)
            self._optimized[int(timed.value)] = timed.end - timed.start
        elif sent.method == "train_step":
            step = int(sent.span_args["step"])  # type: ignore[call-overload]
            self._trained[step] = self._trained.get(step, 0.0) + (timed.end - timed.start)
        self.spans.record(sent.method, sent.start, timed, **sent.span_args)
        return timed.value

    async def _drain(self, keep: int = 0) -> None:
        """Await the sent training calls until at most `keep` are outstanding, oldest first."""
        while len(self._sent) > keep:
            await self._result(self._sent.pop(0))

    async def _send_io(self, method: str, *args: Any) -> _Sent:
        """Send an "io" call (answered while a train step runs)."""
        try:
            await self.spans.sync(self.actor)
            start = self.spans.now()
            return _Sent(method, trainer_call(self.actor, method, *args), start, {})
        except ACTOR_GONE as exc:
            raise self._gone(exc, method) from exc

    async def _call(self, method: str, *args: Any) -> Any:
        """An "io" call: send it, await it and trace its span."""
        return await self._result(await self._send_io(method, *args))

    async def train_step(self, batch: TrainBatch) -> None:
        sent = dataclasses.replace(batch, payload=encode(batch.payload))
        self._sent.append(await self._send("train_step", sent, step=batch.step, microbatch=batch.index))
        await self._drain(keep=TRAIN_AHEAD)

    def step_train_time(self, step: int) -> float | None:
        """The summed duration of `step`'s train_step spans in the actor (the `actor:trainer` lane's,
        which the summary's trainer busy fraction reads): every one has returned once `optim_step`
        drained them. Forgets this step and those before it."""
        seconds = self._trained.pop(step, 0.0)
        for earlier in [s for s in self._trained if s < step]:
            del self._trained[earlier]
        return seconds

    def step_optim_time(self, step: int) -> float | None:
        """The duration of `step`'s optim_step span in the actor (the driver's call also waits for
        the train steps sent ahead). Forgets this step and those before it."""
        seconds = self._optimized.pop(step, 0.0)
        for earlier in [s for s in self._optimized if s < step]:
            del self._optimized[earlier]
        return seconds

    async def optim_step(self) -> int:
        await self._drain()
        version: int = await self._result(await self._send("optim_step"))
        return version

    async def optim_step_ahead(self, ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
        """`optim_step`; once the update is sent, `ahead()` (the next step's first micro-batch if
        it is packed by now) is sent right behind it as the next training call: the actor starts
        it the moment the update ends. Returns the new version once the update's result is back,
        and whether a micro-batch was queued; that micro-batch's train step is then outstanding as
        after `train_step(batch)` (the next training call awaits it)."""
        await self._drain()
        optim = await self._send("optim_step")
        batch = ahead()  # as late as possible: it may have been packed while the step's last micro-batch trained
        if batch is not None:
            encoded = dataclasses.replace(batch, payload=encode(batch.payload))
            self._sent.append(await self._send("train_step", encoded, step=batch.step, microbatch=batch.index, ahead=True))
            self.queued_ahead += 1
        version: int = await self._result(optim)
        return version, batch is not None

    async def get_metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = await self._call("get_metrics")
        return dict(metrics)

    async def export_weights(self) -> Weights:
        weights: Weights = await self._call("export_weights")
        return weights

    async def export_ahead(self) -> PendingExport:
        """Send the export and return at once: the samplers' loads wait for it in their own
        processes (`Exporting`, `resolve`), so none waits for the driver to see it end."""
        sent = await self._send_io("export_weights")
        return PendingExport(Weights(self._version, Exporting(sent.ref)), self._result(sent))

    async def broadcast_ahead(self, round_: int) -> PendingExport:
        """Send the collective broadcast of the committed version as round `round_` and return at
        once: each sampler actor receives it where it loads (`relayrl.backends.ray.collective`)."""
        sent = await self._send_io("broadcast_weights", round_)
        return PendingExport(Weights(self._version, Broadcast(round_)), self._result(sent))

    async def save_state(self, directory: Path) -> None:
        await self._call("save_state", directory)

    async def load_state(self, directory: Path) -> int:
        await self._drain()
        version: int = await self._result(await self._send("load_state", directory))
        return version

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sent.clear()  # a failed or cancelled run's unawaited calls end with the actor
            await _close_actor(self.actor, trainer_call(self.actor, "close"))


def attach_tracer(workers: Sequence[RaySampler | RayTrainer], tracer: Tracer) -> None:
    """Trace the actors' spans of `workers`' calls onto `tracer` from now on."""
    for worker in workers:
        worker.spans.attach(tracer)


class ResolvingEngine:
    """A driver-side `GreedyEngine` (e.g. the evaluator's local engine) that loads weights
    arriving by object-store reference."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    async def load_weights(self, weights: Weights) -> None:
        await self._engine.load_weights(await resolve(weights))

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        result: list[list[int]] = await self._engine.greedy(prompts_tokens, max_new_tokens)
        return result

    async def close(self) -> None:
        await self._engine.close()
