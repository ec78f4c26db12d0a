"""A small randomly initialised Qwen2 for tests that need a real HF causal LM but not the shipped one."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 32  # the vocabulary of `tiny_qwen2`
PAD = 0  # its pad token id


def random_qwen2(vocab_size: int, seed: int = 0, **config: Any) -> Qwen2ForCausalLM:
    """`config`: more Qwen2Config fields (attn_implementation, attention_dropout, token ids)."""
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


def tiny_qwen2(attn_implementation: str) -> Qwen2ForCausalLM:
    """A random Qwen2 over `VOCAB` tokens with this attention implementation ("sdpa", "eager")."""
    return random_qwen2(VOCAB, attn_implementation=attn_implementation)
