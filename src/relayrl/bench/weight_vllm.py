"""`relayrl bench weights --vllm`: the two transports of vLLM engines in one process side by side,
on real engines (vLLM must be installed: `scripts/setup.sh --vllm`, run from `.venv-vllm`).

The model is saved once to a temporary directory (safetensors, no tokenizer: the engines take
token ids) and `replicas` `VllmSampler`s are started on it, each computing in the model's dtype
(bfloat16 stays bfloat16, float32 stays float32). One version = a new commit snapshot of the
trainer stand-in's model (`clone_once` of its state dict, as `LocalTrainer` makes at each commit)
loaded into every engine:

- vllm_file: each replica's `load_weights` with the snapshot: its safetensors file in /dev/shm,
  read back and reloaded by its engine's worker (`rollout.weight_transport = "file"`);
- vllm_collective: a sync round through `relayrl.backends.vllm.broadcast` (the group set up in
  the warm-up round), each engine receiving through vLLM's weight-transfer API
  (`rollout.weight_transport = "collective"`); a round that fell back to the file fails the
  benchmark.

Host copies: bytes staged in host memory in this process and in every engine's worker
(`relayrl.backends.transports.STAGED`, read there through the worker extension), per version,
over a version's bytes.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from relayrl.bench.weight_models import build_model

__all__ = ["run_vllm_transports"]


class _Commits:
    """A trainer stand-in (its `export_weights` only): `commit` snapshots its model as a new version."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.weights: Any = None

    def commit(self) -> None:
        import torch

        from relayrl.models.sharing import clone_once
        from relayrl.types import Weights

        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1.0001)  # (each version is new bytes)
        self.weights = Weights(0 if self.weights is None else self.weights.version + 1, clone_once(self.model.state_dict()))

    async def export_weights(self) -> Any:
        return self.weights


async def _staged(samplers: list[Any]) -> int:
    from relayrl.backends.transports import STAGED

    worker = 0
    for s in samplers:
        worker += sum(await s.engine.collective_rpc("staged_bytes"))
    return STAGED.read() + worker


async def _timed(commits: _Commits, one: Callable[[], Awaitable[None]], versions: int) -> float:
    """The median seconds of `versions` versions, after one warm-up."""
    times = []
    for i in range(versions + 1):
        commits.commit()
        start = time.perf_counter()
        await one()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_vllm_transports(model: str, dtype: str, replicas: int, versions: int) -> dict[str, tuple[float, float]]:
    """vllm_file and vllm_collective on `model` in `dtype` (see the module): for each, (median
    seconds a version, bytes staged in host memory a version)."""
    import torch

    from relayrl.backends.protocols import Trainer
    from relayrl.backends.vllm.broadcast import VllmBroadcast
    from relayrl.backends.vllm.engine import EngineSettings, context_length
    from relayrl.backends.vllm.sampler import VllmSampler

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    directory = Path(tempfile.mkdtemp(prefix="relayrl-bench-vllm-"))
    try:
        commits = _Commits(build_model(model, dtype))
        commits.model.save_pretrained(directory)
        context = min(256, context_length(directory))
        settings = EngineSettings(model=str(directory), dtype=dtype, max_model_len=context, skip_tokenizer_init=True, weight_transfer=True)

        async def main() -> dict[str, tuple[float, float]]:
            samplers = [VllmSampler(settings, temperature=1.0, max_new_tokens=4, replica=i) for i in range(replicas)]
            try:
                broadcast = VllmBroadcast(cast(Trainer, commits), samplers, 0.0)

                async def file() -> None:
                    weights = await commits.export_weights()
                    await asyncio.gather(*(s.load_weights(weights) for s in samplers))

                async def collective() -> None:
                    pending = await broadcast.export_ahead()
                    loads = [asyncio.ensure_future(s.load_weights(pending.weights)) for s in samplers]
                    await pending.done
                    await asyncio.gather(*loads)
                    if broadcast.broken is not None or any(s.fell_back for s in samplers):
                        raise RuntimeError(f"the collective round fell back to the file: {broadcast.broken or 'a receive failed'}")

                out: dict[str, tuple[float, float]] = {}
                for name, one in (("vllm_file", file), ("vllm_collective", collective)):
                    before = await _staged(samplers)
                    seconds = await _timed(commits, one, versions)
                    out[name] = (seconds, (await _staged(samplers) - before) / (versions + 1))
                return out
            finally:
                await asyncio.gather(*(s.close() for s in samplers), return_exceptions=True)

        return asyncio.run(main())
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(directory, ignore_errors=True)
