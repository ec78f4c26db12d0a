"""Agent tests' helpers: the shipped tiny model's tokenizer (and a chat variant of it with a
Qwen2-style template), a scripted sampler whose completions a function of the context decides,
and running agents through the endpoint and the agent rollout without a whole run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from relayrl.agents.context import AgentFn
from relayrl.agents.endpoint import AgentEndpoint, EndpointSettings, Tokenizer
from relayrl.agents.processes import AgentProcesses
from relayrl.backends.protocols import Sampler
from relayrl.models.loading import shipped_model_dir
from relayrl.orchestrator.replicas import SamplerSlot
from relayrl.orchestrator.stages.agents import GATHER_S, AgentRollout, AgentSettings
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Completion, GenerateResult, Group, Prompt, SampleRequest, TurnRequest, TurnResult

# Qwen2's chat format, in the characters the tiny vocabulary has (plus the tokens `chat_tokenizer` adds);
# compact JSON: the tiny tokenizer drops spaces, so a model's tool call has none
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for tc in m.tool_calls %}<tool_call>"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson(separators=(',', ':')) }}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(shipped_model_dir())


def chat_tokenizer() -> PreTrainedTokenizerBase:
    """The tiny tokenizer with Qwen2's chat tokens, the JSON characters it lacks and a chat template;
    `<|im_end|>` is its end-of-sequence token."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["{", "}", "_", "[", "]"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    return tok


@dataclass
class ScriptedSampler(Sampler):
    """Answers each turn with `script(context text)` tokenized, then the end-of-sequence token
    (finish "stop"), cut at the turn's max_new_tokens (finish "length"). Log-probs are -0.01 × (position + 1)."""

    tokenizer: Any
    script: Callable[[str], str]
    version: int = 0
    replica: int = 0
    calls: list[list[TurnRequest]] = field(default_factory=list)
    sampled: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)  # (context, tokens, logprobs)
    ended: list[str] = field(default_factory=list)
    fail: bool = False

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        raise NotImplementedError

    async def generate_turns(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("scripted sampler broke")
        self.calls.append(list(requests))
        out = []
        for r in requests:
            text = self.script(self.tokenizer.decode(r.context, skip_special_tokens=False))
            tokens = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]] + [int(self.tokenizer.eos_token_id)]
            finish = "stop"
            if len(tokens) > r.max_new_tokens:
                tokens, finish = tokens[: r.max_new_tokens], "length"
            logprobs = [-0.01 * (i + 1) for i in range(len(tokens))]
            self.sampled.append((list(r.context), tokens, logprobs))
            out.append(TurnResult(r.episode, Completion(tokens, logprobs, text, finish), self.version, self.replica))
        return out

    async def end_episodes(self, episodes: Sequence[str]) -> None:
        self.ended.extend(episodes)

    async def load_weights(self, weights: Any) -> None:
        return None


def make_rollout(
    tokenizer: Any,
    agent: AgentFn,
    *,
    timeout_s: float = 0.0,
    strict: bool = False,
    max_new_tokens: int = 32,
    max_total_tokens: int = 512,
    processes: AgentProcesses | None = None,
    gather_s: float = GATHER_S,
) -> AgentRollout:
    settings = EndpointSettings(model="tiny", max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens)
    endpoint = AgentEndpoint(settings, tokenizer)
    return AgentRollout(
        agent,
        endpoint,
        AgentSettings(name="test_agent", model="tiny", timeout_s=timeout_s, strict=strict, gather_s=gather_s),
        Tracer(None, {}),
        processes,
    )


def requests_for(tokenizer: Any, prompts: Sequence[Prompt], num_samples: int = 2) -> list[SampleRequest]:
    return [
        SampleRequest(i, p, [int(t) for t in tokenizer(p.text, add_special_tokens=False)["input_ids"]], num_samples, f"k{i}")
        for i, p in enumerate(prompts)
    ]


async def run_rollout(rollout: AgentRollout, sampler: Sampler, requests: list[SampleRequest]) -> list[Group]:
    """The rollout of `requests` on a replica of `sampler`, its endpoint listening (and its agent
    processes running) meanwhile."""
    await rollout.start()
    try:
        return await rollout(SamplerSlot(0, sampler), requests)
    finally:
        await rollout.stop()


def tokenizer_of(tok: PreTrainedTokenizerBase) -> Tokenizer:
    return tok  # type: ignore[return-value]


# what a replica sampled for an agent call: (context, tokens, log-probs, version)
Sampled = tuple[list[int], list[int], list[float], int]


def sampled_of(requests: Sequence[TurnRequest], results: Sequence[TurnResult]) -> list[Sampled]:
    """One `generate_turns` call's (context, tokens, log-probs, version) per request."""
    return [(list(q.context), list(r.completion.tokens), list(r.completion.logprobs), r.policy_version) for q, r in zip(requests, results)]


def assert_trained_as_sampled(sampled: Sequence[Sampled], trained: Sequence[Any]) -> int:
    """Every trained agent trajectory's policy tokens are tokens a replica sampled from that very
    prefix, with their log-probs and version, each sample used once, and nothing else is trained;
    returns how many trajectories hold two calls."""
    assert trained
    unused: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[list[float], int]]] = {}
    for context, tokens, logprobs, version in sampled:
        unused.setdefault((tuple(context), tuple(tokens)), []).append((logprobs, version))
    two_calls = 0
    for t in trained:
        assert t.loss_mask is not None and t.turns
        sequence = t.prompt_tokens + t.completion_tokens
        for turn in t.turns:
            key = (tuple(sequence[: len(t.prompt_tokens) + turn.start]), tuple(t.completion_tokens[turn.start : turn.end]))
            candidates = unused.get(key, [])
            match = (t.sampler_logprobs[turn.start : turn.end], turn.policy_version)
            assert match in candidates, f"trained tokens {key[1]} after {key[0]} were not sampled so"
            candidates.remove(match)
        assert sum(t.loss_mask) == sum(u.end - u.start for u in t.turns)
        two_calls += len(t.turns) == 2
    return two_calls
