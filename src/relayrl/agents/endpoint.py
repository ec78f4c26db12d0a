"""The OpenAI-compatible endpoint agents call: FastAPI, served by uvicorn on the run's event loop.

Job: `AgentEndpoint` listens on `rollout.agent_host`:`rollout.agent_port` (127.0.0.1 and a free
port by default) from `start()` to `stop()` (no task of its own: uvicorn's asyncio servers run on
the loop; no signal handler is installed). Each agent episode gets its own base URL,
`http://HOST:PORT/episodes/<id>/v1`, so its calls are attributed without the agent's help, and
serves `POST .../v1/completions` (a text prompt or token ids) and `POST .../v1/chat/completions`
(the model's chat template; `tools` in, Qwen2-style `<tool_call>` blocks out as `tool_calls`; a
template that ignores tools gets them the Qwen2 way: agents/chat.py),
each with `n`, `max_tokens` (capped by `rollout.max_new_tokens` and the episode's token room),
`stop`, `logprobs` (the sampled token's) and `stream` (server-sent events; the samplers do not
stream tokens, so each choice arrives as one chunk once sampled). A call's tokens come from
`agents/transcript.py`'s rule and are sampled by its episode's replica (the `sample` function the
agent stage opened the episode with) with that replica's current version (with
rollout.interruptible a load may land during the call: the choice keeps its tokens' version
segments); every choice is recorded in the episode's transcript.

Invariants:
- every request needs `Authorization: Bearer <its episode's key>` (401 otherwise, any path): an
  episode's key (`ctx.api_key`) is an HMAC of its id under a secret drawn per run, so it opens
  only that episode's URLs; a key cached or guessed from another episode, the secret itself or a
  path outside `/episodes/<id>/` is refused (401) before routing, and no agent can reach another
  episode's transcript;
- a request the endpoint cannot serve as asked gets a 4xx JSON error in OpenAI's shape naming the
  field (`param`), and nothing is sampled or recorded: an unknown or finished episode (404), one
  past its deadline (410), a malformed body, a `temperature` / `top_p` other than the run's
  (`rollout.temperature` / `rollout.top_p`: trained tokens must be sampled as the trainer scores
  them), penalties or logit biases, a `tool_choice` other than "auto" / "none", a context beyond
  the episode's token room, a prompt that encodes to no token, a string with a lone surrogate
  (JSON's `"\ud800"`: 400 naming the field, e.g. `messages.0.content`), a prompt (or messages'
  content) of more characters than the episode's tokens could hold (`max_total_tokens` × the
  longest token's characters: 400 `context_length_exceeded` naming the limit, checked before any
  rendering or tokenizing), a body over
  `max_body_bytes` (413), more than `max_n` choices being sampled at once for one episode (429:
  OpenAI clients retry it); an unknown path or method gets the same JSON shape (404, 405);
- a call answered after its episode closed (its agent returned, failed or timed out) is refused
  (410) and not recorded: a closed episode's transcript never changes;
- a call whose client disconnected before its choices are recorded (a client-side timeout, a
  cancelled agent task, a closed connection: checked once sampling returns, so before a stream
  starts) is not recorded (its answer reaches nobody; a retry of it is sampled and recorded as a
  call of its own). The auth check is a pure ASGI middleware so that the routes see the server's
  `receive`, hence the disconnect. The chain it sampled on keeps no trace in the transcript: a
  fresh chain stays unused (forgotten with the episode's), and a continued node's chain is
  continued by the next call as before; the replica's cache for that chain then covers tokens the
  next context does not start with, and the samplers reuse a cache only for a context it is a
  prefix of, so that call is prefilled afresh;
- nothing proportional to a request's size runs on the event loop past its JSON parsing: the chat
  template's rendering, tokenizing and decoding of a prompt run in the endpoint's own thread
  ("relayrl-agent-text", one call at a time: the tokenizer is not shared between threads).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import math
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relayrl.agents.chat import ChatFormatError, ChatTemplate, parse_tool_calls, render, renders_tools
from relayrl.agents.transcript import Choice, Start, Transcript
from relayrl.errors import UserError
from relayrl.threads import ThreadHost
from relayrl.types import Prompt, TurnRequest, TurnResult

__all__ = ["AgentEndpoint", "AgentEpisode", "EndpointError", "EndpointSettings", "SampleFn", "Tokenizer"]

T = TypeVar("T")

# samples one replica's turns: (requests) -> results in the same order (agents' stage batches them)
SampleFn = Callable[[list[TurnRequest]], Awaitable[list[TurnResult]]]


class Tokenizer(ChatTemplate, Protocol):
    """What the endpoint needs of the model's tokenizer (a Hugging Face one)."""

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, Any]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def __len__(self) -> int: ...


