"""The chat format of the endpoint: messages in (rendered by the model's chat template), tool calls out.

Job: `render` turns an OpenAI chat request's messages (and `tools`) into the text the model's
chat template makes of them, ready for the next assistant turn; `parse_tool_calls` finds the
Qwen2-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a completion
and returns them in the OpenAI format, with the text around them as the content.

A template that ignores tools (`renders_tools` is False: e.g. SmolLM2's, which renders only each
message's role and content) gets them the Qwen2 way, in its own messages (`qwen2_tools`): the
tool schemas as a "# Tools" block at the end of the system message (a system message of its own
when the request has none) and an assistant message's tool calls as `<tool_call>` JSON blocks
after its content. Tool results stay `tool` messages (their content as sent) for the template to
render in its own role: SmolLM2-135M, shown three worked episodes, then calls the tool in 6 of 6
samples against 2 of 6 when they are Qwen2's user messages of `<tool_response>` blocks (it copies
the wrapper into its reply); a template that refuses the `tool` role gets Qwen2's form.
An assistant message whose tool calls the endpoint parsed from one reply, unchanged, is rendered
as that reply's text exactly (`replies`: tool-call id → reply text), so the next call continues
the sampled tokens (agents/transcript.py) however the model spaced its JSON.

Invariant: nothing here tokenizes; a message the template cannot render, or a request shape the
endpoint does not take, raises `ChatFormatError` naming the message and field (a 400).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["ChatFormatError", "ChatTemplate", "parse_tool_calls", "qwen2_tools", "render", "renders_tools"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Qwen2.5's tools block (its chat template's wording), appended to the system message
_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_PROBE = "relayrl_probe_tool"  # a tool name no template writes unless it renders the tools it is given


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


def renders_tools(tokenizer: ChatTemplate) -> bool:
    """Whether the chat template renders the `tools` it is given and an assistant message's
    `tool_calls` (else `render` gives them to it the Qwen2 way: see the module)."""
    tool = {"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}
    try:
        with_tools = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=[tool], tokenize=False)
        with_call = tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False
        )
    except Exception:  # a template that cannot take them does not render them
        return False
    return isinstance(with_tools, str) and isinstance(with_call, str) and _PROBE in with_tools and _PROBE in with_call


def _tool_call_text(call: Mapping[str, object]) -> str:
    function = call["function"]
    assert isinstance(function, Mapping)
    return (
        '<tool_call>\n{"name": ' + json.dumps(function["name"]) + ', "arguments": ' + json.dumps(function["arguments"]) + "}\n</tool_call>"
    )


def _reply_text(message: Mapping[str, object], replies: Mapping[str, str]) -> str | None:
    """The text of the reply an assistant message's tool calls were parsed from, when the message
    is that reply unchanged (same content, same calls in order); None otherwise."""
    calls = message["tool_calls"]
    assert isinstance(calls, list)
    texts = {replies.get(str(c.get("id"))) for c in calls}
    if len(texts) != 1 or None in texts:
        return None
    [text] = texts
    assert text is not None
    content, parsed = parse_tool_calls(text)
    same = [_name_and_arguments(c, decode=True) for c in parsed] == [_name_and_arguments(c, decode=False) for c in calls]
    return text if same and (content or "") == message.get("content", "") else None


def _name_and_arguments(call: Mapping[str, object], *, decode: bool) -> tuple[object, object]:
    function = call["function"]
    assert isinstance(function, Mapping)
    arguments = function["arguments"]
    return function["name"], json.loads(str(arguments)) if decode else arguments


def qwen2_tools(
    conversation: list[dict[str, object]],
    tools: Sequence[object] | None,
    replies: Mapping[str, str] | None = None,
    *,
    tool_role: bool = True,
) -> list[dict[str, object]]:
    """`conversation` (normalized) with `tools` and tool calls in plain messages the Qwen2 way, for
    a template that ignores them (see the module); tool results as `tool` messages of their
    content, or (`tool_role` False) as Qwen2's user messages of `<tool_response>` blocks."""
    out: list[dict[str, object]] = []
    responses = False  # the last message is a user message of tool responses
    for m in conversation:
        role, content = m["role"], str(m.get("content") or "")
        if role == "tool" and tool_role:
            out.append({"role": "tool", "content": content})
            responses = False
            continue
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if responses:
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
            responses = True
            continue
        responses = False
        if role == "assistant" and m.get("tool_calls"):
            text = _reply_text(m, replies or {})
            if text is None:
                calls = m["tool_calls"]
                assert isinstance(calls, list)
                text = "\n".join([content] * bool(content) + [_tool_call_text(c) for c in calls])
            out.append({"role": "assistant", "content": text})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")})
    if tools:
        block = _TOOLS_HEAD + "".join("\n" + json.dumps(t) for t in tools) + _TOOLS_TAIL
        if out and out[0]["role"] == "system":
            head = str(out[0]["content"])
            out[0] = {"role": "system", "content": f"{head}\n\n{block}" if head else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render(
    tokenizer: ChatTemplate,
    messages: Sequence[object],
    tools: Sequence[object] | None,
    *,
    native_tools: bool = True,
    replies: Mapping[str, str] | None = None,
) -> str:
    """The chat template's text for `messages` (and `tools`), ending where the assistant's next
    turn begins; `native_tools` False (`renders_tools`): tools the Qwen2 way (`qwen2_tools`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatFormatError("the model has no chat template: use /v1/completions with a text prompt", "messages")
    conversation = normalize(messages)
    kwargs: dict[str, object] = {"add_generation_prompt": True, "tokenize": False}
    if native_tools and tools:
        kwargs["tools"] = list(tools)
    tries = [conversation] if native_tools else [qwen2_tools(conversation, tools, replies, tool_role=r) for r in (True, False)]
    for i, attempt in enumerate(tries):
        try:
            text = tokenizer.apply_chat_template(attempt, **kwargs)
            break
        except Exception as exc:  # the template's own error (jinja): the request's fault
            if i + 1 == len(tries):
                raise ChatFormatError(f"the chat template cannot render these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise ChatFormatError(f"the chat template returned a {type(text).__name__}, not text", "messages")
    return text


def _arguments_json(arguments: object) -> str:
    """A parsed call's arguments as the JSON text OpenAI's format holds: a string that is JSON is
    kept, any other value (an object, or a string that is no JSON, e.g. a model's
    `"arguments": "2+3"`) is dumped, so the call is valid when the agent sends it back."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            return arguments
        except json.JSONDecodeError:
            pass
    return json.dumps(arguments)


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
                "function": {"name": value["name"], "arguments": _arguments_json(arguments)},
            }
        )
        kept.append(text[position : match.start()])
        position = match.end()
    kept.append(text[position:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls
