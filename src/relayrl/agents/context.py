"""What an agent is given and how `task.agent` is resolved.

Job: `AgentContext` is the one argument of `async def agent(ctx) -> float | None`: `base_url` (the
episode's OpenAI-compatible base URL, ending in `/v1`), `api_key` (the episode's own key:
it opens that episode's URLs only), `model` (the
model name to send), `prompt` (the task's `Prompt`: text, answer, metadata) and `sample_index`
(0..G-1 within its group); its repr shows the key as `<redacted>`. `load_agent` imports a `task.agent` entry (`module:function` or
`file.py:function`, loaded as reward files are: rewards/registry.py).

Invariant: `load_agent` returns an async callable that takes one positional argument, or raises
one `UserError` naming `task.agent` and the entry; these field names are the interface users' agents depend on.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from relayrl.errors import UserError
from relayrl.rewards.registry import is_async, load_named
from relayrl.types import Prompt

__all__ = ["REDACTED", "AgentContext", "AgentFn", "load_agent", "redact"]


#: what stands for an API key in every repr and in every error relayrl records
REDACTED = "<redacted>"


@dataclass(slots=True, frozen=True, repr=False)
class AgentContext:
    base_url: str
    api_key: str
    model: str
    prompt: Prompt
    sample_index: int

    def __repr__(self) -> str:  # the key never reaches a log through a repr of the context
        return (
            f"AgentContext(base_url={self.base_url!r}, api_key={REDACTED!r}, model={self.model!r}, "
            f"prompt={self.prompt!r}, sample_index={self.sample_index!r})"
        )


def redact(text: str, keys: tuple[str, ...]) -> str:
    """`text` with every one of `keys` replaced by REDACTED."""
    for key in keys:
        if key:
            text = text.replace(key, REDACTED)
    return text


AgentFn = Callable[[AgentContext], Awaitable[object]]


def load_agent(spec: str) -> AgentFn:
    """The agent `spec` names (see the module)."""
    try:
        found = load_named(spec)
    except UserError as exc:
        raise UserError(f"task.agent = {spec!r}: {exc}") from None
    if not callable(found) or not is_async(found):
        if inspect.isasyncgenfunction(found):
            kind = "an async generator function (it yields)"
        else:
            kind = "a class" if inspect.isclass(found) else f"a {type(found).__name__}"
        raise UserError(f"task.agent = {spec!r} is {kind}, not an async function (async def agent(ctx) -> float | None)")
    try:
        signature: inspect.Signature | None = inspect.signature(found)
    except (TypeError, ValueError):  # some callables have none: the call will tell
        signature = None
    if signature is not None:
        try:
            signature.bind(object())
        except TypeError as exc:
            raise UserError(
                f"task.agent = {spec!r} cannot be called with one argument, ctx ({exc}): async def agent(ctx) -> float | None"
            ) from None
    return found