@dataclass(slots=True, frozen=True, kw_only=True)
class EndpointSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    model: str = "policy"  # the model name agents send (ctx.model)
    max_new_tokens: int = 8  # rollout.max_new_tokens: per call, at most
    max_total_tokens: int = 128  # an episode's sequence (context and sampled), at most
    temperature: float = 1.0
    top_p: float = 1.0
    max_n: int = 16  # choices per call, at most, and choices being sampled at once per episode
    max_body_bytes: int = 16 * 2**20  # a request's body, at most (413 beyond)


@dataclass(slots=True, eq=False)
class AgentEpisode:
    """One agent's episode as the endpoint serves it."""

    id: str
    prompt: Prompt
    sample: SampleFn
    rng_key: str
    deadline: float  # the loop's clock; math.inf: none
    base_url: str
    api_key: str = field(repr=False)  # its key (ctx.api_key): opens this episode's URLs only
    transcript: Transcript = field(default_factory=Transcript)
    open: bool = True
    calls: int = 0
    replies: dict[str, str] = field(default_factory=dict)  # tool-call id -> the text of the reply it was parsed from
    in_flight: int = 0  # choices being sampled for its calls now

    def sampler_key(self, chain: int) -> str:
        """The sampler's episode name of a KV-cache chain."""
        return f"agent/{self.id}/{chain}"


class EndpointError(UserError):
    """The endpoint cannot listen where rollout.agent_host / agent_port say (one line)."""


class HTTPFailure(Exception):
    """A request refused: status, message, the field at fault (OpenAI's `param`), error type."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


class _Guard:
    """Pure ASGI middleware: an HTTP request without `Authorization: Bearer <the key of the episode
    its path names>` gets 401 in OpenAI's shape (checked in constant time, before routing: any path), and one whose body is
    over `max_body` bytes 413 (by its Content-Length before it is read, else as it is read). A
    pure one, not Starlette's `BaseHTTPMiddleware`, so that the routes' `Request` reads the
    server's own `receive` and sees the client disconnect (`Request.is_disconnected`)."""

    def __init__(self, app: ASGIApp, key: Callable[[str], str], max_body: int) -> None:
        self.app = app
        self.key = key
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        parts = str(scope.get("path", "")).split("/")
        # the key of the episode the path names (none outside /episodes/<id>/: no key opens those)
        expected = self.key(parts[2]) if len(parts) > 3 and parts[1] == "episodes" and parts[2] else ""
        if scheme.lower() != "bearer" or not expected or not secrets.compare_digest(token.strip().encode(), expected.encode()):
            refused = _error(401, "missing or wrong API key: send Authorization: Bearer <ctx.api_key>", None, "authentication_error")
            await refused(scope, receive, send)
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            await _error(413, f"the body is over {self.max_body} bytes", None, "invalid_request_error")(scope, receive, send)
            return
        read = 0

        async def limited() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_body:  # a body sent without its length: refused as it is read
                raise StarletteHTTPException(413, f"the body is over {self.max_body} bytes")
            return message

        await self.app(scope, limited, send)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    # counts are JSON integers (StrictInt): true or 1.0 is no n
    n: StrictInt = Field(1, ge=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Common):
    prompt: str | list[StrictInt]  # token ids as JSON integers: "5" or true is no token id
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None


