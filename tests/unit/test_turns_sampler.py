"""Multi-turn sampling on the shipped tiny model: one policy turn per episode per call, each
episode's KV cache kept between calls (`SamplerCompute.generate_turns`, `sample_turns`).

The key checks: continuing an episode's cache samples what re-reading its whole context would,
and every action token's log-prob equals a single teacher-forced forward pass over the final
sequence (what the trainer scores). Then the session rules: which requests may continue a cache,
weight loads, LRU eviction, `end_episodes`, and abort.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from relayrl.backends.local import generation
from relayrl.backends.local.generation import (
    SamplingAborted,
    SamplingParams,
    TurnInput,
    TurnStats,
    _cache_kwarg,
    sample,
    sample_turns,
    supports_row_caches,
)
from relayrl.backends.local.sampler import LocalSampler, SamplerCompute
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.types import TurnRequest, TurnResult, Weights

torch.set_num_threads(1)

TEMPERATURE = 1.0
# Prompts of different lengths; g0 is a group (identical first-turn contexts). Ten episodes, so
# a row that stops early first rides along (attention 0) before the batch is pruned.
PROMPTS = {
    **{f"g0/{i}": [5, 6, 14, 11, 18] for i in range(5)},
    "g1/0": [50, 37, 51, 53, 44, 52, 26, 5, 13, 23, 46, 37, 56, 52, 7, 16, 8, 18],
    "g2/0": [9, 13, 18],
    "g2/1": [9, 13, 18],
    "g4/0": [6, 6, 14, 8, 18],
    "g3/0": [7, 8, 15, 9, 9, 18],  # starts one turn late: its first turn rides with the others' second
}
START = {"g3/0": 1}
MAX_NEW = {"g0/0": 2, "g0/1": 3, "g0/2": 8, "g0/3": 1, "g0/4": 8, "g1/0": 5, "g2/0": 8, "g2/1": 2, "g4/0": 8, "g3/0": 4}


@pytest.fixture(scope="module")
def loaded() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_model_and_tokenizer(shipped_model_dir())


def compute(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase], **kwargs: Any) -> SamplerCompute:
    model, tokenizer = loaded
    return SamplerCompute(model, tokenizer, SamplingParams(temperature=TEMPERATURE, max_new_tokens=8), seed=3, **kwargs)


def observation(episode: str, turn: int) -> list[int]:
    """What the environment answers after a turn: a few tokens, different per episode and turn."""
    return [50, 37 + turn, 5 + len(episode) % 3 + turn, 18][: 2 + turn]


@dataclass(slots=True)
class Episodes:
    """Runs episodes turn by turn on one compute, keeping every context and result."""

    compute: SamplerCompute
    contexts: dict[str, list[int]] = field(default_factory=lambda: {e: list(p) for e, p in PROMPTS.items()})
    actions: dict[str, list[tuple[int, list[int], list[float]]]] = field(default_factory=lambda: {e: [] for e in PROMPTS})
    results: list[list[TurnResult]] = field(default_factory=list)

    def turn(self, turn: int, before: Callable[[list[str]], None] | None = None) -> list[TurnResult]:
        live = [e for e in PROMPTS if START.get(e, 0) <= turn]
        if before is not None:
            before(live)
        asks = [TurnRequest(episode=e, context=list(self.contexts[e]), rng_key=f"{e}/{turn}", max_new_tokens=MAX_NEW[e]) for e in live]
        results = self.compute.generate_turns(asks)
        for ask, result in zip(asks, results, strict=True):
            assert result.episode == ask.episode
            tokens = result.completion.tokens
            self.actions[ask.episode].append((len(ask.context), tokens, result.completion.logprobs))
            self.contexts[ask.episode] = ask.context + tokens + observation(ask.episode, turn)
        self.results.append(results)
        return results


@pytest.mark.parametrize("prune", [True, False])
def test_continuing_the_cache_samples_what_re_reading_would(
    loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase], prune: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not prune:  # stopped rows ride along to the end of the call, their later columns masked
        monkeypatch.setattr(generation, "_PRUNE_FRACTION", 0)
    cached = Episodes(compute(loaded))
    reread = Episodes(compute(loaded, max_sessions=0))
    ended = Episodes(compute(loaded))  # end_episodes before every turn: every turn re-reads
    for turn in range(3):
        cached.turn(turn)
        reread.turn(turn)
        ended.turn(turn, before=ended.compute.end_episodes)
    for run in (reread, ended):
        for a_turn, b_turn in zip(cached.results, run.results, strict=True):
            for a, b in zip(a_turn, b_turn, strict=True):
                assert a.completion.tokens == b.completion.tokens
                assert a.completion.finish_reason == b.completion.finish_reason
                assert a.completion.text == b.completion.text
                assert a.completion.logprobs == pytest.approx(b.completion.logprobs, abs=1e-4)
                assert b.cached_tokens == 0
    # The session run reads from cache exactly what the episode fed on its previous turn.
    for turn, results in enumerate(cached.results):
        for result in results:
            history = cached.actions[result.episode]
            first = turn == START.get(result.episode, 0)
            if first:
                assert result.cached_tokens == 0
            else:
                context_len, tokens, _ = history[turn - START.get(result.episode, 0) - 1]
                assert result.cached_tokens == context_len + len(tokens) - 1 > 0
    reasons = [r.completion.finish_reason for results in cached.results for r in results]
    assert "stop" in reasons and "length" in reasons
    stats = cached.compute.turn_stats
    assert stats.cached_tokens > stats.computed_tokens  # most context came from the caches
    assert reread.compute.turn_stats.cached_tokens == 0 and reread.compute.session_episodes == []


def test_action_logprobs_match_one_forward_over_the_whole_episode(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, _ = loaded
    run = Episodes(compute(loaded))
    for turn in range(3):
        run.turn(turn)
    checked = 0
    for episode, actions in run.actions.items():
        context_len, tokens, logprobs = actions[-1]
        sequence = run.contexts[episode][: context_len + len(tokens)]  # the last observation dropped
        with torch.inference_mode():
            logits = model(torch.tensor([sequence])).logits[0]
        logp = torch.log_softmax(logits.double() / TEMPERATURE, dim=-1)
        for start, action, action_logprobs in actions:
            assert sequence[start : start + len(action)] == action
            expected = logp[start - 1 : start - 1 + len(action)].gather(-1, torch.tensor(action)[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(action_logprobs, dtype=torch.float64), expected, atol=1e-4)
            checked += len(action)
    assert checked >= 15


def count_forwards(model: PreTrainedModel) -> tuple[list[tuple[int, int]], Callable[[], None]]:
    """Record the input_ids shape of every forward call; returns (shapes, undo)."""
    shapes: list[tuple[int, int]] = []
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(kwargs["input_ids"].shape))
        return original(*args, **kwargs)

    model.forward = forward

    def undo() -> None:
        del model.forward

    return shapes, undo


def test_a_groups_first_turn_is_prefilled_once_and_rows_stop_at_their_own_limit(
    loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, _ = loaded
    prompt, other = PROMPTS["g1/0"], PROMPTS["g2/0"]
    limits = [1, 2, 3, 5, 4, 4, 4, 4, 4, 3]  # ten rows: the first rides along stopped for a step
    turns = [TurnInput(prompt, n, torch.Generator().manual_seed(i)) for i, n in enumerate(limits[:-1])]
    turns.append(TurnInput(other, limits[-1], torch.Generator().manual_seed(9)))
    params = SamplingParams(temperature=TEMPERATURE, eos_token_ids=())  # no EOS: every row runs to its limit
    stats = TurnStats()
    shapes, undo = count_forwards(model)
    try:
        outputs = sample_turns(model, turns, params, stats=stats)
    finally:
        undo()
    assert shapes[0] == (2, len(prompt))  # one prefill: the group's context once, the other context
    assert [s[1] for s in shapes[1:]] == [1] * (len(shapes) - 1)  # then one token per row per step
    assert len(shapes) == max(limits)  # the last sampled tokens are never fed
    assert stats.prefill_rows == 2 and stats.computed_tokens == len(prompt) + len(other) and stats.cached_tokens == 0
    for turn, output in zip(turns, outputs, strict=True):
        assert len(output.sequence.tokens) == len(output.sequence.logprobs) == turn.max_new_tokens
        assert output.sequence.finish_reason == "length"
        assert output.cache is not None and output.cached_tokens == 0
        # the cache holds the tokens fed: the context and every sampled token but the last
        assert output.cache.tokens == list(turn.context) + output.sequence.tokens[:-1]
    # and exactly the keys and values of those tokens read alone (no junk, right positions)
    for output in (outputs[0], outputs[3], outputs[-1]):
        assert output.cache is not None
        alone_cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(torch.tensor([output.cache.tokens]), use_cache=True, **{_cache_kwarg(model): alone_cache})  # (its name by version)
        for (keys, values), layer in zip(output.cache.layers, cast(list[Any], alone_cache.layers), strict=True):
            assert torch.allclose(keys, layer.keys[0], atol=1e-4) and torch.allclose(values, layer.values[0], atol=1e-4)
    # Per-row generators: a row samples the same alone as in the batch.
    alone = sample_turns(model, [TurnInput(prompt, 5, torch.Generator().manual_seed(3))], params)[0]
    assert alone.sequence.tokens == outputs[3].sequence.tokens
    assert alone.sequence.logprobs == pytest.approx(outputs[3].sequence.logprobs, abs=1e-4)


def test_sessions_follow_weights_prefixes_lru_and_end_episodes(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = loaded
    sampler = SamplerCompute(model, tokenizer, SamplingParams(max_new_tokens=4), seed=1, max_sessions=2)

    def ask(episode: str, context: list[int], key: str = "k") -> TurnRequest:
        return TurnRequest(episode=episode, context=context, rng_key=key, max_new_tokens=4)

    def fed(result: TurnResult, context: list[int]) -> list[int]:
        return context + result.completion.tokens[:-1]

    a, b, c = PROMPTS["g0/0"], PROMPTS["g2/0"], PROMPTS["g3/0"]
    first = sampler.generate_turns([ask("a", a), ask("b", b), ask("c", c)])
    assert sampler.session_episodes == ["b", "c"]  # at most 2: "a", the least recently used, evicted
    covered = {"b": fed(first[1], b), "c": fed(first[2], c)}
    obs = [50, 37]
    second = sampler.generate_turns([ask("a", a + [7]), ask("b", covered["b"] + obs), ask("c", covered["c"] + obs)])
    assert [r.cached_tokens for r in second] == [0, len(covered["b"]), len(covered["c"])]
    assert sampler.session_episodes == ["b", "c"]
    covered = {"b": fed(second[1], covered["b"] + obs), "c": fed(second[2], covered["c"] + obs)}

    # A context that does not extend the session (one covered token changed), or only repeats
    # it (no suffix to read), is read again, and what it samples is what a fresh read samples.
    changed = list(covered["b"]) + obs
    changed[1] = 9
    again = sampler.generate_turns([ask("b", changed), ask("c", covered["c"])])
    assert [r.cached_tokens for r in again] == [0, 0]
    fresh = compute(loaded, max_sessions=0)
    fresh.seed = sampler.seed
    reference = fresh.generate_turns([ask("b", changed), ask("c", covered["c"])])
    assert [r.completion.tokens for r in again] == [r.completion.tokens for r in reference]

    # end_episodes forgets, and ignores names it does not know.
    sampler.end_episodes(["b", "nobody"])
    assert sampler.session_episodes == ["c"]
    covered_c = fed(again[1], covered["c"])
    ok = sampler.generate_turns([ask("c", covered_c + obs)])
    assert ok[0].cached_tokens == len(covered_c)
    covered_c = fed(ok[0], covered_c + obs)

    # A weight load drops every session: the next turn re-reads, with the new version.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sampler.load_weights(Weights(version=4, payload=state))
    assert sampler.session_episodes == []
    after = sampler.generate_turns([ask("c", covered_c + obs)])
    assert after[0].cached_tokens == 0 and after[0].policy_version == 4

    with pytest.raises(ValueError, match="twice"):
        sampler.generate_turns([ask("x", a), ask("x", b)])


def test_sessions_are_bounded_in_bytes(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = loaded
    config = model.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    context = list(PROMPTS["g1/0"])  # 18 tokens: each session holds 18 to 21
    sampler = SamplerCompute(model, tokenizer, SamplingParams(max_new_tokens=4), max_session_bytes=30 * per_token)
    asks = [TurnRequest(episode=e, context=context, rng_key=e, max_new_tokens=4) for e in ("a", "b")]
    results = sampler.generate_turns(asks)
    assert sampler.session_episodes == ["b"]  # two would not fit: the least recently used went
    assert sampler.session_bytes == (len(context) + len(results[1].completion.tokens) - 1) * per_token
    sampler.end_episodes(["b"])
    assert sampler.session_bytes == 0 and sampler.session_episodes == []


def test_abort_stops_between_forward_passes(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, _ = loaded
    sampler = compute(loaded)
    asks = [TurnRequest(episode=f"e{i}", context=list(PROMPTS["g1/0"]), rng_key=str(i), max_new_tokens=8) for i in range(3)]
    flag = threading.Event()
    flag.set()
    with pytest.raises(SamplingAborted):
        sampler.generate_turns(asks, flag)
    # Set during the first forward: raised before the second.
    flag = threading.Event()
    calls: list[int] = []

    def hook(*_: Any) -> None:
        calls.append(1)
        flag.set()

    handle = model.register_forward_hook(hook)
    turns = [TurnInput(a.context, 8, torch.Generator().manual_seed(i)) for i, a in enumerate(asks)]
    try:
        with pytest.raises(SamplingAborted):
            sample_turns(model, turns, SamplingParams(eos_token_ids=()), abort=flag)  # no EOS: 8 steps
    finally:
        handle.remove()
    assert len(calls) == 1
    assert sampler.session_episodes == []  # a call that did not finish keeps no session


def test_local_sampler_hosts_turns_on_its_worker_thread(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = loaded
    assert supports_row_caches(model)
    threads: set[str] = set()
    handle = model.register_forward_pre_hook(lambda *_: threads.add(threading.current_thread().name))

    async def main() -> tuple[list[TurnResult], list[TurnResult], list[str]]:
        sampler = LocalSampler(model, tokenizer, SamplingParams(max_new_tokens=4), replica=2, seed=5)
        try:
            context = list(PROMPTS["g0/0"])
            first = await sampler.generate_turns([TurnRequest(episode="e", context=context, rng_key="0", max_new_tokens=4)])
            follow = context + first[0].completion.tokens + [50, 37]
            second = await sampler.generate_turns([TurnRequest(episode="e", context=follow, rng_key="1", max_new_tokens=4)])
            await sampler.end_episodes(["e"])
            return first, second, sampler.compute.session_episodes
        finally:
            handle.remove()
            await sampler.close()
            await sampler.end_episodes(["e"])  # after close: nothing to forget, no error

    first, second, left = asyncio.run(main())
    assert threads == {"relayrl-sampler-2_0"}
    assert first[0].replica == 2 and first[0].policy_version == 0 and first[0].cached_tokens == 0
    assert second[0].cached_tokens > 0 and left == []
    assert first[0].completion.text == loaded[1].decode(first[0].completion.tokens, skip_special_tokens=True)


def test_greedy_turns_match_single_turn_sampling(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, _ = loaded
    prompts = [PROMPTS["g0/0"], PROMPTS["g1/0"], PROMPTS["g2/0"], PROMPTS["g4/0"]]
    params = SamplingParams(greedy=True, max_new_tokens=6, eos_token_ids=(1,))
    single = sample(model, prompts, 1, params, None)
    turns = sample_turns(model, [TurnInput(p, 6) for p in prompts], params)
    for group, turn in zip(single, turns, strict=True):
        assert turn.sequence.tokens == group[0].tokens and turn.sequence.finish_reason == group[0].finish_reason
        assert turn.sequence.logprobs == pytest.approx(group[0].logprobs, abs=1e-5)
