"""A small randomly initialised Qwen2 for tests that need a real HF causal LM but not the shipped one."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def random_qwen2(vocab_size: int, seed: int = 0, **config: object) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **config,
    )
    return Qwen2ForCausalLM(cfg).eval()
