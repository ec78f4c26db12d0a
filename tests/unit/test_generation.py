"""Batched KV-cache sampling and the in-process sampler.

The key check: every log-prob the sampler reports equals a teacher-forced forward pass over
prompt + completion under the same sampling distribution (temperature, top-p renormalisation),
including after finished rows were pruned from the batch and with left-padded prompts.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from relayrl.backends.local.generation import SampledSequence, SamplingParams, sample
from relayrl.backends.local.sampler import LocalSampler
from relayrl.types import Prompt, SampleRequest, Weights
from support.modelutil import random_qwen2

torch.set_num_threads(1)

VOCAB = 32
PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16], [17, 18, 19, 20, 21]]


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    return random_qwen2(VOCAB, seed, tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=PAD)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD, "<eos>": EOS} | {f"t{i}": i for i in range(2, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return tiny_qwen2()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Reference log-probs of the distribution tokens are drawn from (the top-p nucleus,
    renormalised), written independently of the code."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    out = torch.full_like(logp, float("-inf"))
    for row in range(logp.shape[0]):
        probs = logp[row].exp()
        kept, mass = [], 0.0
        for token in probs.argsort(descending=True).tolist():
            kept.append(token)
            mass += float(probs[token])
            if mass >= top_p:
                break
        kept_t = torch.tensor(kept)
        out[row, kept_t] = logp[row, kept_t] - torch.logsumexp(logp[row, kept_t], dim=0)
    return out


def teacher_forced(model: Qwen2ForCausalLM, prompt: list[int], seq: SampledSequence, temperature: float, top_p: float = 1) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + seq.tokens])).logits[0]
    ref = nucleus_logprobs(logits[len(prompt) - 1 : -1], temperature, top_p)
    return ref.gather(-1, torch.tensor(seq.tokens)[:, None]).squeeze(-1)


def test_shared_prefill_matches_repeated_prefill(model: Qwen2ForCausalLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=8, eos_token_ids=(EOS, 2, 3))
    shared = sample(model, PROMPTS, 4, params, gen(7))
    repeated = sample(model, PROMPTS, 4, params, gen(7), share_prefill=False)
    for group_a, group_b in zip(shared, repeated, strict=True):
        assert len(group_a) == 4
        for a, b in zip(group_a, group_b, strict=True):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_logprobs_match_teacher_forced_forward(model: Qwen2ForCausalLM, temperature: float, top_p: float) -> None:
    # Many EOS ids: rows finish at different steps, so the batch is pruned mid-generation.
    eos = (EOS, 2, 3, 4)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=10, eos_token_ids=eos)
    groups = sample(model, PROMPTS, [3, 5, 2, 4], params, gen(1))
    assert [len(g) for g in groups] == [3, 5, 2, 4]
    finished_early = 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for seq in group:
            assert len(seq.tokens) == len(seq.logprobs) >= 1
            # reported under the policy's full softmax (what the trainer scores), whatever top_p
            expected = teacher_forced(model, prompt, seq, temperature)
            assert torch.allclose(torch.tensor(seq.logprobs, dtype=torch.float64), expected, atol=1e-4)
            # and drawn from the nucleus: every token lies inside it
            assert torch.isfinite(teacher_forced(model, prompt, seq, temperature, top_p)).all()
            finished_early += len(seq.tokens) < params.max_new_tokens
    assert finished_early >= 2  # the pruning path was exercised


def test_eos_stops_a_sequence(model: Qwen2ForCausalLM) -> None:
    eos = (EOS, 2, 3, 4, 5)
    params = SamplingParams(max_new_tokens=12, eos_token_ids=eos)
    groups = sample(model, PROMPTS, 6, params, gen(3))
    seqs = [s for g in groups for s in g]
    for seq in seqs:
        assert not any(t in eos for t in seq.tokens[:-1])  # nothing follows an EOS
        if seq.tokens[-1] in eos:
            assert seq.finish_reason == "stop"
        else:
            assert seq.finish_reason == "length" and len(seq.tokens) == params.max_new_tokens
    assert any(s.finish_reason == "stop" for s in seqs)
    assert any(s.finish_reason == "stop" and len(s.tokens) < params.max_new_tokens for s in seqs)


def test_tiny_top_p_equals_greedy(model: Qwen2ForCausalLM) -> None:
    greedy = sample(model, PROMPTS, 1, SamplingParams(greedy=True, max_new_tokens=8), None)
    nucleus = sample(model, PROMPTS, 3, SamplingParams(top_p=1e-6, max_new_tokens=8), gen(0))
    for g, group in zip(greedy, nucleus, strict=True):
        for seq in group:
            assert seq.tokens == g[0].tokens
            assert seq.logprobs == pytest.approx(g[0].logprobs, abs=1e-5)  # the policy's log-prob of the argmax
    # Greedy reports the argmax's log-prob under the plain softmax.
    for prompt, g in zip(PROMPTS, greedy, strict=True):
        expected = teacher_forced(model, prompt, g[0], 1.0, 1.0)
        assert torch.allclose(torch.tensor(g[0].logprobs, dtype=torch.float64), expected, atol=1e-4)


def test_left_padding_matches_batch_of_one(model: Qwen2ForCausalLM) -> None:
    params = SamplingParams(greedy=True, max_new_tokens=8)
    batch = sample(model, PROMPTS, 1, params, None)
    for prompt, group in zip(PROMPTS, batch, strict=True):
        alone = sample(model, [prompt], 1, params, None)[0][0]
        assert group[0].tokens == alone.tokens
        assert group[0].logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def requests(n: int = 2, g: int = 3) -> list[SampleRequest]:
    return [SampleRequest(group_id=i, prompt=Prompt(f"p{i}", "", ""), prompt_tokens=PROMPTS[i], num_samples=g) for i in range(n)]


def test_local_sampler_generates_off_the_loop_and_loads_weights() -> None:
    model, other = tiny_qwen2(0), tiny_qwen2(1)
    threads: set[str] = set()
    model.register_forward_pre_hook(lambda *_: threads.add(threading.current_thread().name))
    params = SamplingParams(max_new_tokens=6)  # EOS ids come from the tokenizer
    tokenizer = tiny_tokenizer()

    async def main() -> None:
        sampler = LocalSampler(model, tokenizer, params, replica=3, seed=11)
        twin = LocalSampler(tiny_qwen2(0), tokenizer, params, replica=3, seed=11)
        try:
            assert sampler.params.eos_token_ids == (EOS,)
            # A generate issued before a load samples with the old weights; the next one with new.
            payload = {k: v.clone() for k, v in other.state_dict().items() if k != "lm_head.weight"}
            before = asyncio.create_task(sampler.generate(requests()))
            load = asyncio.create_task(sampler.load_weights(Weights(version=5, payload=payload)))
            old = await before
            await load
            assert threads == {"relayrl-sampler-3_0"}
            assert sampler.compute.version == 5
            assert [r.policy_version for r in old] == [0, 0]
            assert [r.replica for r in old] == [3, 3]
            for i, result in enumerate(old):
                assert result.request.group_id == i and len(result.completions) == 3
                for c in result.completions:
                    assert len(c.tokens) == len(c.logprobs)
                    assert c.text == tokenizer.decode(c.tokens, skip_special_tokens=True)
                    assert "<eos>" not in c.text
            # Same seed and replica: same samples.
            same = await twin.generate(requests())
            assert [c.tokens for r in same for c in r.completions] == [c.tokens for r in old for c in r.completions]
            new = await sampler.generate(requests())
            assert [r.policy_version for r in new] == [5, 5]
            # Greedy evaluation now follows the loaded weights.
            greedy_params = SamplingParams(greedy=True, max_new_tokens=6, eos_token_ids=(EOS,))
            want = [s[0].tokens for s in sample(other, PROMPTS, 1, greedy_params, None)]
            assert await sampler.greedy(PROMPTS, 6) == want
            assert await twin.greedy(PROMPTS, 6) != want
            # A bad payload is refused before anything is copied.
            bad = dict(payload)
            bad["model.norm.weight"] = torch.ones(3)
            with pytest.raises(ValueError, match="wrong shape"):
                await sampler.load_weights(Weights(version=6, payload=bad))
            assert sampler.compute.version == 5
            assert await sampler.greedy(PROMPTS, 6) == want
        finally:
            await sampler.close()
            await twin.close()
        with pytest.raises(RuntimeError, match="closed"):
            await sampler.generate(requests())

    asyncio.run(main())


def test_cancelled_generate_leaves_no_work_running() -> None:
    model = tiny_qwen2(0)
    calls: list[float] = []
    started = threading.Event()

    def slow_forward(*_: object) -> None:
        calls.append(time.perf_counter())
        started.set()
        time.sleep(0.02)

    model.register_forward_pre_hook(slow_forward)
    params = SamplingParams(max_new_tokens=50, eos_token_ids=())

    async def main() -> None:
        sampler = LocalSampler(model, tiny_tokenizer(), params, replica=0)
        try:
            task = asyncio.create_task(sampler.generate(requests(1, 2)))
            await asyncio.to_thread(started.wait, 5.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            n = len(calls)
            await asyncio.sleep(0.1)
            assert len(calls) == n < 50  # stopped between decode steps, nothing runs after
        finally:
            await sampler.close()

    asyncio.run(main())


def test_per_prompt_generators_make_a_prompts_samples_independent_of_its_batch(model: Qwen2ForCausalLM) -> None:
    """With one generator per prompt, a prompt's samples depend on its generator's seed only: the
    same whether it is sampled alone or beside other prompts (which finish at other steps, so rows
    are pruned at other times), and different under another seed."""
    params = SamplingParams(temperature=1.0, max_new_tokens=10, eos_token_ids=(EOS, 2, 3, 4))
    together = sample(model, PROMPTS, [3, 5, 2, 4], params, None, generators=[gen(10 + i) for i in range(len(PROMPTS))])
    for i, prompt in enumerate(PROMPTS):
        alone = sample(model, [prompt], [[3, 5, 2, 4][i]], params, None, generators=[gen(10 + i)])[0]
        assert [s.tokens for s in alone] == [s.tokens for s in together[i]]
        assert [s.logprobs for s in alone] == [pytest.approx(s.logprobs, abs=1e-5) for s in together[i]]
    reseeded = sample(model, PROMPTS, [3, 5, 2, 4], params, None, generators=[gen(99 + i) for i in range(len(PROMPTS))])
    assert [[s.tokens for s in g] for g in reseeded] != [[s.tokens for s in g] for g in together]
