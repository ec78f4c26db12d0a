"""`relayrl bench trainer`: the sharded trainer (`train.world_size`) at 1, 2, ... ranks on the same
steps of a random Qwen2 built in-process (no download): tokens/s per configuration and, per rank,
the peak resident memory and the bytes of its shard of the parameters and of the AdamW state
(which should be ~1/N of the whole). Every configuration runs in rank processes (one rank = FSDP
over a group of one), so the per-rank figures compare like with like."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

#: Model sizes: "50m" (hidden 512, 6 layers, vocab 32k, untied: ~52 M parameters) and "tiny"
#: (the smoke test's).
MODELS: dict[str, dict[str, int]] = {
    "50m": {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6, "num_attention_heads": 8},
    "tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
}


def _model(name: str) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    dims: dict[str, Any] = dict(MODELS[name])
    config = Qwen2Config(
        **dims,
        num_key_value_heads=dims["num_attention_heads"],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).float()


def _steps(vocab: int, steps: int, microbatches: int, row_tokens: int) -> list[list[Any]]:
    """`steps` steps of `microbatches` packed micro-batches (one row of ~`row_tokens` each)."""
    from relayrl.backends.local.collate import TorchCollator
    from relayrl.packing import build_microbatch, plan
    from relayrl.types import Prompt, Trajectory, TrajectoryStatus

    rng = random.Random(0)
    per_row = 4
    length = row_tokens // per_row
    out = []
    for step in range(steps):
        trajs = []
        for i in range(microbatches * per_row):
            tokens = [rng.randrange(3, vocab) for _ in range(length)]
            trajs.append(
                Trajectory(
                    group_id=i,
                    sample_index=0,
                    prompt=Prompt(f"p{i}", "", ""),
                    prompt_tokens=tokens[: length // 2],
                    completion_tokens=tokens[length // 2 :],
                    sampler_logprobs=[-2.0] * (length - length // 2),
                    completion_text="",
                    policy_version=step,
                    replica=0,
                    reward=0.0,
                    advantage=rng.uniform(-1, 1),
                    status=TrajectoryStatus.OK,
                )
            )
        pp = plan(trajs, row_tokens, 1)
        batches = []
        for index in range(len(pp.microbatches)):
            mb = build_microbatch(step, index, trajs, pp)
            mb.payload = TorchCollator(pad_token_id=0).collate(mb)
            batches.append(mb.train_batch())
        out.append(batches)
    return out


async def _one(world_size: int, model: Any, steps: list[list[Any]], threads: int, device: str) -> dict[str, Any]:
    from relayrl.algorithms.losses import LossConfig
    from relayrl.backends.local.sharded import ShardedTrainer
    from relayrl.backends.local.trainer import TrainerSettings

    settings = TrainerSettings(learning_rate=1e-5, total_steps=len(steps), loss=LossConfig(), torch_threads=threads)
    start = time.perf_counter()
    trainer = ShardedTrainer(model, settings, world_size, device=device)
    try:
        await trainer.export_weights()  # ranks up
        startup = time.perf_counter() - start
        timed = 0.0
        tokens = 0
        for k, batches in enumerate(steps):
            t0 = time.perf_counter()
            for tb in batches:
                await trainer.train_step(tb)
            await trainer.optim_step()
            if k > 0:  # the first step warms up
                timed += time.perf_counter() - t0
                tokens += sum(tb.num_tokens for tb in batches)
        memory = await trainer.memory()
    finally:
        await trainer.close()
    return {"world_size": world_size, "startup_s": startup, "tokens_per_s": tokens / timed if timed else 0.0, "ranks": memory}


def run_trainer(
    world_sizes: list[int],
    *,
    model: str = "50m",
    steps: int = 3,
    microbatches: int = 4,
    row_tokens: int = 256,
    threads: int = 1,
    device: str = "cpu",
) -> dict[str, object]:
    """{"model": ..., "params": N, "configs": [figures per world size]} (see the module). `device`:
    "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r)."""
    built = _model(model)
    params = sum(p.numel() for p in built.parameters())
    batches = _steps(built.config.vocab_size, steps, microbatches, row_tokens)
    configs = [asyncio.run(_one(n, built, batches, threads, device)) for n in world_sizes]
    return {
        "model": model,
        "params": params,
        "param_bytes": params * 4,
        "load": {"steps": steps, "microbatches": microbatches, "row_tokens": row_tokens, "threads_per_rank": threads, "device": device},
        "configs": configs,
    }
