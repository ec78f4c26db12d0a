"""The vLLM sampler on the shipped tiny model, on ONE engine shared by the module (start-up is
~30 s): log-probs in the trainer's convention, in-place weight loads (tied embeddings), seeds,
multi-turn through the prefix cache, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.backends.vllm.engine import EngineSettings
from relayrl.backends.vllm.sampler import VllmSampler
from relayrl.models.loading import shipped_model_dir
from relayrl.types import SampleRequest, TurnRequest, Weights
from support.threadloop import Loop, thread_loop

TEMPERATURE = 0.7
loop = pytest.fixture(scope="module", name="loop")(thread_loop)


@pytest.fixture(scope="module")
def sampler(loop: Loop) -> Iterator[VllmSampler]:
    settings = EngineSettings(model=str(shipped_model_dir()), max_model_len=128)

    async def start() -> VllmSampler:
        return VllmSampler(settings, temperature=TEMPERATURE, max_new_tokens=8, seed=0)

    s = loop.run(start())
    yield s
    loop.run(s.close())


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(shipped_model_dir())


def _model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(shipped_model_dir(), dtype=torch.float32).eval()


def _prompt(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _torch_logprobs(model: PreTrainedModel, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def _prompt_logprobs(loop: Loop, sampler: VllmSampler, prompt: list[int]) -> list[float]:
    """The engine's log-probs of the prompt's tokens 1.. (temperature 1)."""
    from vllm import SamplingParams

    async def run() -> list[float]:
        final = None
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        async for out in sampler.engine.generate({"prompt_token_ids": prompt}, params, f"probe-{len(prompt)}-{id(params)}"):
            final = out
        assert final is not None and final.prompt_logprobs is not None
        return [float(step[t].logprob) for t, step in zip(prompt[1:], final.prompt_logprobs[1:], strict=True)]

    return loop.run(run())


def _perturbed(model: PreTrainedModel, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.state_dict()  # tied: lm_head.weight is embed_tokens.weight


def _request(tokens: list[int], group: int, n: int = 4) -> SampleRequest:
    return SampleRequest(group_id=group, prompt=None, prompt_tokens=tokens, num_samples=n)  # type: ignore[arg-type]


def test_sampled_logprobs_are_the_trainers_at_the_temperature(loop: Loop, sampler: VllmSampler, tokenizer: Any) -> None:
    model = _model()
    prompt = _prompt(tokenizer, "23+9=")
    (result,) = loop.run(sampler.generate([_request(prompt, 0, n=8)]))
    assert result.policy_version == sampler.version and len(result.completions) == 8
    for c in result.completions:
        assert len(c.logprobs) == len(c.tokens) > 0
        ref = _torch_logprobs(model, prompt, c.tokens, TEMPERATURE)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)) < 1e-4
        assert c.finish_reason in ("stop", "length")


def test_a_weight_load_changes_every_weight_the_tied_head_included(loop: Loop, sampler: VllmSampler, tokenizer: Any) -> None:
    """After a load, the engine's prompt log-probs equal a torch forward of the new weights (the
    shipped model ties its LM head to the embedding, which vLLM's CPU reload alone leaves old)."""
    prompt = _prompt(tokenizer, "47-18=29") + [tokenizer.eos_token_id]
    model = _model()
    before = _prompt_logprobs(loop, sampler, prompt)
    state = _perturbed(model, seed=1)
    loop.run(sampler.load_weights(Weights(version=sampler.version + 1, payload=state)))
    after = _prompt_logprobs(loop, sampler, prompt)
    ref = _torch_logprobs(model, prompt[:1], prompt[1:], 1.0)
    assert max(abs(a - b) for a, b in zip(before, ref, strict=True)) > 1e-2  # the load changed them
    assert max(abs(a - b) for a, b in zip(after, ref, strict=True)) < 1e-4
    (result,) = loop.run(sampler.generate([_request(prompt[:6], 5)]))
    assert result.policy_version == sampler.version
    for c in result.completions:
        ref = _torch_logprobs(model, prompt[:6], c.tokens, TEMPERATURE)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)) < 1e-4


def test_a_payload_that_does_not_match_is_refused_before_the_engine_sees_it(loop: Loop, sampler: VllmSampler) -> None:
    state = dict(_model().state_dict())
    state["model.norm.weight"] = torch.ones(3)
    version = sampler.version
    with pytest.raises(ValueError, match=r"wrong shape \['model.norm.weight'\]"):
        loop.run(sampler.load_weights(Weights(version=version + 1, payload=state)))
    assert sampler.version == version
    loop.run(sampler.generate([_request([5, 6], 0, n=1)]))  # the engine is alive


def test_samples_depend_on_the_seed_key_and_version_only(loop: Loop, sampler: VllmSampler, tokenizer: Any) -> None:
    prompt = _prompt(tokenizer, "12+34=")
    alone = loop.run(sampler.generate([_request(prompt, 7, n=8)]))[0]
    crowded = loop.run(sampler.generate([_request(prompt, 3, n=8), _request(prompt, 7, n=8), _request(prompt, 9, n=8)]))
    assert [c.tokens for c in crowded[1].completions] == [c.tokens for c in alone.completions]
    assert [c.tokens for c in crowded[0].completions] != [c.tokens for c in alone.completions]


