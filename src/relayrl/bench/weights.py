"""`relayrl bench weights`: every weight transport (`rollout.weight_transport`) side by side in one
run, on the tiny model, a random 52M Qwen2 and a random Qwen2.5-0.5B-shaped Qwen2 (built from
their configs: nothing is downloaded).

One version = the trainer's commit snapshot (`clone_once` of its state dict, as
`LocalTrainer.export` makes at each commit) moved into every replica's model: export + every
replica loaded, timed from the export's start to the last load's end. Per model and transport:
bytes per version (the export's), seconds per version (the median of `versions` after one
warm-up), GB/s (a version's bytes over that time) and host copies (bytes staged in host memory,
`relayrl.backends.transports.STAGED`, summed over every process, per version, divided by a
version's bytes: a transport that stages nothing counts 0).

- direct: in this process, each replica's model `load_state_dict`s the snapshot (what
  `LocalSampler.load_weights` does);
- file: in this process, per replica the vLLM path's file written from the snapshot
  (`relayrl.backends.vllm.sampler._write_weights`, /dev/shm) and read back (`safetensors`'
  `load_file`, as the engine's worker does), then copied into the replica's model (the engine's
  own `reload_weights` stands replaced by `load_state_dict`; no vLLM needed);
- object_store and collective: a Ray trainer actor and `replicas` sampler actors (the real actors,
  hosting stand-in workers that hold the models), on one local cluster started for the benchmark
  (or the one this process is connected to): the object store through the trainer's export ahead
  (the sync round's path), the collective through `relayrl.backends.ray.collective`;
- sharded_gathered and sharded_stream: the collective transport from a 2-rank FSDP2 trainer, the
  full weights gathered to rank 0 then sent, beside each rank's shards streamed
  (relayrl.bench.weight_stream: plain processes, no Ray), with rank 0's peak host bytes;
- vllm_file and vllm_collective (`--vllm`, from .venv-vllm): `replicas` real vLLM engines in this
  process, each version by its file and through vLLM's weight-transfer API
  (relayrl.backends.vllm.broadcast), with the bytes each engine's worker staged;
- vllm_ray_object_store, vllm_ray_collective_actor and vllm_ray_collective (`--vllm` with Ray):
  the engines in Ray sampler actors, each version through the object store, by the collective
  received in the actor and loaded by file (engines without relayrl's weight-transfer engine: the
  path before it), and by the collective received in each engine's worker (the actor's place).

Target (issue 31): on the 0.5B-shaped model across 2 Ray sampler actors, the collective
transport's seconds per version at most half the object store's (printed met / MISSED).
Every process computes on one thread (`torch.set_num_threads(1)`: the in-process transports and
each actor alike; on a loaded 2-core machine two threads per copy made the in-process copies 10x
slower). Memory: one model's actors at a time; at bfloat16 (the default) the 0.5B shape is ~1 GB a copy.
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from relayrl.bench.weight_models import WEIGHT_MODELS, build_model

if TYPE_CHECKING:
    from relayrl.backends.vllm.engine import EngineSettings

TARGET_MODEL = "qwen2-0.5b"
TARGET_SPEEDUP = 2.0  # collective vs object_store seconds per version, TARGET_MODEL, 2 replicas
MB = 2**20

__all__ = ["TARGET_MODEL", "TARGET_SPEEDUP", "run_weights"]


class BenchTrainer:
    """A trainer stand-in: each export is a new commit's snapshot of its model (`clone_once`)."""

    def __init__(self, model: str, dtype: str) -> None:
        import torch

        torch.set_num_threads(1)
        self.model = build_model(model, dtype)
        self.version = 0

    async def export_weights(self) -> Any:
        from relayrl.models.sharing import clone_once
        from relayrl.types import Weights

        self.version += 1
        return Weights(version=self.version, payload=clone_once(self.model.state_dict()))

    async def close(self) -> None:
        return None


