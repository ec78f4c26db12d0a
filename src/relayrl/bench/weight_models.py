"""The models `relayrl bench weights` moves (relayrl.bench.weights, relayrl.bench.weight_stream):
the shipped tiny one and random Qwen2s built from their configs (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

__all__ = ["WEIGHT_MODELS", "build_model"]

WEIGHT_MODELS = ("tiny", "qwen2-52m", "qwen2-0.5b")


def build_model(name: str, dtype: str, seed: int = 0) -> Any:
    """The benchmark's model `name` on the CPU in `dtype` (random weights but the tiny one's)."""
    import torch

    from relayrl.bench.qwen2 import QWEN2_05B, build_random_qwen2

    torch_dtype = getattr(torch, dtype)
    if name == "tiny":
        from transformers import AutoModelForCausalLM

        from relayrl.models.loading import shipped_model_dir

        return AutoModelForCausalLM.from_pretrained(shipped_model_dir(), dtype=torch_dtype).eval()
    if name == "qwen2-52m":
        from relayrl.bench.trainer import MODELS

        dims: dict[str, Any] = dict(MODELS["50m"])
        dims.update(num_key_value_heads=dims["num_attention_heads"], max_position_embeddings=1024, tie_word_embeddings=False)
    elif name == "qwen2-0.5b":
        dims = dict(QWEN2_05B)
    else:
        raise ValueError(f"no benchmark model named {name!r} (known: {', '.join(WEIGHT_MODELS)})")
    return build_random_qwen2(dims, "cpu", torch_dtype, seed=seed).eval()