def test_multi_turn_reuses_the_prefix_cache_and_a_load_resets_it(loop: Loop, sampler: VllmSampler) -> None:
    context = [5 + (i % 60) for i in range(70)]  # two full 32-token blocks and more
    loop.run(sampler.generate_turns([TurnRequest("e", context, "k", 4)]))
    model = _model()
    loop.run(sampler.load_weights(Weights(version=sampler.version + 1, payload=_perturbed(model, seed=2))))
    first = loop.run(sampler.generate_turns([TurnRequest("e", context, "k", 4)]))[0]
    assert first.cached_tokens == 0 and first.policy_version == sampler.version  # no KV of the old weights
    longer = context + first.completion.tokens + [7, 8]
    again = loop.run(sampler.generate_turns([TurnRequest("e", longer, "k2", 4)]))[0]
    assert again.cached_tokens >= 64
    for tokens, turn in ((context, first), (longer, again)):
        ref = _torch_logprobs(model, tokens, turn.completion.tokens, TEMPERATURE)
        assert max(abs(a - b) for a, b in zip(turn.completion.logprobs, ref, strict=True)) < 1e-4


def test_a_call_larger_than_one_engine_step_samples_what_each_request_samples_alone(loop: Loop, sampler: VllmSampler) -> None:
    """100 distinct 30-token contexts (3,000 tokens, more than one engine step's 2,048): no
    prefill is split (a split seeded request killed the CPU engine) and each turn samples what it
    samples alone."""
    requests = [TurnRequest(f"big-{i}", [5 + (i * 7 + j) % 70 for j in range(30)], f"r{i}", 4) for i in range(100)]
    together = loop.run(sampler.generate_turns(requests))
    alone = [loop.run(sampler.generate_turns([r]))[0] for r in requests[:3]]
    assert [t.completion.tokens for t in together[:3]] == [t.completion.tokens for t in alone]


def test_a_cancelled_generate_aborts_its_requests(loop: Loop, sampler: VllmSampler) -> None:
    from vllm import SamplingParams

    engine = sampler.engine
    params = SamplingParams(n=8, max_tokens=100, ignore_eos=True, temperature=1.0, logprobs=0, seed=1)

    async def cancel_while_running() -> int:
        task = asyncio.ensure_future(sampler._run([([5, 6, 7], params)] * 16))
        while engine.output_processor.get_num_unfinished_requests() == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return int(engine.output_processor.get_num_unfinished_requests())

    assert loop.run(cancel_while_running()) == 0
    (result,) = loop.run(sampler.generate([_request([5, 6], 0, n=2)]))  # still serves
    assert len(result.completions) == 2


class _Long(VllmSampler):
    """Generations that never stop before max_new_tokens (EOS ignored), so a load lands inside."""

    def _params(self, n: int, max_tokens: int, seed: int | None, *, greedy: bool = False) -> Any:
        params = super()._params(n, max_tokens, seed, greedy=greedy)
        params.ignore_eos = True
        return params


def test_an_interruptible_load_lands_mid_generation_and_the_later_tokens_are_the_new_versions(
    loop: Loop, sampler: VllmSampler, tokenizer: Any
) -> None:
    """rollout.interruptible on the vLLM engine (last in the module: it leaves its own weights
    loaded): a load while 4 samples of 100 tokens run does not wait for them; each completion
    carries two versions, the tokens before the swap have the old weights' log-probs and those
    after it the new weights' over the whole prefix (an HF forward); a call after the load is
    all the new version's."""
    old_model, new_model = _model(), _model()
    old_state, new_state = _perturbed(old_model, seed=3), _perturbed(new_model, seed=4)
    engine = sampler.engine
    v0 = sampler.version + 10
    long = _Long(sampler.settings, temperature=TEMPERATURE, max_new_tokens=100, seed=0, engine=engine, interruptible=True)
    loop.run(long.load_weights(Weights(version=v0, payload=old_state)))  # nothing running: a plain load
    prompt = _prompt(tokenizer, "23+9=")

    async def load_mid_generation() -> tuple[Any, bool]:
        task = asyncio.ensure_future(long.generate([_request(prompt, 0, n=4)]))
        states = engine.output_processor.request_states
        while not any(s.detokenizer is not None and s.detokenizer.num_output_tokens() >= 2 for s in states.values()):
            await asyncio.sleep(0.005)  # until the requests have sampled tokens with v0
        await long.load_weights(Weights(version=v0 + 1, payload=new_state))
        running = not task.done()
        return await task, running

    (result,), running = loop.run(load_mid_generation())
    assert running  # the load did not wait for the generation
    assert result.policy_version == v0 and long.version == v0 + 1
    for c in result.completions:
        assert len(c.tokens) == len(c.logprobs) == 100
        assert c.versions is not None and [v for _, v in c.versions] == [v0, v0 + 1], c.versions
        split = c.versions[1][0]
        assert 2 <= split < 100
        old = _torch_logprobs(old_model, prompt, c.tokens, TEMPERATURE)
        new = _torch_logprobs(new_model, prompt, c.tokens, TEMPERATURE)
        assert max(abs(a - b) for a, b in zip(c.logprobs[:split], old[:split], strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(c.logprobs[split:], new[split:], strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(old[split:], new[split:], strict=True)) > 1e-2  # the swap changed them

    (after,) = loop.run(long.generate([_request(prompt, 1, n=2)]))
    assert after.policy_version == v0 + 1 and all(c.versions is None for c in after.completions)

    # a load from another event loop (a Ray actor serves loads on its `load` group's own loop)
    # runs on the replica's loop
    asyncio.run(asyncio.wait_for(long.load_weights(Weights(version=v0 + 2, payload=old_state)), 120))
    (again,) = loop.run(long.generate([_request(prompt, 2, n=1)]))
    assert again.policy_version == v0 + 2 and long.version == v0 + 2
