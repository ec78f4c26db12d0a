"""rollout.interruptible: a weight load lands between decode steps of a running generation.

A load is forced in the middle of a generation without timing: the model's forward pass, at a
chosen call, starts the load in another thread and returns only once the load waits at the gate,
so the load lands exactly after that pass. The sim's load is placed on its simulated tokens with
a fake clock.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

import pytest
import torch
from transformers import Qwen2ForCausalLM

import relayrl.backends.local.generation as generation
import relayrl.backends.sim.workers as sim_workers
from relayrl.backends.local.generation import SamplingParams, _cache_kwarg
from relayrl.backends.local.sampler import LocalSampler, SamplerCompute
from relayrl.backends.sim.build import sim_sampler
from relayrl.backends.sim.workers import SimSampler
from relayrl.config.schema import SimConfig, load_config
from relayrl.orchestrator.stages.collect import to_group
from relayrl.types import Prompt, SampleRequest, TurnRequest, Weights, token_versions
from support.interrupt import (
    NEW_TOKENS,
    PROMPT,
    SWAP_AFTER,
    interrupted_logprobs,
    load_after_pass,
    qwen2,
    reread_logprobs,
)
from support.interrupt import word_tokenizer as tokenizer

torch.set_num_threads(1)


def request(n: int = 2) -> SampleRequest:
    return SampleRequest(group_id=0, prompt=Prompt("p0", "t5 t6 t7 t8", "0"), prompt_tokens=list(PROMPT), num_samples=n, rng_key="0:p0")


def test_a_load_mid_generation_swaps_weights_between_decode_steps() -> None:
    old, new = qwen2(0), qwen2(1)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, eos_token_ids=(999,))  # no EOS: every row runs its budget
    compute = SamplerCompute(copy.deepcopy(old), tokenizer(), params, seed=3)
    loaders = load_after_pass(compute, Weights(version=1, payload=new.state_dict()), SWAP_AFTER)
    (result,) = compute.generate([request()])
    for loader in loaders:
        loader.join()
    assert compute.version == 1
    assert result.policy_version == 0  # the oldest token's version
    for completion in result.completions:
        assert len(completion.tokens) == NEW_TOKENS
        assert completion.versions == [(0, 0), (SWAP_AFTER, 1)]
        assert token_versions(completion.versions, NEW_TOKENS) == [0] * SWAP_AFTER + [1] * (NEW_TOKENS - SWAP_AFTER)
    group = to_group(result)
    assert group.min_version == 0
    assert [t.versions for t in group.trajectories] == [c.versions for c in result.completions]

    # each token's log-prob is the one of the weights that drew it: before the swap the old
    # model's on the whole prefix; after it the new model's, over the KV cache the old weights
    # computed for the tokens fed before the swap (the accepted approximation)
    cache_arg = _cache_kwarg(old)
    with torch.inference_mode():
        for completion in result.completions:
            seq = torch.tensor([PROMPT + completion.tokens])
            p = len(PROMPT)
            old_logp = torch.log_softmax(old(input_ids=seq).logits[0].double(), dim=-1)
            before = [old_logp[p + i - 1, completion.tokens[i]].item() for i in range(SWAP_AFTER)]
            assert completion.logprobs[:SWAP_AFTER] == pytest.approx(before, abs=1e-4)
            fed_before = p + SWAP_AFTER - 1  # the prompt, then tokens 0..SWAP_AFTER-2 fed by the old weights
            cache = old(input_ids=seq[:, :fed_before], use_cache=True).past_key_values
            tail = new(input_ids=seq[:, fed_before : p + NEW_TOKENS - 1], use_cache=True, **{cache_arg: cache}).logits[0].double()
            new_logp = torch.log_softmax(tail, dim=-1)
            after = [new_logp[i - SWAP_AFTER, completion.tokens[i]].item() for i in range(SWAP_AFTER, NEW_TOKENS)]
            assert completion.logprobs[SWAP_AFTER:] == pytest.approx(after, abs=1e-4)
            stale = [old_logp[p + i - 1, completion.tokens[i]].item() for i in range(SWAP_AFTER, NEW_TOKENS)]
            assert completion.logprobs[SWAP_AFTER:] != pytest.approx(stale, abs=1e-4)  # the swap changed them


def test_a_load_between_generations_leaves_versions_uniform() -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=4, eos_token_ids=(999,))
    compute = SamplerCompute(qwen2(0), tokenizer(), params)
    compute.load_weights(Weights(version=1, payload=qwen2(1).state_dict()))
    (result,) = compute.generate([request()])
    assert result.policy_version == 1
    assert all(c.versions is None for c in result.completions)


def test_local_sampler_load_does_not_wait_for_a_running_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    """With interruptible the load runs in its own thread: it returns while `generate` is held
    in the middle of its decode loop (without it, the load would queue behind the generate)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, eos_token_ids=(999,))
    sampler = LocalSampler(qwen2(0), tokenizer(), params, interruptible=True)
    in_decode, release = threading.Event(), threading.Event()
    calls = [0]
    pick = generation.pick_tokens

    def held(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:  # the third token's draw, between two forward passes (outside the gate)
            in_decode.set()
            release.wait(30)
        return pick(*args, **kwargs)

    monkeypatch.setattr(generation, "pick_tokens", held)

    async def main() -> None:
        generating = asyncio.create_task(sampler.generate([request(1)]))
        try:
            await asyncio.to_thread(in_decode.wait, 30)
            await asyncio.wait_for(sampler.load_weights(Weights(version=1, payload=qwen2(1).state_dict())), 30)
            assert not generating.done()  # the round got its load without waiting for the generation
        finally:
            release.set()
        (result,) = await generating
        assert result.policy_version == 0
        assert result.completions[0].versions is not None and result.completions[0].versions[-1][1] == 1
        await sampler.close()

    asyncio.run(main())


# -- multi-turn episodes (generate_turns) ------------------------------------------------------

OBSERVATION = [9, 10, 11]


def turn_compute(old: Qwen2ForCausalLM, interruptible: bool) -> SamplerCompute:
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, eos_token_ids=(999,))  # no EOS: every row runs its budget
    return SamplerCompute(copy.deepcopy(old), tokenizer(), params, seed=3, interruptible=interruptible)


def ask(episode: str, context: list[int], turn: int) -> TurnRequest:
    return TurnRequest(episode=episode, context=context, rng_key=f"{episode}/{turn}", max_new_tokens=NEW_TOKENS)


def test_a_load_mid_turn_gives_the_turn_both_versions_and_the_next_turn_continues_the_kept_cache() -> None:
    """rollout.interruptible in multi-turn episodes: a load lands between two decode steps of a
    turn (the turn records both versions, its result the oldest; the log-probs after the swap are
    the new weights' over the old weights' cache), and the episode's cache survives the load: the
    next turn reads only its new tokens, with the new weights, over keys and values the old ones
    computed (the accepted approximation), instead of re-reading its context."""
    old, new = qwen2(0), qwen2(1)
    compute = turn_compute(old, interruptible=True)
    loaders = load_after_pass(compute, Weights(version=1, payload=new.state_dict()), SWAP_AFTER)
    first = compute.generate_turns([ask("e0", PROMPT, 1), ask("e1", PROMPT, 1)])
    for loader in loaders:
        loader.join()
    assert compute.version == 1
    p = len(PROMPT)
    for result in first:
        c = result.completion
        assert len(c.tokens) == NEW_TOKENS
        assert result.policy_version == 0  # the oldest token's: the prefill's
        assert c.versions == [(0, 0), (SWAP_AFTER, 1)]
        sequence = PROMPT + c.tokens
        assert c.logprobs[:SWAP_AFTER] == pytest.approx(reread_logprobs(old, sequence, p)[:SWAP_AFTER], abs=1e-4)
        after = interrupted_logprobs(old, new, sequence, p + SWAP_AFTER - 1, p + SWAP_AFTER)
        assert c.logprobs[SWAP_AFTER:] == pytest.approx(after, abs=1e-4)
        assert c.logprobs[SWAP_AFTER:] != pytest.approx(reread_logprobs(old, sequence, p + SWAP_AFTER), abs=1e-4)
    assert sorted(compute.session_episodes) == ["e0", "e1"]  # the load did not drop them

    context = PROMPT + first[0].completion.tokens + OBSERVATION
    (second,) = compute.generate_turns([ask("e0", context, 2)])
    assert second.cached_tokens == p + NEW_TOKENS - 1  # continued its session, not re-read
    assert second.policy_version == 1 and second.completion.versions is None
    sequence = context + second.completion.tokens
    kept = interrupted_logprobs(old, new, sequence, p + SWAP_AFTER - 1, len(context))
    assert second.completion.logprobs == pytest.approx(kept, abs=1e-4)
    assert second.completion.logprobs != pytest.approx(reread_logprobs(new, sequence, len(context)), abs=1e-4)


