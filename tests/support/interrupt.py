"""Forcing a weight load in the middle of a generation without timing (rollout.interruptible),
and the log-probs such an interrupted generation must give.

`load_after_pass` makes a `SamplerCompute`'s model start a load (in another thread) during its
forward pass number `after`, and lets that pass end only once the load waits at the weight gate:
the load lands exactly after that pass, so the tokens sampled from pass `after` on come from the
new weights."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2ForCausalLM

from relayrl.backends.local.generation import _cache_kwarg
from relayrl.backends.local.sampler import SamplerCompute
from relayrl.types import Weights
from support.modelutil import random_qwen2

VOCAB, PAD, EOS = 32, 0, 1
PROMPT = [5, 6, 7, 8]
NEW_TOKENS = 10
SWAP_AFTER = 4  # forward passes with the old weights: the prefill and 3 decode steps -> tokens 0..3


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Words t2..t31 are token ids 2..31 (so a prompt's text is its ids)."""
    vocab = {"<pad>": PAD, "<eos>": EOS} | {f"t{i}": i for i in range(2, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def qwen2(seed: int) -> Qwen2ForCausalLM:
    """A random Qwen2 over that vocabulary."""
    return random_qwen2(VOCAB, seed, tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=PAD)


def load_after_pass(compute: SamplerCompute, weights: Weights, after: int) -> list[threading.Thread]:
    """Make `compute`'s model start loading `weights` (in another thread) during its forward pass
    number `after`, and let that pass end only once the load waits at the gate."""
    model = compute.model
    forward: Callable[..., Any] = model.forward
    calls = [0]
    started: list[threading.Thread] = []

    @functools.wraps(forward)  # keeps its signature: the sampler reads its cache argument's name from it
    def counted(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        calls[0] += 1
        if calls[0] == after:
            loader = threading.Thread(target=compute.load_weights, args=(weights,))
            loader.start()
            started.append(loader)
            while not compute.gate.load_pending:  # the load is queued behind this pass: no later pass starts first
                time.sleep(0.001)
        return out

    model.forward = counted
    return started


def interrupted_logprobs(old: PreTrainedModel, new: PreTrainedModel, sequence: list[int], fed_by_old: int, first: int) -> list[float]:
    """Log-probs of `sequence[first:]` when its first `fed_by_old` tokens were fed (their keys and
    values computed) by `old` and every later one by `new`, over that cache: the new weights'
    log-probs with the old ones' context, what an interrupted generation computes."""
    seq = torch.tensor([sequence])
    with torch.inference_mode():
        cache = old(input_ids=seq[:, :fed_by_old], use_cache=True).past_key_values
        tail = new(input_ids=seq[:, fed_by_old:-1], use_cache=True, **{_cache_kwarg(old): cache}).logits[0].double()
        logp = torch.log_softmax(tail, dim=-1)
        return [logp[i - 1 - fed_by_old, sequence[i]].item() for i in range(first, len(sequence))]


def reread_logprobs(model: PreTrainedModel, sequence: list[int], first: int) -> list[float]:
    """Log-probs of `sequence[first:]` under `model` reading the whole sequence."""
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([sequence])).logits[0].double(), dim=-1)
    return [logp[i - 1, sequence[i]].item() for i in range(first, len(sequence))]