class BenchSampler:
    """A sampler stand-in: loads a version into its model as `LocalSampler.load_weights` does."""

    def __init__(self, model: str, dtype: str, seed: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.model = build_model(model, dtype, seed=seed)
        self.version = 0

    async def load_weights(self, weights: Any) -> None:
        import torch

        with torch.no_grad():
            self.model.load_state_dict(weights.payload, strict=False)
        self.version = weights.version

    async def close(self) -> None:
        return None


def _median_s(run: Callable[[], float], versions: int) -> float:
    run()  # warm-up (allocations, first touches)
    return statistics.median(run() for _ in range(versions))


def _in_process(model: str, dtype: str, replicas: int, versions: int) -> dict[str, dict[str, float]]:
    """direct and file, in this process."""
    import torch
    from safetensors.torch import load_file

    from relayrl.backends.transports import STAGED
    from relayrl.backends.vllm.sampler import _write_weights
    from relayrl.models.sharing import clone_once, unique_bytes

    trainer = build_model(model, dtype)
    samplers = [build_model(model, dtype, seed=1 + i) for i in range(replicas)]
    nbytes = unique_bytes(clone_once(trainer.state_dict()))

    def direct() -> float:
        start = time.perf_counter()
        snapshot = clone_once(trainer.state_dict())
        with torch.no_grad():
            for s in samplers:
                s.load_state_dict(snapshot, strict=False)
        return time.perf_counter() - start

    def file() -> float:
        start = time.perf_counter()
        snapshot = clone_once(trainer.state_dict())
        state: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in snapshot.items():  # tied aliases dropped, as VllmSampler.loadable does
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                state[name] = t
        for i, s in enumerate(samplers):
            path = _write_weights(state, i)
            try:
                loaded = load_file(path)
                STAGED.add(sum(t.numel() * t.element_size() for t in loaded.values()))  # (the worker counts its read)
                with torch.no_grad():
                    s.load_state_dict(loaded, strict=False)
            finally:
                os.unlink(path)
        return time.perf_counter() - start

    out: dict[str, dict[str, float]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, run in (("direct", direct), ("file", file)):
            before = STAGED.read()
            seconds = _median_s(run, versions)
            out[name] = _figures(nbytes, seconds, (STAGED.read() - before) / (versions + 1))
    finally:
        torch.set_num_threads(threads)
    return out


def _figures(nbytes: int, seconds: float, staged_per_version: float) -> dict[str, float]:
    return {
        "bytes_per_version": float(nbytes),
        "seconds_per_version": seconds,
        "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        "host_copies": staged_per_version / nbytes if nbytes else 0.0,
    }


def _staged(actor: Any) -> int:
    """The bytes an actor's process staged in host memory so far."""
    import ray

    def read(_self: Any) -> int:
        from relayrl.backends.transports import STAGED

        return STAGED.read()

    staged: int = ray.get(actor.__ray_call__.remote(read))
    return staged


async def _forget_export(actor: Any) -> None:
    """Drop the trainer actor's reference to its last object-store version (its memory freed)."""

    def forget(self: Any) -> None:
        self._exported = None

    await actor.__ray_call__.remote(forget)


async def _timed_versions(one: Callable[[], Awaitable[None]], versions: int) -> float:
    await one()
    times = []
    for _ in range(versions):
        start = time.perf_counter()
        await one()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _worker_staged(samplers: Sequence[Any]) -> int:
    """The bytes this process and every vLLM engine's worker staged in host memory so far."""
    from relayrl.backends.transports import STAGED

    workers = [sum(await s.engine.collective_rpc("staged_bytes")) for s in samplers]
    return STAGED.read() + sum(workers)


def _engine_settings(directory: Path, dtype: str, *, transfer: bool) -> EngineSettings:
    """A benchmark engine's settings on the model saved in `directory`: no tokenizer (the engines
    take token ids), a context of at most 256 tokens, relayrl's weight-transfer engine if `transfer`."""
    from relayrl.backends.vllm.engine import EngineSettings, context_length

    context = min(256, context_length(directory))
    return EngineSettings(model=str(directory), dtype=dtype, max_model_len=context, skip_tokenizer_init=True, weight_transfer=transfer)


def _vllm_engines(model: str, dtype: str, replicas: int, versions: int, nbytes: int) -> dict[str, dict[str, float]]:
    """vllm_file and vllm_collective: `replicas` real vLLM engines in this process on `model`
    saved to a temporary directory (safetensors, no tokenizer: the engines take token ids), each
    version by its file and through vLLM's weight-transfer API (a collective round that fell back
    to the file fails the benchmark); host copies read in this process and every engine's worker."""
    import shutil
    import tempfile

    import torch

    from relayrl.backends.protocols import Trainer
    from relayrl.backends.vllm.broadcast import VllmBroadcast
    from relayrl.backends.vllm.sampler import VllmSampler

    threads = torch.get_num_threads()
    directory = Path(tempfile.mkdtemp(prefix="relayrl-bench-vllm-"))
    try:
        trainer = BenchTrainer(model, dtype)  # (one compute thread, as the other rows)
        trainer.model.save_pretrained(directory)
        settings = _engine_settings(directory, dtype, transfer=True)

        async def main() -> dict[str, dict[str, float]]:
            samplers = [VllmSampler(settings, temperature=1.0, max_new_tokens=4, replica=i) for i in range(replicas)]
            try:
                broadcast = VllmBroadcast(cast(Trainer, trainer), samplers, 0.0)

                async def file() -> None:
                    weights = await trainer.export_weights()
                    await asyncio.gather(*(s.load_weights(weights) for s in samplers))

                async def collective() -> None:
                    pending = await broadcast.export_ahead()
                    loads = [asyncio.ensure_future(s.load_weights(pending.weights)) for s in samplers]
                    await pending.done
                    await asyncio.gather(*loads)
                    if broadcast.broken is not None or any(s.fell_back for s in samplers):
                        raise RuntimeError(f"the collective round fell back to the file: {broadcast.broken or 'a receive failed'}")

                out: dict[str, dict[str, float]] = {}
                for name, one in (("vllm_file", file), ("vllm_collective", collective)):
                    before = await _worker_staged(samplers)
                    seconds = await _timed_versions(one, versions)
                    out[name] = _figures(nbytes, seconds, (await _worker_staged(samplers) - before) / (versions + 1))
                return out
            finally:
                await asyncio.gather(*(s.close() for s in samplers), return_exceptions=True)

        return asyncio.run(main())
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(directory, ignore_errors=True)


def _ray_rounds(
    model: str,
    dtype: str,
    versions: int,
    nbytes: int,
    sampler_factories: Sequence[Callable[[], Any]],
    rows: dict[str, str],
    *,
    in_engine: bool = False,
) -> dict[str, dict[str, float]]:
    """A trainer actor and one sampler actor per factory; per transport in `rows` (object_store,
    collective: the row's name), `versions` timed versions after one warm-up. A collective round
    that fell back to the object store fails the benchmark, as one not received where `in_engine`
    says (the vLLM engine's worker, or the actor)."""
    from relayrl.backends.ray.actors import RaySampler, RayTrainer, SamplerActor, TrainerActor
    from relayrl.backends.ray.collective import join

    trainer_actor = TrainerActor.options(num_cpus=0).remote(functools.partial(BenchTrainer, model, dtype))
    sampler_actors = [SamplerActor.options(num_cpus=0).remote(f) for f in sampler_factories]
    trainer = RayTrainer(trainer_actor, queue_ahead=False)
    samplers = [RaySampler(a, i) for i, a in enumerate(sampler_actors)]
    out: dict[str, dict[str, float]] = {}

    async def staged() -> int:
        return _staged(trainer_actor) + sum(await asyncio.gather(*(a.staged_bytes.remote() for a in sampler_actors)))

    async def measure(name: str, one: Callable[[], Awaitable[None]]) -> None:
        before = await staged()
        seconds = await _timed_versions(one, versions)
        out[name] = _figures(nbytes, seconds, (await staged() - before) / (versions + 1))

    async def go() -> None:
        await asyncio.gather(trainer_actor.ready.remote(), *(a.ready.remote() for a in sampler_actors))

        async def object_store() -> None:
            pending = await trainer.export_ahead()
            await asyncio.gather(pending.done, *(s.load_weights(pending.weights) for s in samplers))  # (as a sync round)

        if "object_store" in rows:
            await measure(rows["object_store"], object_store)
            await _forget_export(trainer_actor)  # (the last version in the object store: freed before the next phase)
        if "collective" not in rows:
            return
        broadcast = await asyncio.to_thread(join, trainer, samplers, 0.0)

        def engine_member(self: Any) -> bool:
            return bool(self._engine_member)

        async def collective() -> None:
            pending = await broadcast.export_ahead()
            await asyncio.gather(pending.done, *(s.load_weights(pending.weights) for s in samplers))
            if broadcast.broken is not None or not all(s.collective_member for s in samplers):
                raise RuntimeError(f"the collective broadcast failed: {broadcast.broken or 'a receiver fell back to the object store'}")
            where = await asyncio.gather(*(a.__ray_call__.remote(engine_member) for a in sampler_actors))
            if any(w != in_engine for w in where):
                raise RuntimeError(f"the collective broadcast was not received {'in' if in_engine else 'beside'} the engines: {where}")

        await measure(rows["collective"], collective)

    async def main() -> None:
        try:
            await go()
        finally:
            await asyncio.gather(*(s.close() for s in samplers), trainer.close(), return_exceptions=True)

    asyncio.run(main())
    return out


def _on_ray(model: str, dtype: str, replicas: int, versions: int, nbytes: int) -> dict[str, dict[str, float]]:
    """object_store and collective, across a trainer actor and `replicas` sampler actors."""
    factories = [functools.partial(BenchSampler, model, dtype, 1 + i) for i in range(replicas)]
    return _ray_rounds(model, dtype, versions, nbytes, factories, {"object_store": "object_store", "collective": "collective"})


def _vllm_on_ray(model: str, dtype: str, replicas: int, versions: int, nbytes: int) -> dict[str, dict[str, float]]:
    """vllm_ray_object_store, vllm_ray_collective_actor and vllm_ray_collective: `replicas` Ray
    sampler actors each hosting a real vLLM engine on `model` (saved to a temporary directory).
    Engines started without relayrl's weight-transfer engine: the object store, then the
    collective received in each actor and loaded into its engine by file (the path before the
    engine received it); then fresh actors with engines started with it: the collective received
    in each engine's worker."""
    import shutil
    import tempfile

    from relayrl.backends.vllm.sampler import VllmSampler

    directory = Path(tempfile.mkdtemp(prefix="relayrl-bench-vllm-"))
    try:
        build_model(model, dtype).save_pretrained(directory)

        def engines(transfer: bool) -> list[Callable[[], Any]]:
            settings = _engine_settings(directory, dtype, transfer=transfer)
            return [functools.partial(VllmSampler, settings, temperature=1.0, max_new_tokens=4, replica=i) for i in range(replicas)]

        before = {"object_store": "vllm_ray_object_store", "collective": "vllm_ray_collective_actor"}
        out = _ray_rounds(model, dtype, versions, nbytes, engines(False), before)
        out.update(_ray_rounds(model, dtype, versions, nbytes, engines(True), {"collective": "vllm_ray_collective"}, in_engine=True))
        return out
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_weights(
    models: Sequence[str] = WEIGHT_MODELS,
    *,
    replicas: int = 2,
    versions: int = 3,
    dtype: str = "bfloat16",
    ray: bool = True,
    ray_address: str = "",
    sharded: bool = True,
    vllm: bool = False,
) -> dict[str, object]:
    """The figures of every transport per model (see the module). `ray_address`: "" starts a local
    cluster for the benchmark (its object store sized for the largest model), else the cluster
    this process is connected to / joins. `sharded`: also the rows of a 2-rank trainer
    (relayrl.bench.weight_stream). `vllm`: also the vLLM engines' file and collective transports
    (needs vLLM)."""
    from relayrl.models.sharing import clone_once, unique_bytes

    sizes: dict[str, tuple[int, int]] = {}
    figures: dict[str, Any] = {}
    for name in models:
        m = build_model(name, dtype)
        export_bytes = unique_bytes(clone_once(m.state_dict()))
        params = sum(p.numel() * p.element_size() for p in m.parameters())  # (tied parameters once)
        del m
        sizes[name] = (export_bytes, params)
        figures[name] = {"export_bytes": export_bytes, "unique_param_bytes": params, "transports": {}}
        figures[name]["transports"].update(_in_process(name, dtype, replicas, versions))
        if sharded:
            from relayrl.bench.weight_stream import run_sharded

            figures[name]["transports"].update(run_sharded(name, dtype, replicas, versions, export_bytes))
        if vllm:
            figures[name]["transports"].update(_vllm_engines(name, dtype, replicas, versions, export_bytes))
    if ray:
        from relayrl.backends.ray.cluster import connect
        from relayrl.config.schema import RayConfig

        if not ray_address:  # a cluster of its own: no worker killed by Ray's memory monitor for what other processes hold
            os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        largest = max(b for b, _ in sizes.values())
        store_mb = 3 * largest // MB + 256  # two versions held at once (one being replaced) and room
        cluster = connect(RayConfig(address=ray_address, num_cpus=4, object_store_mb=store_mb))
        try:
            for name in models:
                figures[name]["transports"].update(_on_ray(name, dtype, replicas, versions, sizes[name][0]))
                if vllm:
                    figures[name]["transports"].update(_vllm_on_ray(name, dtype, replicas, versions, sizes[name][0]))
        finally:
            cluster.close()
    target: dict[str, Any] = {"model": TARGET_MODEL, "replicas": 2, "collective_over_object_store": TARGET_SPEEDUP}
    t = figures.get(TARGET_MODEL, {}).get("transports", {})
    if ray and replicas == 2 and "collective" in t and "object_store" in t:
        speedup = t["object_store"]["seconds_per_version"] / t["collective"]["seconds_per_version"]
        target.update(speedup=speedup, met=speedup >= TARGET_SPEEDUP)
    return {"dtype": dtype, "replicas": replicas, "versions": versions, "models": figures, "target": target}
