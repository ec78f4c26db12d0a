"""T7: the device is read at most twice per decode step and per micro-batch.

Counted with `support.syncs.HostSyncCounter` (every `item`, `tolist`, `__bool__`, `nonzero`, ...
made in the calling thread). The hf engine's `generate` with 32 prompts once made 35.2 reads per
decode step (a `nonzero` per prompt's generator, `bool(done.any())`, transformers' padding check
per forward); `train_step` made 4 per micro-batch (the loss, its token count, the statistics).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from relayrl.backends.local.generation import SamplingParams
from relayrl.backends.local.sampler import SamplerCompute
from relayrl.types import Prompt, SampleRequest
from support.modelutil import random_qwen2
from support.syncs import HostSyncCounter

torch.set_num_threads(1)

VOCAB, PAD = 64, 0
NEVER_EOS = 999  # an EOS id the model cannot draw: every row runs its budget, and EOS is checked every step
PROMPTS, SAMPLES, NEW_TOKENS = 32, 16, 32


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD} | {f"t{i}": i for i in range(1, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")


def _requests() -> list[SampleRequest]:
    return [
        SampleRequest(
            group_id=i,
            prompt=Prompt(f"p{i}", "", ""),
            prompt_tokens=[2 + (7 * i + j) % 60 for j in range(3 + i % 5)],  # lengths 3..7: left padding
            num_samples=SAMPLES,
            rng_key=f"0:p{i}",
        )
        for i in range(PROMPTS)
    ]


def test_decode_host_syncs_per_step() -> None:
    model = random_qwen2(VOCAB, 0, pad_token_id=PAD)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, eos_token_ids=(NEVER_EOS,))
    compute = SamplerCompute(model, _tokenizer(), params, seed=1)
    compute.generate(_requests()[:2])  # warm-up (lazy imports, first-call paths)
    with HostSyncCounter() as counter:
        results = compute.generate(_requests())
    assert sum(len(c.tokens) for r in results for c in r.completions) == PROMPTS * SAMPLES * NEW_TOKENS  # it decoded
    per_step = counter.total / NEW_TOKENS
    assert per_step <= 2, f"{per_step:.2f} host syncs per decode step: {dict(counter.counts)}"


def test_train_step_host_syncs_per_microbatch() -> None:
    from relayrl.algorithms.losses import LossConfig
    from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
    from relayrl.bench.trainer import _steps

    model = random_qwen2(VOCAB, 0, pad_token_id=PAD)
    compute = TrainerCompute(model, TrainerSettings(learning_rate=1e-4, total_steps=4, loss=LossConfig()))
    steps = _steps(VOCAB, 2, 3, 96)
    for tb in steps[0]:  # warm-up step
        compute.train_step(tb)
    compute.optim_step()
    with HostSyncCounter() as counter:
        for tb in steps[1]:
            compute.train_step(tb)
    per_microbatch = counter.total / len(steps[1])
    assert per_microbatch <= 2, f"{per_microbatch:.2f} host syncs per micro-batch: {dict(counter.counts)}"
    assert compute.optim_step() == 2  # the step still trains and reports
    metrics = compute.metrics()
    assert metrics and all(v == v for v in metrics.values() if isinstance(v, float))
