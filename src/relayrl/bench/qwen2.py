"""Random Qwen2 models built from their shape alone (nothing downloaded): Qwen2.5-0.5B's shape and
the builder the GPU check and `relayrl bench weights` use. Imports only the standard library at
the top (the GPU check's driver imports it before it knows the Python it runs in)."""

from __future__ import annotations

from typing import Any

#: Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B); `--tiny` shrinks it for a CPU test.
QWEN2_05B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def build_random_qwen2(dims: dict[str, Any], device: str, dtype: Any = None, seed: int = 0) -> Any:
    """A Qwen2 of these dimensions built on `meta` (no memory, nothing downloaded), materialised
    on `device` with `to_empty` and initialised there (normal(0, 0.02) weights, unit norms, zero
    biases; the tied head shares the embedding)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**dims, eos_token_id=1, bos_token_id=2, pad_token_id=0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model.to_empty(device=device)
    if dims.get("tie_word_embeddings"):
        model.lm_head.weight = model.model.embed_tokens.weight
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=generator)
    for name, module in list(model.named_modules()):  # the rotary embeddings' buffers: made again on the device
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            with torch.device(device):  # (its constructor's signature differs between transformers versions)
                fresh = type(module)(config=model.config).to(device)
            setattr(model.get_submodule(parent) if parent else model, attr, fresh)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


__all__ = ["QWEN2_05B", "build_random_qwen2"]
