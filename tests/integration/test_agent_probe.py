"""A hostile probe of the agents' endpoint and rollout (agents/, orchestrator/stages/agents.py) on
a scripted sampler: requests that used to reach the sampler or answer 200 for a wrong reason, and
agents that used to hang the rollout, break its event loop, fail their replica or leave tasks
running. Each ends in a clear 4xx, a counted failed sample or a one-line error."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from relayrl.agents import tasks as agent_tasks
from relayrl.agents.context import AgentContext, load_agent
from relayrl.errors import UserError
from relayrl.orchestrator.replicas import SamplerSlot
from relayrl.orchestrator.stages.agents import AgentError, AgentFailedWarning, agent_failure_reason
from relayrl.types import Group, Prompt, TrajectoryStatus
from support.agentutil import ScriptedSampler, make_rollout, requests_for, tiny_tokenizer

PROMPT = [Prompt("p0", "23+9=", "32")]


def arithmetic(context: str) -> str:
    found = re.findall(r"(\d+)\+(\d+)=", context)
    return str(int(found[-1][0]) + int(found[-1][1])) if found else "0"


def run(agent: Any, samples: int = 1, **settings: Any) -> tuple[list[Group], ScriptedSampler]:
    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic)
    rollout = make_rollout(tok, agent, **settings)

    async def main() -> list[Group]:
        await rollout.endpoint.start()
        try:
            return await rollout(SamplerSlot(0, sampler), requests_for(tok, PROMPT, samples))
        finally:
            await rollout.endpoint.stop()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AgentFailedWarning)
        return asyncio.run(main()), sampler


async def call(ctx: AgentContext, prompt: str = "1+1=") -> None:
    async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
        await client.completions.create(model=ctx.model, prompt=prompt)


async def post(ctx: AgentContext, body: Any = None, content: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ctx.api_key}", "Content-Type": "application/json"}
    async with httpx.AsyncClient() as client:
        if content is not None:
            return await client.post(ctx.base_url + "/completions", content=content, headers=headers)
        return await client.post(ctx.base_url + "/completions", json=body, headers=headers)


# -- requests -------------------------------------------------------------------------------


def test_a_prompt_that_encodes_to_no_tokens_gets_a_400_and_never_reaches_the_sampler() -> None:
    """The tiny tokenizer drops spaces and characters it lacks: such a prompt used to be sampled
    from an empty context, which the local sampler refuses (ValueError: the replica failed)."""
    responses: list[httpx.Response] = []

    async def agent(ctx: AgentContext) -> float:
        for prompt in ("   ", "é€😀"):
            responses.append(await post(ctx, {"model": ctx.model, "prompt": prompt}))
        await call(ctx)
        return 1.0

    groups, sampler = run(agent)
    assert [r.status_code for r in responses] == [400, 400]
    assert all(r.json()["error"]["param"] == "prompt" and "no tokens" in r.json()["error"]["message"] for r in responses)
    assert len(sampler.sampled) == 1 and all(context for context, _, _ in sampler.sampled)
    assert groups[0].trajectories[0].status is TrajectoryStatus.OK


def test_a_body_that_is_not_json_or_token_ids_that_are_not_integers_get_a_clear_400() -> None:
    """Invalid JSON used to name its character position as the field (`param` "28"); token ids
    given as strings or booleans used to be coerced ("5" -> 5, true -> 1) and sampled."""
    responses: list[httpx.Response] = []

    async def agent(ctx: AgentContext) -> float:
        responses.append(await post(ctx, content=b'{"model": "tiny", "prompt": '))
        responses.append(await post(ctx, {"model": ctx.model, "prompt": ["5", "7"]}))
        responses.append(await post(ctx, {"model": ctx.model, "prompt": [True, False]}))
        await call(ctx)
        return 1.0

    _, sampler = run(agent)
    assert [r.status_code for r in responses] == [400, 400, 400]
    bad_json = responses[0].json()["error"]
    assert bad_json["param"] is None and bad_json["message"].startswith("the body is not valid JSON")
    assert all((r.json()["error"]["param"] or "").startswith("prompt") for r in responses[1:])
    assert len(sampler.sampled) == 1  # the good call only


def test_a_body_too_large_an_unknown_path_or_method_and_a_tool_choice_it_cannot_honour_get_a_clear_4xx() -> None:
    """The body had no bound (it was read whole), 404 and 405 answered FastAPI's {"detail"}, and
    tool_choice "required" or a named function was ignored (sampled as "auto")."""
    responses: list[httpx.Response] = []

    async def agent(ctx: AgentContext) -> float:
        auth = {"Authorization": f"Bearer {ctx.api_key}"}
        async with httpx.AsyncClient() as client:
            big = b'{"model": "tiny", "prompt": "' + b"1" * (16 * 2**20) + b'"}'
            responses.append(await client.post(ctx.base_url + "/completions", content=big, headers=auth))

            async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: refused as it is read
                yield b'{"model": "tiny", "prompt": "'
                for _ in range(17):
                    yield b"1" * 2**20
                yield b'"}'

            responses.append(await client.post(ctx.base_url + "/completions", content=chunked(), headers=auth))
            responses.append(await client.get(ctx.base_url + "/nothing", headers=auth))
            responses.append(await client.get(ctx.base_url + "/completions", headers=auth))
            for choice in ("required", {"type": "function", "function": {"name": "calculate"}}):
                body = {"model": ctx.model, "messages": [{"role": "user", "content": "1+1="}], "tool_choice": choice}
                responses.append(await client.post(ctx.base_url + "/chat/completions", json=body, headers=auth))
        await call(ctx)
        return 1.0

    _, sampler = run(agent)
    assert [r.status_code for r in responses] == [413, 413, 404, 405, 400, 400]
    assert [r.json()["error"]["type"] for r in responses[:4]] == ["invalid_request_error"] * 4
    assert all(r.json()["error"]["param"] == "tool_choice" for r in responses[4:])
    assert len(sampler.sampled) == 1


def test_more_choices_at_once_than_max_n_on_one_episode_get_429() -> None:
    """Concurrent calls of one episode used to be queued without bound (every choice of every
    call in one generate_turns batch of the replica)."""
    tok = tiny_tokenizer()
    release = asyncio.Event()

    class Held(ScriptedSampler):
        async def generate_turns(self, requests: Any) -> Any:
            await release.wait()
            return await super().generate_turns(requests)

    sampler = Held(tok, arithmetic)
    statuses: list[int] = []

    async def agent(ctx: AgentContext) -> float:
        body = {"model": ctx.model, "prompt": "1+1="}
        first = asyncio.create_task(post(ctx, {**body, "n": 16}))
        await asyncio.sleep(0.2)  # the first call's 16 choices are being sampled (held)
        over = await asyncio.wait_for(post(ctx, body), 10)
        release.set()
        statuses.extend([over.status_code, (await first).status_code, (await post(ctx, body)).status_code])
        assert "at most 16 at once" in over.json()["error"]["message"] and over.json()["error"]["type"] == "rate_limit_exceeded"
        return 1.0

    rollout = make_rollout(tok, agent)

    async def main() -> list[Group]:
        await rollout.endpoint.start()
        try:
            return await rollout(SamplerSlot(0, sampler), requests_for(tok, PROMPT, 1))
        finally:
            await rollout.endpoint.stop()

    groups = asyncio.run(main())
    assert statuses == [429, 200, 200]
    assert [len(c) for c in sampler.calls] == [16, 1] and len(groups[0].trajectories) == 17


@pytest.mark.parametrize(("gone", "stream"), [("closed", False), ("cancelled", True), ("cancelled", False)])
def test_a_call_whose_client_disconnected_while_it_was_sampled_is_not_recorded(gone: str, stream: bool) -> None:
    """A call whose client went away (its connection closed, its task cancelled) while it was sampled used to
    be recorded: the answer the agent never saw took over the node it continued, so the agent's
    retry of that call became a sample of its own, and both were trained with the episode's reward."""
    tok = tiny_tokenizer()
    held, release = asyncio.Event(), asyncio.Event()
    answers = iter(["2", "9", "7"])  # the first call's, the call nobody got, its retry's

    class Held(ScriptedSampler):
        async def generate_turns(self, requests: Any) -> Any:
            if len(self.calls) == 1:  # the second call: sampled until its client is gone
                held.set()
                await release.wait()
            return await super().generate_turns(requests)

    sampler = Held(tok, lambda context: next(answers))
    texts: list[str] = []

    async def agent(ctx: AgentContext) -> float:
        first = await post(ctx, {"model": ctx.model, "prompt": "1+1="})
        texts.append(first.json()["choices"][0]["text"])
        body = {"model": ctx.model, "prompt": "1+1=" + texts[0] + "3+4="}
        if gone == "closed":  # the connection closed once the request is being sampled
            url = httpx.URL(ctx.base_url + "/completions")
            payload = json.dumps({**body, "stream": stream}).encode()
            head = f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}\r\nAuthorization: Bearer {ctx.api_key}\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            _, writer = await asyncio.open_connection(url.host, url.port)
            writer.write(head.encode() + payload)
            await writer.drain()
            await held.wait()
            writer.close()
            await writer.wait_closed()
        else:  # the agent's task that makes the call cancelled (its own timeout, say)
            task = asyncio.create_task(post(ctx, {**body, "stream": stream}))
            await held.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        server = rollout.endpoint._server
        assert server is not None
        while server.server_state.connections:  # until the endpoint has seen the connection close
            await asyncio.sleep(0.01)
        release.set()
        retry = await post(ctx, body)
        texts.append(retry.json()["choices"][0]["text"])
        return 1.0

    rollout = make_rollout(tok, agent)

    async def main() -> list[Group]:
        await rollout.endpoint.start()
        try:
            return await rollout(SamplerSlot(0, sampler), requests_for(tok, PROMPT, 1))
        finally:
            await rollout.endpoint.stop()

    groups = asyncio.run(main())
    assert texts == ["2", "7"] and len(sampler.sampled) == 3
    assert len(groups[0].trajectories) == 1  # exactly one sequence: the first call continued by the retry
    [t] = groups[0].trajectories
    assert t.status is TrajectoryStatus.OK and [u.action for u in t.turns] == ["2", "7"]
    (_, first, _), (dropped_context, _, _), (context, retried, _) = sampler.sampled
    assert context == dropped_context and t.completion_tokens[t.turns[1].start :] == retried
    assert t.completion_tokens[: t.turns[0].end] == first and t.completion_text == "7"
    # the retry continued the first call's KV chain (the dropped call left nothing in the transcript)
    assert sampler.calls[2][0].episode == sampler.calls[0][0].episode