@pytest.mark.parametrize("interruptible", [True, False])
def test_a_load_between_turns_keeps_sessions_only_when_interruptible(interruptible: bool) -> None:
    compute = turn_compute(qwen2(0), interruptible)
    (first,) = compute.generate_turns([ask("e0", PROMPT, 1)])
    compute.load_weights(Weights(version=1, payload=qwen2(1).state_dict()))
    (second,) = compute.generate_turns([ask("e0", PROMPT + first.completion.tokens + OBSERVATION, 2)])
    assert (first.policy_version, second.policy_version) == (0, 1)
    assert second.cached_tokens == (len(PROMPT) + NEW_TOKENS - 1 if interruptible else 0)  # without: re-read, as before
    assert first.completion.versions is None and second.completion.versions is None


def sim(interruptible: bool) -> SimSampler:
    cfg = SimConfig(generate_base=0.0, generate_per_request=0.0, generate_per_token=1.0, length_dist="uniform")
    return SimSampler(cfg, max_new_tokens=16, seed=1, interruptible=interruptible)


@pytest.mark.parametrize("interruptible", [True, False])
def test_sim_sampler_tokens_after_a_load_carry_the_new_version(interruptible: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = sim(interruptible)
    now = [100.0]
    sampler.clock = lambda: now[0]

    async def main() -> None:
        asleep, woken = asyncio.Event(), asyncio.Event()

        async def fake_sleep(seconds: float) -> None:
            asleep.set()
            await woken.wait()

        monkeypatch.setattr(sim_workers, "_sleep", fake_sleep)
        generating = asyncio.create_task(sampler.generate([request(8)]))
        await asleep.wait()
        now[0] = 103.5  # 3.5 simulated tokens after the call started: tokens 4 on are the new version's
        await sampler.load_weights(Weights(version=1, payload=1))
        woken.set()
        (result,) = await generating
        assert result.policy_version == 0
        long = [c for c in result.completions if len(c.tokens) > 4]
        assert long, "the seed should draw completions longer than 4 tokens"
        for c in result.completions:
            if interruptible and len(c.tokens) > 4:
                assert c.versions == [(0, 0), (4, 1)]
            else:
                assert c.versions is None

    asyncio.run(main())


def test_interruptible_has_no_effect_at_staleness_0() -> None:
    on = load_config(None, ["rollout.interruptible=true", "rollout.max_staleness=1"])
    off = load_config(None, ["rollout.interruptible=true", "rollout.max_staleness=0"])
    assert on.rollout.interrupts and not off.rollout.interrupts
    assert sim_sampler(on, 0)._interruptible and not sim_sampler(off, 0)._interruptible


def test_interruptible_is_accepted_with_the_vllm_engine_and_with_environments() -> None:
    cfg = load_config(None, ["rollout.interruptible=true", "rollout.max_staleness=1", "run.backend=local", "rollout.engine=vllm"])
    assert cfg.rollout.interrupts
    cfg = load_config(None, ["rollout.interruptible=true", "rollout.max_staleness=1", "task.environment=arithmetic_feedback"])
    assert cfg.rollout.interrupts


def test_bench_printout_puts_waiting_and_interruptible_rounds_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    from relayrl.cli.main import _print_interruptible

    def run(mean: float, busy: float) -> dict[str, float]:
        return {"sync_round_mean_s": mean, "sync_round_max_s": 2 * mean, "trainer_busy": busy, "staleness_mean": 0.9, "staleness_max": 1.0}

    figures: dict[str, object] = {
        "max_staleness_1": run(1.1, 0.87),
        "max_staleness_1_interruptible": run(0.05, 0.96),
        "max_staleness_2": run(1.2, 0.98),
        "max_staleness_2_interruptible": run(0.2, 0.99),
        "oldest_token_bound": {"1": 0.888, "2": 1.0},
    }
    _print_interruptible(figures)
    printed = capsys.readouterr().out
    assert "waiting" in printed and "interruptible" in printed
    assert "round mean 1.100 s, max 2.200 s, busy 87.0%" in printed and "round mean 0.050 s, max 0.100 s, busy 96.0%" in printed
    assert "sync round mean (worst max_staleness): 0.200 s (target <= 0.1 s)  MISSED" in printed
    assert "trainer busy at max_staleness 1: 96.0% (target >= 95%)  ok" in printed
    assert "oldest token's: 88.8% at max_staleness 1, 100.0% at max_staleness 2" in printed
