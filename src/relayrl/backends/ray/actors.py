"""Ray actors hosting the same workers the in-process backends use, and the driver-side adapters
that implement the `Sampler` / `Trainer` protocols by awaiting actor calls.

Each actor is built from a factory run inside the actor's process (the sim's `SimSampler` /
`SimTrainer`; the local backend's `LocalSampler` / `LocalTrainer`, i.e. `SamplerCompute` /
`TrainerCompute` on their worker thread), and awaits that worker's async methods.

Invariants:
- a sampler actor runs one call at a time, in call order (max_concurrency=1), so a load never
  races a generate and a generate reports the version loaded when it started;
- the trainer actor runs train_step / optim_step / load_state one at a time in the "train"
  concurrency group; get_metrics, export_weights and save_state run in the "io" group, so they
  never wait behind a train step (as LocalTrainer's thread-safe calls do in one process);
- weights travel once per version through the object store: the trainer actor converts a
  version's state dict to numpy arrays (torch tensors pickle ~50x slower) and `ray.put`s it once;
  `Weights.payload` is then the ObjectRef, which the driver only passes on; each sampler actor
  fetches it (zero-copy on one node) and copies it into its model;
- a sampler actor whose process dies is restarted by Ray (`SAMPLER_MAX_RESTARTS`; its constructor
  builds a fresh worker) and refuses to sample (`SamplerNeedsWeightsError`) until the orchestrator
  has loaded the current weights into it (`RaySampler.restart`, called by the sample stage); a
  weight load lost with a dead process does the same on the driver side;
- the trainer actor is never restarted: its process dying fails the run with a
  `TrainerActorDiedError` ("trainer actor died: ..."); closing an actor whose process already died
  is no error.
"""

from __future__ import annotations

import asyncio
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from relayrl.types import GenerateResult, SampleRequest, TrainBatch, Weights


@dataclass(slots=True)
class ArrayState:
    """A state dict as numpy arrays; bfloat16 tensors travel as int16 views (numpy has no bf16)."""

    arrays: dict[str, Any]
    bfloat16: tuple[str, ...] = ()


def to_transport(payload: object) -> object:
    """A payload as it goes into the object store: a dict of torch tensors → `ArrayState`."""
    if not isinstance(payload, dict) or not payload or not all(hasattr(v, "detach") for v in payload.values()):
        return payload
    import torch

    arrays: dict[str, Any] = {}
    bf16: list[str] = []
    for name, tensor in payload.items():
        t = tensor.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
            bf16.append(name)
        arrays[name] = t.numpy()
    return ArrayState(arrays, tuple(bf16))


def from_transport(payload: object) -> object:
    """The inverse of `to_transport`: tensors over the (read-only, shared) arrays; the receiver
    copies them into its model."""
    if not isinstance(payload, ArrayState):
        return payload
    import torch

    out: dict[str, Any] = {}
    with warnings.catch_warnings():  # read-only arrays: load_state_dict only reads (copies) them
        warnings.simplefilter("ignore", UserWarning)
        for name, array in payload.arrays.items():
            t = torch.from_numpy(array)
            out[name] = t.view(torch.bfloat16) if name in payload.bfloat16 else t
    return out


async def resolve(weights: Weights) -> Weights:
    """`weights` with its payload fetched from the object store (when it is a reference) and
    turned back into what the worker loads."""
    payload = weights.payload
    if isinstance(payload, ray.ObjectRef):
        payload = await payload
    return Weights(version=weights.version, payload=from_transport(payload))


class SamplerNeedsWeightsError(RuntimeError):
    """A restarted sampler actor (or one whose weight load was lost with its process) was asked to
    sample before it loaded the current weights."""


class TrainerActorDiedError(RuntimeError):
    """The trainer actor's process died: the run cannot go on."""


# errors that mean an actor's process died or cannot be reached (it may be restarting)
ACTOR_GONE: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
SAMPLER_MAX_RESTARTS = 3  # Ray restarts a sampler actor whose process died up to this many times
RESTART_TIMEOUT_S = 60.0  # a sampler actor not alive again within this is retired


class _SamplerActor:
    def __init__(self, factory: Callable[[], Any]) -> None:
        self._worker = factory()  # on a restart, Ray runs this again: a fresh worker
        self._loaded: int | None = None
        self._restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)

    async def ready(self) -> bool:
        return True

    async def ping(self) -> bool:
        return True

    async def pid(self) -> int:
        return os.getpid()

    def _check_weights(self) -> None:
        if self._restarted and self._loaded is None:
            raise SamplerNeedsWeightsError("this sampler actor was restarted and has not loaded the current weights")

    async def generate(self, requests: list[SampleRequest]) -> list[GenerateResult]:
        self._check_weights()
        result: list[GenerateResult] = await self._worker.generate(requests)
        return result

    async def greedy(self, prompts_tokens: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        self._check_weights()
        result: list[list[int]] = await self._worker.greedy(prompts_tokens, max_new_tokens)
        return result

    async def load_weights(self, weights: Weights) -> None:
        resolved = await resolve(weights)
        await self._worker.load_weights(resolved)
        self._loaded = resolved.version

    async def loaded_version(self) -> int | None:
        """The version of the last weights this actor loaded (None: none yet)."""
        return self._loaded

    async def close(self) -> None:
        await self._worker.close()


class _TrainerActor:
    def __init__(self, factory: Callable[[], Any]) -> None:
        self._worker = factory()
        self._exported: Weights | None = None  # the last version put into the object store

    async def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="io")
    async def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="train")
    async def train_step(self, batch: TrainBatch) -> tuple[float, float]:
        """Returns (start, end) on this node's wall clock."""
        start = time.time()
        await self._worker.train_step(batch)
        return start, time.time()

    @ray.method(concurrency_group="train")
    async def optim_step(self) -> int:
        version: int = await self._worker.optim_step()
        return version

    @ray.method(concurrency_group="train")
    async def load_state(self, directory: Path) -> int:
        version: int = await self._worker.load_state(directory)
        return version

    @ray.method(concurrency_group="io")
    async def get_metrics(self) -> tuple[dict[str, float], float, float]:
        """The metrics slot and (start, end) of the call on this node's wall clock."""
        start = time.time()
        metrics: dict[str, float] = await self._worker.get_metrics()
        return metrics, start, time.time()

    @ray.method(concurrency_group="io")
    async def export_weights(self) -> Weights:
        weights: Weights = await self._worker.export_weights()
        exported = self._exported
        if exported is None or exported.version != weights.version:
            exported = Weights(version=weights.version, payload=ray.put(to_transport(weights.payload)))
            self._exported = exported  # the previous version's object is freed once no sampler holds it
        return exported

    @ray.method(concurrency_group="io")
    async def save_state(self, directory: Path) -> None:
        await self._worker.save_state(directory)

    @ray.method(concurrency_group="io")
    async def close(self) -> None:
        await self._worker.close()


SamplerActor: Any = ray.remote(max_concurrency=1, max_restarts=SAMPLER_MAX_RESTARTS)(_SamplerActor)
TrainerActor: Any = ray.remote(concurrency_groups={"train": 1, "io": 2})(_TrainerActor)


async def _close_actor(actor: Any) -> None:
    """Close the hosted worker, then end the actor's process (even when closing failed). An actor
    whose process already died has nothing to close: that is no error (it would hide the run's own)."""
    try:
        await actor.close.remote()
    except ACTOR_GONE:
        pass
    finally:
        ray.kill(actor, no_restart=True)


class RaySampler:
    """Driver-side `Sampler` / `GreedyEngine` over a `SamplerActor`."""

    def __init__(self, actor: Any, replica: int, trainer: RayTrainer | None = None, restart_timeout_s: float = RESTART_TIMEOUT_S) -> None:
        self.actor = actor
        self.replica = replica
        self.trainer = trainer  # where a restarted actor gets the current weights (None: no restarts)
        self.restart_timeout_s = restart_timeout_s
        self._stale = False  # a weight load was lost with the actor's process: sample only after a restart
        self._restarts = 0  # a load that fails after a restart completed was lost with the old process
        self._closed = False

    def _check(self) -> None:
        if self._stale:
            raise SamplerNeedsWeightsError(f"sampler replica {self.replica} lost a weight load with its actor's process")

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        batch = list(requests)
        if not batch:
            return []
        self._check()
        result: list[GenerateResult] = await self.actor.generate.remote(batch)
        return result

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        self._check()
        result: list[list[int]] = await self.actor.greedy.remote([list(p) for p in prompts_tokens], max_new_tokens)
        return result

    async def load_weights(self, weights: Weights) -> None:
        restarts = self._restarts
        try:
            await self.actor.load_weights.remote(weights)
        except ACTOR_GONE:
            if restarts == self._restarts:  # not already made good by a restart that loaded newer weights
                self._stale = True
            raise

    def restartable(self, exc: BaseException) -> bool:
        """Whether `exc` says the actor's process died / came back without weights (and this
        replica can fetch the current weights to restart)."""
        return self.trainer is not None and not self._closed and isinstance(exc, (*ACTOR_GONE, SamplerNeedsWeightsError))

    async def restart(self, min_version: int) -> int:
        """Wait until Ray has restarted the actor (ping, retried, bounded by `restart_timeout_s`),
        load the trainer's newest weights into it and return their version."""
        if self.trainer is None:
            raise RuntimeError(f"sampler replica {self.replica} cannot be restarted: it has no trainer to fetch weights from")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.restart_timeout_s
        while True:
            try:
                await asyncio.wait_for(self.actor.ping.remote(), max(0.1, deadline - loop.time()))
                break
            except (TimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                if loop.time() >= deadline:
                    raise TimeoutError(
                        f"sampler replica {self.replica}'s actor was not alive again within {self.restart_timeout_s:.0f}s"
                    ) from exc
                await asyncio.sleep(0.5)
        weights = await self.trainer.export_weights()
        if weights.version < min_version:
            raise RuntimeError(f"the trainer exported version {weights.version}, older than the synced version {min_version}")
        await self.actor.load_weights.remote(weights)
        self._stale = False
        self._restarts += 1
        return weights.version

    async def loaded_version(self) -> int | None:
        version: int | None = await self.actor.loaded_version.remote()
        return version

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await _close_actor(self.actor)


class RayTrainer:
    """Driver-side `Trainer` over a `TrainerActor`."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._closed = False

    async def _call(self, method: str, *args: Any) -> Any:
        """Await one actor call; the actor's process dying → `TrainerActorDiedError` naming it."""
        try:
            return await getattr(self.actor, method).remote(*args)
        except ACTOR_GONE as exc:
            raise TrainerActorDiedError(f"trainer actor died: {type(exc).__name__} during {method}: {exc}") from exc

    async def train_step(self, batch: TrainBatch) -> None:
        await self._call("train_step", batch)

    async def optim_step(self) -> int:
        version: int = await self._call("optim_step")
        return version

    async def get_metrics(self) -> dict[str, float]:
        metrics, _, _ = await self._call("get_metrics")
        return dict(metrics)

    async def export_weights(self) -> Weights:
        weights: Weights = await self._call("export_weights")
        return weights

    async def save_state(self, directory: Path) -> None:
        await self._call("save_state", directory)

    async def load_state(self, directory: Path) -> int:
        version: int = await self._call("load_state", directory)
        return version

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await _close_actor(self.actor)


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