def test_the_token_is_checked_before_routing_and_the_scheme_in_any_case() -> None:
    responses: list[httpx.Response] = []

    async def agent(ctx: AgentContext) -> float:
        async with httpx.AsyncClient() as client:
            responses.append(await client.get(ctx.base_url + "/nothing"))
            responses.append(await client.get(ctx.base_url + "/models", headers={"Authorization": f"Bearer {ctx.api_key}x"}))
            responses.append(await client.get(ctx.base_url + "/models", headers={"Authorization": f"bearer {ctx.api_key}"}))
        await call(ctx)
        return 1.0

    _, sampler = run(agent)
    assert [r.status_code for r in responses] == [401, 401, 200]
    assert [r.json()["error"]["type"] for r in responses[:2]] == ["authentication_error"] * 2
    assert len(sampler.sampled) == 1


def test_an_episode_key_opens_its_own_episode_only_whatever_the_agent_cached_or_guessed() -> None:
    """All episodes used to share one token and ids are predictable: a call with one episode's key to
    a sibling's URL was answered 200 and trained as the sibling's sample, under its prompt."""
    seen: dict[int, AgentContext] = {}
    both = asyncio.Event()
    statuses: dict[str, int] = {}
    run_token: list[str] = []

    async def agent(ctx: AgentContext) -> float:
        seen[ctx.sample_index] = ctx
        if len(seen) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), 10)
        await call(ctx)
        if ctx.sample_index == 0:
            other = seen[1]
            body = {"model": ctx.model, "prompt": "1+1="}
            guessed = ctx.base_url.rsplit("/episodes/", 1)[0] + "/episodes/0-0-7/v1"
            async with httpx.AsyncClient() as client:
                for name, url, key in (
                    ("sibling_with_own_key", other.base_url, ctx.api_key),
                    ("guessed_with_own_key", guessed, ctx.api_key),
                    ("own_with_sibling_key", ctx.base_url, other.api_key),
                    ("own_with_run_secret", ctx.base_url, run_token[0]),
                    ("outside_episodes", ctx.base_url.rsplit("/episodes/", 1)[0] + "/v1", ctx.api_key),
                ):
                    r = await client.post(url + "/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                    statuses[name] = r.status_code
        return 1.0

    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic)
    rollout = make_rollout(tok, agent)
    run_token.append(rollout.endpoint.token)

    async def main() -> list[Group]:
        await rollout.endpoint.start()
        try:
            return await rollout(SamplerSlot(0, sampler), requests_for(tok, PROMPT, 2))
        finally:
            await rollout.endpoint.stop()

    groups = asyncio.run(main())
    assert seen[0].api_key != seen[1].api_key
    assert statuses and all(code in (401, 403, 404) for code in statuses.values()), statuses
    assert len(sampler.sampled) == 2  # only each agent's own call was sampled
    assert [len(t.turns) for t in groups[0].trajectories] == [1, 1]


def test_a_large_request_is_refused_by_its_length_before_any_work_and_never_freezes_the_run() -> None:
    """The endpoint rendered and tokenized bodies up to 16 MiB on the run's event loop before
    checking their length: 1 MB of prompt held the loop for seconds (14 MB: 96 s). Now a prompt
    longer than the episode's tokens could hold is a 400 naming the limit, and what is tokenized
    is tokenized in the endpoint's own thread."""
    import threading
    import time

    big = "1+1=" * 250_000  # 1 MB
    answers: list[httpx.Response] = []
    lags: list[float] = []
    encoded_in: list[str] = []

    async def ticker() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - before - 0.01)

    async def agent(ctx: AgentContext) -> float:
        tick = asyncio.create_task(ticker())
        try:
            answers.append(await post(ctx, {"model": ctx.model, "prompt": big}))
            headers = {"Authorization": f"Bearer {ctx.api_key}"}
            async with httpx.AsyncClient() as client:
                chat = {"model": ctx.model, "messages": [{"role": "user", "content": big}]}
                answers.append(await client.post(ctx.base_url + "/chat/completions", json=chat, headers=headers))
        finally:
            tick.cancel()
        await call(ctx)
        return 1.0

    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic)
    rollout = make_rollout(tok, agent)
    encode = rollout.endpoint._encode

    def recording(text: str) -> list[int]:
        encoded_in.append(threading.current_thread().name)
        return encode(text)

    rollout.endpoint._encode = recording  # type: ignore[method-assign]

    async def main() -> list[Group]:
        await rollout.endpoint.start()
        try:
            return await rollout(SamplerSlot(0, sampler), requests_for(tok, PROMPT, 1))
        finally:
            await rollout.endpoint.stop()

    groups = asyncio.run(main())
    assert [r.status_code for r in answers] == [400, 400]
    errors = [r.json()["error"] for r in answers]
    assert [e["param"] for e in errors] == ["prompt", "messages"]
    assert all(e["type"] == "context_length_exceeded" and "rollout.max_total_tokens" in e["message"] for e in errors)
    assert "1000000 characters, over the 2560" in errors[0]["message"]
    assert max(lags) < 0.5, max(lags)  # the loop kept turning (tokenizing 1 MB on it took seconds)
    assert encoded_in and all(name.startswith("relayrl-agent-text") for name in encoded_in)
    assert groups[0].trajectories[0].status is TrajectoryStatus.OK and len(sampler.sampled) == 1


