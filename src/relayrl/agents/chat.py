"""The chat format of the endpoint: messages in (rendered by the model's chat template), tool calls out.

Job: `render` turns an OpenAI chat request's messages (and `tools`) into the text the model's
chat template makes of them, ready for the next assistant turn; `parse_tool_calls` finds the
Qwen2-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a completion
and returns them in the OpenAI format, with the text around them as the content.

Invariant: nothing here tokenizes; a message the template cannot render, or a request shape the
endpoint does not take, raises `ChatFormatError` naming the message and field (a 400).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["ChatFormatError", "ChatTemplate", "parse_tool_calls", "render"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ChatFormatError(ValueError):
    """A chat request the template cannot render; `param` names the field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ChatTemplate(Protocol):
    """What `render` needs of a tokenizer (a Hugging Face one)."""

    chat_template: object

    def apply_chat_template(self, conversation: list[dict[str, object]], **kwargs: object) -> object: ...


def _content(message: Mapping[str, object], i: int) -> str | None:
    """A message's content as text: a string, or a list of text parts joined (no images)."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"messages[{i}].content[{j}]: only text parts are supported", f"messages[{i}].content")
            texts.append(str(part["text"]))
        return "".join(texts)
    raise ChatFormatError(
        f"messages[{i}].content is a {type(content).__name__}, not a string or a list of text parts", f"messages[{i}].content"
    )


def _tool_calls(message: Mapping[str, object], i: int) -> list[dict[str, object]]:
    """An assistant message's tool calls as chat templates read them: arguments as an object
    (OpenAI sends them as a JSON string)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        raise ChatFormatError(f"messages[{i}].tool_calls is not a list", f"messages[{i}].tool_calls")
    out: list[dict[str, object]] = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatFormatError(f"messages[{i}].tool_calls[{j}] has no function name", f"messages[{i}].tool_calls")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise ChatFormatError(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", f"messages[{i}].tool_calls"
                ) from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


def normalize(messages: Sequence[object]) -> list[dict[str, object]]:
    """The request's messages as chat templates read them (see `_content`, `_tool_calls`)."""
    if not messages:
        raise ChatFormatError("messages is empty", "messages")
    out: list[dict[str, object]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatFormatError(f"messages[{i}] is not an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ChatFormatError(f"messages[{i}].role is {role!r}: not system, user, assistant or tool", f"messages[{i}].role")
        m: dict[str, object] = {"role": "system" if role == "developer" else role, "content": _content(message, i) or ""}
        if role == "assistant" and message.get("tool_calls"):
            m["tool_calls"] = _tool_calls(message, i)
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                m[key] = message[key]
        out.append(m)
    return out


def render(tokenizer: ChatTemplate, messages: Sequence[object], tools: Sequence[object] | None) -> str:
    """The chat template's text for `messages` (and `tools`), ending where the assistant's next turn begins."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatFormatError("the model has no chat template: use /v1/completions with a text prompt", "messages")
    conversation = normalize(messages)
    kwargs: dict[str, object] = {"add_generation_prompt": True, "tokenize": False}
    if tools:
        kwargs["tools"] = list(tools)
    try:
        text = tokenizer.apply_chat_template(conversation, **kwargs)
    except Exception as exc:  # the template's own error (jinja): the request's fault
        raise ChatFormatError(f"the chat template cannot render these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise ChatFormatError(f"the chat template returned a {type(text).__name__}, not text", "messages")
    return text


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, object]]]:
    """(content, tool_calls) of a completion: each `<tool_call>` block holding a JSON object with
    a "name" becomes an OpenAI tool call (arguments as a JSON string); a block that is not such
    JSON stays in the content. Content None when nothing but tool calls was said."""
    calls: list[dict[str, object]] = []
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            value = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            continue
        arguments = value.get("arguments", value.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{secrets.token_hex(8)}",
                "type": "function",
                "function": {"name": value["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
            }
        )
        kept.append(text[position : match.start()])
        position = match.end()
    kept.append(text[position:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls
