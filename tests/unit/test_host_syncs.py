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


def test_batched_draws_give_the_old_loops_tokens() -> None:
    """The same generator states give the same tokens and log-probs as the old decode loop (one
    `multinomial` per prompt), with per-prompt generators, top-p, prompts sharing a prefill, a
    prompt with no sample, and rows stopping at EOS (pruned from the batch)."""
    from relayrl.backends.local.generation import sample
    from relayrl.bench.legacy_decode import legacy_sample

    model = random_qwen2(32, 0, pad_token_id=PAD)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [16], [17, 18, 19], [5, 6, 7]]
    for top_p, eos in ((1.0, (1, 2)), (0.8, (1,))):
        params = SamplingParams(temperature=0.9, top_p=top_p, max_new_tokens=20, eos_token_ids=eos)
        for per_prompt in (True, False):
            runs = []
            for fn in (sample, legacy_sample):
                gens = [torch.Generator().manual_seed(10 + i) for i in range(len(prompts))] if per_prompt else None
                out = fn(model, prompts, [3, 4, 2, 0, 5], params, torch.Generator().manual_seed(3), generators=gens)
                runs.append([[(s.tokens, s.logprobs, s.finish_reason) for s in group] for group in out])
            assert runs[0] == runs[1]
            assert any(s[2] == "stop" for group in runs[0] for s in group)  # rows stopped early


def test_preallocated_cache_writes_in_place() -> None:
    """A decode step writes its own keys and values into buffers kept across steps (on the CPU
    they start small and double: a handful of buffers over a generation, where concatenation makes
    one per step), the views read what concatenation would, a row selection keeps them, and a
    call that outgrows the capacity grows."""
    from relayrl.backends.local.generation import _layer_kv, _new_cache

    model = random_qwen2(32, 0)
    cache = _new_cache(model, capacity=20)
    layers = len(model.model.layers)
    gen = torch.Generator().manual_seed(0)
    written: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    buffers: set[int] = set()
    for new in [4] + [1] * 16:  # a 4-token prefill, 16 decode steps: 20 tokens, the capacity
        for layer in range(layers):
            k = torch.randn((3, 2, new, 16), generator=gen)
            keys, values = cache.update(k, -k, layer)
            written[layer].append(k)
            expected = torch.cat(written[layer], dim=-2)
            assert torch.equal(keys, expected) and torch.equal(values, -expected)
            if layer == 0:
                buffers.add(keys.data_ptr())
    assert len(buffers) <= 3  # 5, 10, 20 tokens
    assert cache.get_seq_length() == 20
    cache.batch_select_indices(torch.tensor([2, 0]))
    for layer, (keys, values) in enumerate(_layer_kv(cache)):
        expected = torch.cat(written[layer], dim=-2)[[2, 0]]
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
    k = torch.randn((2, 2, 1, 16), generator=gen)
    keys, _ = cache.update(k, k, 0)
    assert torch.equal(keys[..., -1:, :], k) and keys.shape[-2] == 21


def test_a_later_update_reads_each_micro_batch_once() -> None:
    """With several updates per step (`train.ppo_epochs` = 2), the second pass trains the kept
    micro-batches inside `optim_step`: one read per micro-batch (its loss, statistics and `ppo_kl`
    together; `ppo_kl` used to be read by a `float()` of its own) and one per update (the gradient
    norm). (AdamW's per-parameter `item` on the CPU is the optimizer's, not counted here.)"""
    from relayrl.algorithms.losses import LossConfig
    from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
    from relayrl.bench.trainer import _steps

    model = random_qwen2(VOCAB, 0, pad_token_id=PAD)
    compute = TrainerCompute(model, TrainerSettings(learning_rate=1e-4, total_steps=4, loss=LossConfig(), ppo_epochs=2))
    steps = _steps(VOCAB, 2, 3, 96)
    for tb in steps[0]:  # warm-up step
        compute.train_step(tb)
    compute.optim_step()
    for tb in steps[1]:
        compute.train_step(tb)
    with HostSyncCounter() as counter:
        assert compute.optim_step() == 2
    reads = counter.counts["tolist"] + counter.counts["__float__"]
    assert reads <= len(steps[1]) + 2, f"{reads} reads for {len(steps[1])} micro-batches and 2 updates: {dict(counter.counts)}"
    assert compute.metrics()["ppo_kl"] >= 0.0