def test_a_lone_surrogate_in_a_prompt_or_message_is_a_400_naming_the_field() -> None:
    """JSON's "\\ud800" parses to a string no tokenizer takes: it used to be a plain-text 500
    and a 72-line console traceback."""
    answers: list[httpx.Response] = []

    async def agent(ctx: AgentContext) -> float:
        headers = {"Authorization": f"Bearer {ctx.api_key}", "Content-Type": "application/json"}
        lone = "\udfff"
        bodies = [
            ("/completions", {"model": ctx.model, "prompt": "1+\ud800="}),
            ("/chat/completions", {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": lone}]}),
            ("/completions", {"model": ctx.model, "prompt": "1+1=", "stop": ["\ud800"]}),
        ]
        async with httpx.AsyncClient() as client:
            for path, body in bodies:
                content = json.dumps(body).encode()  # ASCII, the surrogate as its \\u escape
                answers.append(await client.post(ctx.base_url + path, content=content, headers=headers))
        await call(ctx)
        return 1.0

    groups, sampler = run(agent)
    assert [r.status_code for r in answers] == [400, 400, 400]
    errors = [r.json()["error"] for r in answers]
    assert [e["param"] for e in errors] == ["prompt", "messages.1.content", "stop.0"]
    assert all("lone surrogate" in e["message"] and e["type"] == "invalid_request_error" for e in errors)
    assert len(sampler.sampled) == 1 and groups[0].trajectories[0].status is TrajectoryStatus.OK


# -- agents ---------------------------------------------------------------------------------


def test_an_agent_that_swallows_its_cancellation_cannot_hang_the_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past rollout.agent_timeout_s the agent is cancelled; one that catches CancelledError and
    goes on used to keep the rollout waiting for ever (here: until the test releases it)."""
    monkeypatch.setattr(agent_tasks, "CANCEL_GRACE_S", 0.2)
    released = asyncio.Event()
    swallowed: list[int] = []

    async def agent(ctx: AgentContext) -> float:
        await call(ctx)
        while not released.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                swallowed.append(1)
        return 1.0

    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic)
    rollout = make_rollout(tok, agent, timeout_s=0.3)

    async def main() -> tuple[bool, list[Group]]:
        await rollout.endpoint.start()
        try:
            task = asyncio.create_task(rollout(SamplerSlot(0, sampler), requests_for(tok, PROMPT, 2)))
            done, _ = await asyncio.wait({task}, timeout=10)
            released.set()  # without the guard: lets the agent end, so that the test fails rather than hangs
            return bool(done), await task
        finally:
            await rollout.endpoint.stop()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AgentFailedWarning)
        ended, groups = asyncio.run(main())
    assert ended and swallowed
    assert [agent_failure_reason(t) for t in groups[0].trajectories] == ["timeout", "timeout"]


def test_tasks_an_agent_starts_end_with_its_episode() -> None:
    """A background task (and the task it starts) that calls the endpoint for ever used to run
    on after its episode, and after the rollout."""
    spawned: list[asyncio.Task[None]] = []
    refused: list[int] = []

    async def pester(ctx: AgentContext, depth: int) -> None:
        if depth == 0:
            spawned.append(asyncio.create_task(pester(ctx, 1)))
        while True:
            response = await post(ctx, {"model": ctx.model, "prompt": "1+1="})
            if response.status_code != 200:
                refused.append(response.status_code)
            await asyncio.sleep(0.01)

    async def agent(ctx: AgentContext) -> float:
        spawned.append(asyncio.create_task(pester(ctx, 0)))
        await call(ctx)
        return 1.0

    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic)
    rollout = make_rollout(tok, agent)
    left: list[asyncio.Task[Any]] = []
    factories: list[object] = []

    async def main() -> list[Group]:
        await rollout.endpoint.start()
        try:
            groups = await rollout(SamplerSlot(0, sampler), requests_for(tok, PROMPT, 2))
            await asyncio.sleep(0.1)  # time for a task left running to call again
            left.extend(t for t in asyncio.all_tasks() if t is not asyncio.current_task())
            factories.append(asyncio.get_running_loop().get_task_factory())
            return groups
        finally:
            await rollout.endpoint.stop()

    groups = asyncio.run(main())
    assert len(spawned) == 4 and all(t.cancelled() for t in spawned)
    assert not [t for t in left if t in spawned] and not refused  # no call after the episodes ended
    assert all(t.status is TrajectoryStatus.OK for t in groups[0].trajectories)
    assert factories == [None]  # the tracking is gone with the episodes


def test_an_agent_raising_cancelled_error_itself_fails_its_sample_only() -> None:
    """Its CancelledError (nobody cancelled it) used to end the rollout as if it were cancelled."""

    async def agent(ctx: AgentContext) -> float:
        await call(ctx)
        if ctx.sample_index == 0:
            raise asyncio.CancelledError()
        return 0.5

    groups, _ = run(agent, samples=2)
    first, second = groups[0].trajectories
    assert agent_failure_reason(first) == "raised" and "CancelledError (raised by the agent" in (first.error or "")
    assert second.status is TrajectoryStatus.OK and second.agent_reward == 0.5


def test_an_agent_raising_keyboard_interrupt_fails_the_run_in_one_line() -> None:
    """A KeyboardInterrupt out of a task breaks asyncio's loop: it used to escape the rollout
    with an ASGI traceback dump and tasks destroyed while pending."""

    async def agent(ctx: AgentContext) -> float:
        await call(ctx)
        raise KeyboardInterrupt

    try:
        run(agent, samples=2)
    except KeyboardInterrupt:
        pytest.fail("the agent's KeyboardInterrupt escaped the rollout")
    except AgentError as exc:
        message = str(exc)
    else:
        pytest.fail("the run went on")
    assert "\n" not in message and "raised KeyboardInterrupt" in message and "'p0'" in message


def test_what_an_agent_raises_or_returns_is_described_in_one_short_line() -> None:
    """An exception whose str() raises used to escape as the replica's failure; a huge message or
    number made a huge `error`; a returned coroutine was warned about when collected."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    async def inner() -> float:
        return 1.0

    async def agent(ctx: AgentContext) -> object:
        await call(ctx)
        if ctx.sample_index == 0:
            raise Unprintable()
        if ctx.sample_index == 1:
            raise ValueError("line\n" + "x" * 5000)
        if ctx.sample_index == 2:
            return 10**400
        return inner()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups, _ = run(agent, samples=4)
        gc.collect()
    errors = [t.error or "" for t in groups[0].trajectories]
    assert [agent_failure_reason(t) for t in groups[0].trajectories] == ["raised", "raised", "non_finite", "raised"]
    assert "Unprintable" in errors[0] and "ValueError: line xxx" in errors[1] and "returned a coroutine" in errors[3]
    assert all(len(e) < 450 and "\n" not in e for e in errors)
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_the_api_key_is_redacted_in_the_context_repr_and_in_every_error_recorded() -> None:
    """The context's repr held the token, and reached the trajectory log through an agent's error."""
    keys: list[str] = []
    reprs: list[str] = []

    async def agent(ctx: AgentContext) -> float:
        keys.append(ctx.api_key)
        reprs.append(repr(ctx))
        await call(ctx)
        if ctx.sample_index == 0:
            raise RuntimeError(f"could not use {ctx!r}")
        raise RuntimeError(f"{'x' * 270} key={ctx.api_key}")  # cut at ~300 characters: no part of the key stays

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups, _ = run(agent, samples=2)
    errors = [t.error or "" for t in groups[0].trajectories]
    said = " ".join(str(w.message) for w in caught)
    assert len(keys) == 2 and all(len(k) > 20 for k in keys)
    for key in keys:
        assert all(key[:12] not in text for text in [*errors, *reprs, said])
    assert all("<redacted>" in r for r in reprs) and "api_key='<redacted>'" in errors[0]
    assert [agent_failure_reason(t) for t in groups[0].trajectories] == ["raised", "raised"]


def test_an_absurd_agent_reward_fails_its_sample_and_counts_must_be_json_integers() -> None:
    """2**70 was accepted as a reward of 1.18e21, and n=true / n=1.0 as n=1."""
    answers: list[httpx.Response] = []

    async def agent(ctx: AgentContext) -> float:
        if ctx.sample_index == 0:
            for fields in ({"n": True}, {"n": 1.0}, {"max_tokens": 2.0}, {"stream": "yes"}):
                answers.append(await post(ctx, {"model": ctx.model, "prompt": "1+1=", **fields}))
        await call(ctx)
        return [2**70, -1.5e6, 1e6, 0.5][ctx.sample_index]

    groups, sampler = run(agent, samples=4)
    assert [r.status_code for r in answers] == [400] * 4
    assert [r.json()["error"]["param"] for r in answers] == ["n", "n", "max_tokens", "stream"]
    trajectories = groups[0].trajectories
    assert [agent_failure_reason(t) for t in trajectories] == ["non_finite", "non_finite", None, None]
    assert "out of range (|r| > 1e6)" in (trajectories[0].error or "") and "1180591620717411303424" in (trajectories[0].error or "")
    assert [t.agent_reward for t in trajectories[2:]] == [1e6, 0.5]
    assert len(sampler.sampled) == 4  # only the good calls


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("async def agent():\n    return 1.0\n", "cannot be called with one argument, ctx"),
        ("async def agent(ctx, other):\n    return 1.0\n", "missing a required argument: 'other'"),
        ("async def agent(ctx, *, key):\n    return 1.0\n", "missing a required keyword-only argument: 'key'"),
        ("async def agent(ctx):\n    yield 1.0\n", "an async generator function"),
    ],
)
def test_an_agent_that_cannot_be_called_with_ctx_is_refused_when_loaded(tmp_path: Path, source: str, message: str) -> None:
    """Such agents used to load, then fail every sample of the run with a TypeError."""
    path = tmp_path / "agent.py"
    path.write_text(source)
    with pytest.raises(UserError) as info:
        load_agent(f"{path}:agent")
    # (Python 3.11 says "required argument" where 3.12 says "required keyword-only argument")
    assert message.replace("keyword-only ", "") in str(info.value).replace("keyword-only ", "")
    assert "task.agent" in str(info.value) and "\n" not in str(info.value)


def test_an_agent_that_blocks_the_event_loop_is_named_in_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint and every agent share the run's loop: time.sleep in an agent stops them all,
    and other agents' timeouts fire late. It used to go unsaid; now the first such agent is named."""
    import time

    from relayrl.orchestrator.stages import agents as stage

    monkeypatch.setattr(stage, "BLOCKED_WARN_S", 0.3)  # well above what another agent's step takes on a busy machine

    async def agent(ctx: AgentContext) -> float:
        await call(ctx)
        if ctx.sample_index == 1:
            time.sleep(0.5)  # blocks the loop
        await asyncio.sleep(0.01)
        return 1.0

    with pytest.warns(stage.AgentBlockedWarning) as caught:
        groups, _ = run(agent, samples=3)
    blocked = [w for w in caught if issubclass(w.category, stage.AgentBlockedWarning)]
    held = re.search(r"sample 1 held the event loop for (\d+\.\d) s", str(blocked[0].message)) if len(blocked) == 1 else None
    assert held is not None and float(held.group(1)) >= 0.45  # its step ran at least the sleep (more on a busy machine)
    assert all(t.status is TrajectoryStatus.OK for t in groups[0].trajectories)