class ChatBody(_Common):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)


@dataclass(slots=True)
class _Answered:
    """One choice as answered: its node's choice, the text the agent gets, why it ended."""

    choice: Choice
    text: str
    finish_reason: str


class AgentEndpoint:
    """The endpoint (see the module). `open` an episode per agent call, `close` it when done."""

    def __init__(self, settings: EndpointSettings, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.token = secrets.token_urlsafe(24)  # the run's secret: episodes' keys derive from it, it opens nothing itself
        self._tok = tokenizer
        self._episodes: dict[str, AgentEpisode] = {}
        self._counter = 0
        self._server: uvicorn.Server | None = None
        self._socket: socket.socket | None = None
        self.port = 0
        self._native_tools: bool | None = None  # whether the chat template renders tools (agents/chat.py)
        self._longest: int | None = None  # the longest token's characters (the prompt bound's unit)
        self._text: ThreadHost | None = None  # renders and tokenizes off the loop while started
        self.app = self._build_app()

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Listen (uvicorn's servers on the running loop)."""
        s = self.settings
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        # proto IPPROTO_TCP: asyncio then sets TCP_NODELAY on the accepted connections (with proto 0
        # it does not, and every response waits ~40 ms for the client's delayed ACK)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((s.host, s.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise EndpointError(
                f"the agents' endpoint cannot listen on {s.host}:{s.port} (rollout.agent_host / agent_port): {exc}"
            ) from None
        config = uvicorn.Config(self.app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=2, ws="none")
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        self._server, self._socket = server, sock
        self._text = ThreadHost("agent-text")
        self.port = int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop listening; open connections are closed (running requests get 2 s to finish)."""
        server, sock = self._server, self._socket
        self._server = self._socket = None
        for episode in self._episodes.values():
            episode.open = False
        try:
            if server is not None and sock is not None:
                await server.shutdown(sockets=[sock])
        finally:
            text, self._text = self._text, None
            if text is not None:
                await text.aclose()

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"http://{host}:{self.port}"

    # -- episodes -----------------------------------------------------------------------
    def key(self, eid: str) -> str:
        """Episode `eid`'s API key (`ctx.api_key`): HMAC-SHA256 of its id under the run's secret, so
        that it opens that episode's URLs only (see the module)."""
        digest = hmac.new(self.token.encode(), eid.encode(), hashlib.sha256).digest()
        return "rl-" + base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def open(self, name: str, prompt: Prompt, sample: SampleFn, rng_key: str, timeout_s: float = 0.0) -> AgentEpisode:
        """A new episode whose calls `sample` serves, refused after `timeout_s` (0: never)."""
        self._counter += 1
        eid = f"{name.replace('/', '-')}-{self._counter}"
        deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s > 0 else math.inf
        episode = AgentEpisode(eid, prompt, sample, rng_key, deadline, f"{self.url}/episodes/{eid}/v1", self.key(eid))
        self._episodes[eid] = episode
        return episode

    def close(self, episode: AgentEpisode) -> None:
        """The episode is over: later calls get 410, a call still being sampled is not recorded."""
        episode.open = False
        self._episodes.pop(episode.id, None)

    # -- the app ------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # no such path or method, a body too large
            return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, "invalid_request_error")

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            if first.get("type") == "json_invalid":  # its loc is a character position, not a field
                at = [p for p in first.get("loc", ()) if isinstance(p, int)]
                where = f" (at character {at[0]})" if at else ""
                return _error(400, f"the body is not valid JSON{where}", None, "invalid_request_error")
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            param = ".".join(loc) or None
            return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param, "invalid_request_error")

        @app.exception_handler(HTTPFailure)
        async def _refused(request: Request, exc: HTTPFailure) -> JSONResponse:
            return _error(exc.status, str(exc), exc.param, exc.kind)

        app.add_middleware(_Guard, key=self.key, max_body=self.settings.max_body_bytes)

        @app.get("/episodes/{eid}/v1/models")
        async def _models(eid: str) -> dict[str, object]:
            self._episode(eid)
            return {"object": "list", "data": [{"id": self.settings.model, "object": "model", "owned_by": "relayrl"}]}

        @app.post("/episodes/{eid}/v1/completions", response_model=None)
        async def _completions(eid: str, body: CompletionBody, request: Request) -> Any:
            return await self._complete(self._episode(eid), body, request)

        @app.post("/episodes/{eid}/v1/chat/completions", response_model=None)
        async def _chat(eid: str, body: ChatBody, request: Request) -> Any:
            return await self._chat(self._episode(eid), body, request)

        return app

    def _episode(self, eid: str) -> AgentEpisode:
        episode = self._episodes.get(eid)
        if episode is None:
            raise HTTPFailure(404, f"no episode {eid!r} is running (unknown, or over)", None, "not_found_error")
        if not episode.open or asyncio.get_running_loop().time() > episode.deadline:
            raise HTTPFailure(410, f"episode {eid!r} is past its deadline (rollout.agent_timeout_s)", None, "episode_over")
        return episode

    def _check_common(self, body: _Common) -> tuple[int, list[str]]:
        """(max new tokens asked, stop strings) once the sampling fields are checked."""
        s = self.settings
        for name in ("prompt", "messages", "tools", "stop"):  # (a token-id prompt holds no string)
            value = getattr(body, name, None)
            where = _not_text(value, name) if not (name == "prompt" and isinstance(value, list)) else None
            if where is not None:  # JSON's "\ud800": no tokenizer or template can take it
                raise HTTPFailure(400, f"{where}: a lone surrogate (\\ud800-\\udfff) is not text: send valid UTF-16 pairs", where)
        if body.model != s.model:
            raise HTTPFailure(400, f"model is {body.model!r}: this endpoint serves {s.model!r} (ctx.model)", "model")
        for name, value, run in (("temperature", body.temperature, s.temperature), ("top_p", body.top_p, s.top_p)):
            if value is not None and not math.isclose(value, run, rel_tol=1e-6, abs_tol=1e-9):
                raise HTTPFailure(
                    400,
                    f"{name} = {value} differs from the run's rollout.{name} = {run}: trained tokens are sampled as the trainer "
                    f"scores them; omit {name} or send {run}",
                    name,
                )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise HTTPFailure(400, f"{name} is not supported (it changes the sampling distribution the trainer scores)", name)
        if body.logit_bias:
            raise HTTPFailure(400, "logit_bias is not supported (it changes the sampling distribution the trainer scores)", "logit_bias")
        if body.n > s.max_n:
            raise HTTPFailure(400, f"n = {body.n}: at most {s.max_n} choices per call", "n")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not x for x in stops):
            raise HTTPFailure(400, "stop: at most 4 non-empty strings", "stop")
        asked = body.max_completion_tokens or body.max_tokens or s.max_new_tokens
        return min(asked, s.max_new_tokens), stops

    def _encode(self, text: str) -> list[int]:
        ids = self._tok(text, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` in the endpoint's text thread (on the caller's thread before `start`)."""
        host = self._text
        return fn() if host is None else await host.call(fn)

    async def _bound_chars(self, chars: int, param: str) -> None:
        """Refuse (400) a prompt of more characters than the episode's tokens could hold, before
        anything renders or tokenizes it."""
        if self._longest is None:
            self._longest = await self._off_loop(self._longest_token)
        total = self.settings.max_total_tokens
        limit = total * self._longest
        if chars > limit:
            raise HTTPFailure(
                400,
                f"{param}: {chars} characters, over the {limit} an episode's {total} tokens can hold "
                f"(rollout.max_total_tokens × {self._longest} characters, the longest token's): not tokenized",
                param,
                "context_length_exceeded",
            )

    def _longest_token(self) -> int:
        """The most characters one token stands for (its vocabulary string's: bytes for byte-level BPE)."""
        pieces = self._tok.convert_ids_to_tokens(list(range(len(self._tok))))
        return max((len(p) for p in pieces if isinstance(p, str)), default=1) or 1

    async def _context(self, episode: AgentEpisode, text: str) -> Start:
        """`Transcript.context` with the tokenizing off the loop (the node search and chain stay on it)."""
        transcript = episode.transcript
        parent = transcript.parent_of(text)
        new = transcript.new_text(text, parent)
        ids = await self._off_loop(lambda: self._encode(new)) if new else []
        # a node recorded meanwhile that `text` also continues is no better a parent: nodes only grow
        return transcript.start(parent, text, ids)

    async def _complete(self, episode: AgentEpisode, body: CompletionBody, request: Request) -> Any:
        max_new, stops = self._check_common(body)
        if body.echo:
            raise HTTPFailure(400, "echo is not supported", "echo")
        if body.best_of not in (None, 1):
            raise HTTPFailure(400, "best_of is not supported (use n)", "best_of")
        if body.suffix:
            raise HTTPFailure(400, "suffix is not supported", "suffix")
        prompt = body.prompt
        if not prompt:
            raise HTTPFailure(400, "prompt is empty", "prompt")
        if isinstance(prompt, list):  # token ids: the context as sent, never re-tokenised
            total = self.settings.max_total_tokens
            if len(prompt) >= total:
                raise HTTPFailure(
                    400,
                    f"prompt: {len(prompt)} token ids leave no room for a completion within the episode's {total} tokens "
                    "(rollout.max_total_tokens, the model's context)",
                    "prompt",
                    "context_length_exceeded",
                )
            if any(i < 0 or i >= len(self._tok) for i in prompt):
                raise HTTPFailure(400, f"prompt: token ids must lie in [0, {len(self._tok)})", "prompt")
            ids = [int(i) for i in prompt]
            start = episode.transcript.context_ids(ids, lambda x: self._tok.decode(x, skip_special_tokens=False))
            text = self._tok.decode(ids, skip_special_tokens=False)
        else:
            text = prompt
            await self._bound_chars(len(text), "prompt")
            start = await self._context(episode, text)
        answered = await self._sample(episode, start, body.n, max_new, stops, request)
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        choices = []
        for i, a in enumerate(answered):
            logprobs = None
            if body.logprobs is not None:
                pieces = self._tok.convert_ids_to_tokens(a.choice.tokens)
                offsets, at = [], len(text)
                for piece in pieces:
                    offsets.append(at)
                    at += len(piece)
                logprobs = {
                    "tokens": pieces,
                    "token_logprobs": list(a.choice.logprobs),
                    "top_logprobs": [{p: lp} for p, lp in zip(pieces, a.choice.logprobs, strict=True)],
                    "text_offset": offsets,
                }
            choices.append(
                {
                    "index": i,
                    "text": a.text,
                    "finish_reason": a.finish_reason,
                    "logprobs": logprobs,
                    "token_ids": a.choice.tokens,
                    "policy_version": a.choice.policy_version,
                }
            )
        usage = _usage(start, answered)
        if not body.stream:  # plain JSON values: sent as they are (FastAPI's encoder would walk every value again)
            head = {"id": rid, "object": "text_completion", "created": created, "model": self.settings.model}
            return JSONResponse({**head, "choices": choices, "usage": usage})
        chunks: list[dict[str, object]] = []
        for c in choices:
            chunks.append({**c, "finish_reason": None})
            chunks.append({"index": c["index"], "text": "", "finish_reason": c["finish_reason"], "logprobs": None})
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.settings.model}
        return _sse([{**head, "choices": [chunk]} for chunk in chunks])

    async def _chat(self, episode: AgentEpisode, body: ChatBody, request: Request) -> Any:
        max_new, stops = self._check_common(body)
        if body.tool_choice not in (None, "auto", "none"):
            raise HTTPFailure(
                400,
                f"tool_choice = {body.tool_choice!r} is not supported: the policy's tokens are sampled as they come "
                "(send 'auto' or 'none')",
                "tool_choice",
            )
        await self._bound_chars(_content_chars(body.messages), "messages")
        if self._native_tools is None and getattr(self._tok, "chat_template", None):
            tok = self._tok
            self._native_tools = await self._off_loop(lambda: renders_tools(tok))
        native, replies, messages, tools = self._native_tools is not False, dict(episode.replies), body.messages, body.tools
        try:
            text = await self._off_loop(lambda: render(self._tok, messages, tools, native_tools=native, replies=replies))
        except ChatFormatError as exc:
            raise HTTPFailure(400, str(exc), exc.param) from None
        parse = bool(body.tools) and body.tool_choice != "none"
        start = await self._context(episode, text)
        answered = await self._sample(episode, start, body.n, max_new, stops, request)
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        choices: list[dict[str, Any]] = []
        for i, a in enumerate(answered):
            content: str | None = a.text
            calls: list[dict[str, object]] = []
            if parse:
                content, calls = parse_tool_calls(a.text)
                episode.replies.update((str(call["id"]), a.choice.text) for call in calls)
            message: dict[str, object] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            logprobs = None
            if body.logprobs:
                pieces = self._tok.convert_ids_to_tokens(a.choice.tokens)
                logprobs = {
                    "content": [
                        {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(pieces, a.choice.logprobs, strict=True)
                    ]
                }
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": "tool_calls" if calls else a.finish_reason,
                    "logprobs": logprobs,
                    "token_ids": a.choice.tokens,
                    "policy_version": a.choice.policy_version,
                }
            )
        usage = _usage(start, answered)
        if not body.stream:  # plain JSON values: sent as they are (FastAPI's encoder would walk every value again)
            head = {"id": rid, "object": "chat.completion", "created": created, "model": self.settings.model}
            return JSONResponse({**head, "choices": choices, "usage": usage})
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.settings.model}
        events: list[dict[str, object]] = []
        for c in choices:
            m = c["message"]
            delta: dict[str, object] = {"role": "assistant", "content": m["content"]}
            if "tool_calls" in m:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(m["tool_calls"])]
            events.append({**head, "choices": [{"index": c["index"], "delta": delta, "finish_reason": None, "logprobs": c["logprobs"]}]})
            events.append({**head, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"], "logprobs": None}]})
        return _sse(events)

    async def _sample(
        self, episode: AgentEpisode, start: Start, n: int, max_new: int, stops: Sequence[str], request: Request
    ) -> list[_Answered]:
        """Sample `n` choices from `start`'s context on the episode's replica and record them (see the
        module), unless the episode closed or `request`'s client disconnected meanwhile."""
        s = self.settings
        if not start.context:  # e.g. only characters the tokenizer drops: the sampler needs a token to start from
            raise HTTPFailure(400, "the prompt encodes to no tokens (the tokenizer drops every character of it)", "prompt")
        room = s.max_total_tokens - len(start.context)
        if room < 1:
            raise HTTPFailure(
                400,
                f"the context has {len(start.context)} tokens: no room for a completion within the episode's "
                f"{s.max_total_tokens} tokens (rollout.max_total_tokens, the model's context)",
                None,
                "context_length_exceeded",
            )
        max_new = min(max_new, room)
        if episode.in_flight + n > s.max_n:
            raise HTTPFailure(
                429,
                f"episode {episode.id!r} has {episode.in_flight} choices being sampled: at most {s.max_n} at once "
                f"(the n of its concurrent calls together); retry when one is answered",
                "n",
                "rate_limit_exceeded",
            )
        episode.calls += 1
        chains = [start.chain] + [episode.transcript.new_chain() for _ in range(n - 1)]
        asks = [
            TurnRequest(
                episode=episode.sampler_key(chain),
                context=start.context,
                rng_key=f"{episode.rng_key}\x00{episode.calls}\x00{j}",
                max_new_tokens=max_new,
                prompt=episode.prompt,
            )
            for j, chain in enumerate(chains)
        ]
        episode.in_flight += n
        try:
            results = await episode.sample(asks)
        except Exception as exc:  # the replica failed (the sampler stage handles it) or the rollout ended
            if not episode.open:
                raise HTTPFailure(
                    410, f"episode {episode.id!r} ended while this call was sampled: not recorded", None, "episode_over"
                ) from None
            raise HTTPFailure(500, f"sampling failed: {exc}", None, "server_error") from None
        finally:
            episode.in_flight -= n
        if not episode.open:
            raise HTTPFailure(410, f"episode {episode.id!r} ended while this call was sampled: not recorded", None, "episode_over")
        if await request.is_disconnected():  # nobody gets this answer: recording it would train what the agent never saw
            raise HTTPFailure(
                499, f"the client of episode {episode.id!r} disconnected while this call was sampled: not recorded", None, "client_closed"
            )
        answered = []
        for chain, result in zip(chains, results, strict=True):
            a = self._answer(result, stops)
            episode.transcript.record(start, a.choice, chain)
            answered.append(a)
        return answered

    def _answer(self, result: TurnResult, stops: Sequence[str]) -> _Answered:
        """A sampled completion cut at its first stop string (the tokens up to the one completing it
        are kept and trained), the text the agent gets, and the node's choice."""
        c = result.completion
        tokens, logprobs = list(c.tokens), list(c.logprobs)
        decode = self._tok.decode
        full = decode(tokens, skip_special_tokens=False)
        cut = min(((full.find(x), x) for x in stops if x in full), default=None)
        if cut is not None:
            at, stop = cut
            keep = next(k for k in range(1, len(tokens) + 1) if len(decode(tokens[:k], skip_special_tokens=False)) >= at + len(stop))
            tokens, logprobs = tokens[:keep], logprobs[:keep]
            text = decode(tokens, skip_special_tokens=False)
            versions = _cut(c.versions, keep)
            choice = Choice(tokens, logprobs, text, "stop", result.policy_version, result.replica, False, versions)
            return _Answered(choice, full[:at], "stop")
        on_stop = c.finish_reason == "stop" and bool(tokens)
        text = decode(tokens[:-1], skip_special_tokens=False) if on_stop else full
        finish: Literal["stop", "length"] = "stop" if c.finish_reason == "stop" else "length"
        choice = Choice(tokens, logprobs, text, finish, result.policy_version, result.replica, on_stop, c.versions)
        return _Answered(choice, text, finish)


def _not_text(value: object, at: str) -> str | None:
    """Where in `value` (a JSON value at `at`) a string holds a lone surrogate, if anywhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return at
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _not_text(key, at) is not None:
            return at
        found = _not_text(item, f"{at}.{key}")
        if found is not None:
            return found
    return None


def _content_chars(messages: Sequence[object]) -> int:
    """The characters of the messages' contents (a string, or parts with a `text`): a lower bound
    on the rendered prompt's."""
    chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return chars


def _cut(versions: list[tuple[int, int]] | None, keep: int) -> list[tuple[int, int]] | None:
    """A completion's version segments over its first `keep` tokens (None: a single version)."""
    if versions is None:
        return None
    kept = [(first, version) for first, version in versions if first < keep]
    return kept if len(kept) > 1 else None


def _usage(start: Start, answered: Sequence[_Answered]) -> dict[str, int]:
    completion = sum(len(a.choice.tokens) for a in answered)
    return {"prompt_tokens": len(start.context), "completion_tokens": completion, "total_tokens": len(start.context) + completion}


def _sse(events: Sequence[Mapping[str, object]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
