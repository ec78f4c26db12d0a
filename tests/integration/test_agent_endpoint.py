"""The agents' endpoint and rollout (agents/, orchestrator/stages/agents.py) on a scripted sampler:
the example agents through the `openai` client, token-exact trajectories, auth, bad requests,
deadlines, streaming, and agents that fail."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from relayrl.agents.context import AgentContext, load_agent
from relayrl.orchestrator.stages.agents import AgentError, AgentFailedWarning, agent_failure_reason
from relayrl.types import Group, Prompt, TrajectoryStatus
from support.agentutil import ScriptedSampler, chat_tokenizer, make_rollout, requests_for, run_rollout, tiny_tokenizer, tokenizer_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
PROMPTS = [Prompt("p0", "23+9=", "32"), Prompt("p1", "7-5=", "2")]


def arithmetic(context: str) -> str:
    """The right answer to the last `a+b=` / `a-b=` of the context."""
    a, op, b = re.findall(r"(\d+)([+-])(\d+)=", context)[-1]
    return str(int(a) + int(b) if op == "+" else int(a) - int(b))


def run(rollout: Any, sampler: ScriptedSampler, prompts: list[Prompt] = PROMPTS, samples: int = 2) -> list[Group]:
    return asyncio.run(run_rollout(rollout, sampler, requests_for(sampler.tokenizer, prompts, samples)))


def test_the_completions_example_trains_exactly_the_sampled_tokens() -> None:
    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic, version=7)
    groups = run(make_rollout(tok, load_agent(f"{EXAMPLES}/completions_agent.py:agent")), sampler)
    assert [len(g.trajectories) for g in groups] == [2, 2]
    for g in groups:
        for t in g.trajectories:
            assert t.status is TrajectoryStatus.OK and t.agent_reward == 1.5  # draft and answer right
            assert len(t.turns) == 2 and t.policy_version == 7  # both calls in one sequence
            sequence = t.prompt_tokens + t.completion_tokens
            assert t.loss_mask is not None
            for turn in t.turns:
                begin = len(t.prompt_tokens) + turn.start
                # what the sampler was given is this sequence's prefix, what it produced is the trained part
                context, tokens, logprobs = next(s for s in sampler.sampled if s[0] == sequence[:begin])
                assert t.completion_tokens[turn.start : turn.end] == tokens
                assert t.sampler_logprobs[turn.start : turn.end] == logprobs
                assert t.loss_mask[turn.start : turn.end] == [1] * len(tokens)
            assert sum(t.loss_mask) == sum(u.end - u.start for u in t.turns)  # the rest is context
    # the second call read the first call's KV chain, and the chains were forgotten at the end
    assert all(len({r.episode for r in call}) == len(call) for call in sampler.calls)
    assert len(sampler.ended) == 4


def test_the_tool_agent_example_calls_its_tool_in_one_token_exact_sequence() -> None:
    tok = chat_tokenizer()

    def model(context: str) -> str:
        if "<tool_response>" in context:
            return re.findall(r"<tool_response>(.*?)</tool_response>", context)[-1]
        question = re.findall(r"user(\d+[+-]\d+)=", context)[-1]
        return f'<tool_call>{{"name":"calculate","arguments":{{"expression":"{question}"}}}}</tool_call>'

    sampler = ScriptedSampler(tok, model)
    rollout = make_rollout(tok, load_agent(f"{EXAMPLES}/tool_agent.py:agent"), max_new_tokens=96)
    groups = run(rollout, sampler, samples=1)
    assert sum(len(c) for c in sampler.calls) == 4  # two calls per episode
    for g, prompt in zip(groups, PROMPTS):
        [t] = g.trajectories
        assert t.status is TrajectoryStatus.OK and t.agent_reward is None  # the reward functions score it
        assert t.completion_text == prompt.answer
        assert len(t.turns) == 2 and "<tool_call>" in t.turns[0].action
        assert "<tool_response>" + prompt.answer in t.turns[0].observation
        for _, tokens, _ in [s for s in sampler.sampled if s[0] == (t.prompt_tokens + t.completion_tokens)[: len(s[0])]]:
            assert tokens in [t.completion_tokens[u.start : u.end] for u in t.turns]


def test_the_tool_agent_example_without_a_chat_template_gets_a_clear_400() -> None:
    tok = tiny_tokenizer()
    rollout = make_rollout(tok, load_agent(f"{EXAMPLES}/tool_agent.py:agent"))
    sampler = ScriptedSampler(tok, arithmetic)
    with pytest.warns(AgentFailedWarning):
        groups = run(rollout, sampler, prompts=PROMPTS[:1], samples=1)
    [t] = groups[0].trajectories
    assert agent_failure_reason(t) == "raised" and "no chat template" in (t.error or "") and "400" in (t.error or "")
    assert sampler.calls == []


class Probe:
    """An agent that sends raw requests (made by `make(ctx)`: method, path under base_url, json,
    headers) and keeps the responses, then makes one good call so its sample trains."""

    def __init__(self, *requests: Any, good: bool = True) -> None:
        self.requests = requests
        self.good = good
        self.responses: list[httpx.Response] = []
        self.ctx: AgentContext | None = None

    async def __call__(self, ctx: AgentContext) -> float:
        self.ctx = ctx
        auth = {"Authorization": f"Bearer {ctx.api_key}"}
        async with httpx.AsyncClient() as client:
            for make in self.requests:
                path, body, headers = make(ctx)
                url = path if path.startswith("http") else ctx.base_url + path
                self.responses.append(await client.post(url, json=body, headers=auth if headers is None else headers))
            if self.good:
                ok = await client.post(ctx.base_url + "/completions", json={"model": ctx.model, "prompt": "1+1="}, headers=auth)
                assert ok.status_code == 200, ok.text
        return 1.0


def completion(**fields: Any) -> Any:
    return lambda ctx: ("/completions", {"model": ctx.model, "prompt": "1+1=", **fields}, None)


def test_a_request_without_the_run_token_gets_401_and_nothing_is_sampled() -> None:
    tok = tiny_tokenizer()
    probe = Probe(
        lambda ctx: ("/completions", {"model": ctx.model, "prompt": "1+1="}, {}),
        lambda ctx: ("/completions", {"model": ctx.model, "prompt": "1+1="}, {"Authorization": "Bearer wrong"}),
        lambda ctx: ("/chat/completions", {"model": ctx.model, "messages": []}, {"Authorization": ctx.api_key}),
    )
    sampler = ScriptedSampler(tok, arithmetic)
    run(make_rollout(tok, probe), sampler, PROMPTS[:1], samples=1)
    assert [r.status_code for r in probe.responses] == [401, 401, 401]
    assert all(r.json()["error"]["type"] == "authentication_error" for r in probe.responses)
    assert len(sampler.sampled) == 1  # the good call only


def test_bad_requests_get_a_clear_4xx_naming_the_field_and_nothing_is_sampled() -> None:
    tok = tiny_tokenizer()
    probe = Probe(
        completion(temperature=0.5),
        completion(top_p=0.9),
        completion(n=1000),
        completion(logit_bias={"5": 10}),
        completion(stop=["", "x"]),
        completion(max_tokens=0),
        lambda ctx: ("/completions", {"model": ctx.model}, None),  # no prompt
        lambda ctx: ("/completions", {"model": "gpt-4", "prompt": "1+1="}, None),
        lambda ctx: ("/chat/completions", {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}]}, None),
        lambda ctx: ("/completions", {"model": ctx.model, "prompt": "1+1=" * 200}, None),
        lambda ctx: (ctx.base_url.replace("/episodes/", "/episodes/x") + "/completions", {"model": ctx.model, "prompt": "1"}, None),
    )
    sampler = ScriptedSampler(tok, arithmetic)
    groups = run(make_rollout(tok, probe, max_total_tokens=100), sampler, PROMPTS[:1], samples=1)
    statuses = [r.status_code for r in probe.responses]
    assert statuses == [400] * 10 + [401]  # another episode's URL: its key opens its own only
    params = [r.json()["error"]["param"] for r in probe.responses]
    assert params[:8] == ["temperature", "top_p", "n", "logit_bias", "stop", "max_tokens", "prompt", "model"]
    assert "rollout.temperature = 1.0" in probe.responses[0].json()["error"]["message"]
    assert "no chat template" in probe.responses[8].json()["error"]["message"]
    assert probe.responses[9].json()["error"]["type"] == "context_length_exceeded"
    assert len(sampler.sampled) == 1  # the good call only
    [t] = groups[0].trajectories
    assert len(t.turns) == 1


def test_a_call_after_the_episode_deadline_or_end_fails() -> None:
    tok = tiny_tokenizer()
    rollout = make_rollout(tok, lambda ctx: asyncio.sleep(0), timeout_s=600)
    late: list[httpx.Response] = []

    async def agent(ctx: AgentContext) -> float:
        auth = {"Authorization": f"Bearer {ctx.api_key}"}
        body = {"model": ctx.model, "prompt": "1+1="}
        async with httpx.AsyncClient() as client:
            assert (await client.post(ctx.base_url + "/completions", json=body, headers=auth)).status_code == 200
            [episode] = rollout.endpoint._episodes.values()
            episode.deadline = asyncio.get_running_loop().time() - 1.0  # its deadline passed
            late.append(await client.post(ctx.base_url + "/completions", json=body, headers=auth))
        return 1.0

    rollout._agent = agent
    sampler = ScriptedSampler(tok, arithmetic)
    after: list[httpx.Response] = []

    async def main() -> list[Group]:
        await rollout.endpoint.start()
        try:
            from relayrl.orchestrator.replicas import SamplerSlot

            groups = await rollout(SamplerSlot(0, sampler), requests_for(tok, PROMPTS[:1], 1))
            url = f"{rollout.endpoint.url}/episodes/0-0-1/v1/completions"  # the finished episode
            async with httpx.AsyncClient() as client:
                after.append(
                    await client.post(
                        url, json={"model": "tiny", "prompt": "1"}, headers={"Authorization": f"Bearer {rollout.endpoint.key('0-0-1')}"}
                    )
                )
            return groups
        finally:
            await rollout.endpoint.stop()

    groups = asyncio.run(main())
    assert late[0].status_code == 410 and "deadline" in late[0].json()["error"]["message"]
    assert after[0].status_code == 404
    assert len(sampler.sampled) == 1 and len(groups[0].trajectories[0].turns) == 1


def test_streaming_completions_and_chat_through_the_openai_client() -> None:
    tok = chat_tokenizer()
    texts: list[str] = []

    async def agent(ctx: AgentContext) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            stream = await client.completions.create(model=ctx.model, prompt="2+2=", stream=True, n=2)
            parts: dict[int, str] = {}
            async for chunk in stream:
                for c in chunk.choices:
                    parts[c.index] = parts.get(c.index, "") + c.text
            texts.extend(parts[i] for i in sorted(parts))
            chat = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "3+4="}], stream=True)
            text = ""
            async for piece in chat:
                text += piece.choices[0].delta.content or ""
            texts.append(text)
        return 0.0

    sampler = ScriptedSampler(tok, arithmetic)
    groups = run(make_rollout(tok, agent), sampler, PROMPTS[:1], samples=1)
    assert texts == ["4", "4", "7"]
    assert len(groups[0].trajectories) == 3  # two choices and a chat call that continues neither


def test_an_agent_that_raises_times_out_or_returns_garbage_fails_its_sample_only() -> None:
    tok = tiny_tokenizer()

    async def agent(ctx: AgentContext) -> object:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            await client.completions.create(model=ctx.model, prompt=ctx.prompt.text)
        if ctx.sample_index == 0:
            raise KeyError("boom")
        if ctx.sample_index == 1:
            await asyncio.Event().wait()  # never returns: cancelled at rollout.agent_timeout_s
        if ctx.sample_index == 2:
            return "1.0"
        return 0.5

    sampler = ScriptedSampler(tok, arithmetic)
    with pytest.warns(AgentFailedWarning, match="rollout|task.strict_agents"):
        groups = run(make_rollout(tok, agent, timeout_s=0.5), sampler, PROMPTS[:1], samples=4)
    ts = groups[0].trajectories
    assert [agent_failure_reason(t) for t in ts] == ["raised", "timeout", "raised", None]
    assert "KeyError: 'boom'" in (ts[0].error or "") and "sample 0" in (ts[0].error or "")
    assert "returned a str" in (ts[2].error or "")
    assert ts[3].status is TrajectoryStatus.OK and ts[3].agent_reward == 0.5


def test_under_strict_agents_a_failed_agent_fails_the_run_in_one_line() -> None:
    tok = tiny_tokenizer()

    async def agent(ctx: AgentContext) -> float:
        raise ValueError("no luck")

    with pytest.raises(AgentError) as info:
        run(make_rollout(tok, agent, strict=True), ScriptedSampler(tok, arithmetic), PROMPTS[:1], samples=2)
    message = str(info.value)
    assert "\n" not in message and "ValueError: no luck" in message and "task.strict_agents" in message and "'p0'" in message


def test_a_sampler_that_fails_fails_the_rollout_as_the_replica_failure() -> None:
    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic, fail=True)
    with pytest.raises(RuntimeError, match="scripted sampler broke"):
        run(make_rollout(tok, load_agent(f"{EXAMPLES}/completions_agent.py:agent")), sampler, PROMPTS[:1], samples=2)


def test_a_prompt_of_token_ids_is_sampled_as_sent_and_continues_by_ids() -> None:
    tok = tiny_tokenizer()

    async def agent(ctx: AgentContext) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            ids = tok(ctx.prompt.text, add_special_tokens=False)["input_ids"]
            first = await client.completions.create(model=ctx.model, prompt=ids)
            sampled = first.model_dump()["choices"][0]["token_ids"]
            # the sampled ids (its end-of-sequence token included), then an id sequence no text round-trips to
            await client.completions.create(model=ctx.model, prompt=[*ids, *sampled, 31, 31, *ids])
        return 1.0

    sampler = ScriptedSampler(tok, arithmetic)
    groups = run(make_rollout(tok, agent), sampler, PROMPTS[:1], samples=1)
    [t] = groups[0].trajectories
    assert len(t.turns) == 2
    first, second = sampler.sampled
    assert second[0] == [
        *first[0],
        *first[1],
        31,
        31,
        *first[0],
    ]  # exactly the ids sent (31, a space, does not survive a round trip through text)
    assert t.prompt_tokens + t.completion_tokens == second[0] + second[1]


def test_the_endpoint_listens_on_loopback_with_a_random_token_per_run() -> None:
    from relayrl.agents.endpoint import AgentEndpoint, EndpointSettings

    tok = tokenizer_of(tiny_tokenizer())
    a, b = AgentEndpoint(EndpointSettings(), tok), AgentEndpoint(EndpointSettings(), tok)
    assert a.token != b.token and len(a.token) >= 32

    async def main() -> str:
        await a.start()
        try:
            return a.url
        finally:
            await a.stop()

    url = asyncio.run(main())
    assert url.startswith("http://127.0.0.1:") and a.port > 0


def test_concurrent_agent_calls_are_gathered_into_one_sampling_call_per_round() -> None:
    """32 episodes of the two-call example: their first calls used to reach the replica one by one
    as the HTTP requests landed (the first went alone into a sampling call, the rest into the next
    ones); the batcher now waits for every live episode's call, so each round is one call."""
    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic)
    prompts = [Prompt(f"q{i}", f"{10 + i}+{i}=", str(10 + 2 * i)) for i in range(16)]
    rollout = make_rollout(tok, load_agent(f"{EXAMPLES}/completions_agent.py:agent"))
    rollout._settings = dataclasses.replace(rollout._settings, gather_s=30.0)  # a loaded machine's HTTP is never this slow
    groups = run(rollout, sampler, prompts, samples=2)
    assert sum(len(g.trajectories) for g in groups) == 32
    assert [len(c) for c in sampler.calls] == [32, 32]


def test_a_slow_agent_holds_the_others_calls_at_most_the_gather_window() -> None:
    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic)
    example = load_agent(f"{EXAMPLES}/completions_agent.py:agent")

    async def agent(ctx: AgentContext) -> float:
        if ctx.sample_index == 0 and ctx.prompt.prompt_id == "p0":
            await asyncio.sleep(3.0)  # thinks long before its first call
        reward = await example(ctx)
        assert isinstance(reward, float)
        return reward

    rollout = make_rollout(tok, agent)
    rollout._settings = dataclasses.replace(rollout._settings, gather_s=1.0)
    started = time.monotonic()
    groups = run(rollout, sampler)
    assert sum(len(g.trajectories) for g in groups) == 4 and time.monotonic() - started < 20
    # the three others' first calls went in one call, without waiting for the slow one's
    assert len(sampler.calls[0]) == 3 and all(not r.episode.startswith("agent/0-0-") for r in sampler.calls[0])
    # then the slow one's two calls, on their own
    assert [[r.episode.startswith("agent/0-0-") for r in c] for c in sampler.calls[-2:]] == [[True], [True]]
