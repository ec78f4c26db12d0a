"""Tools for a chat template that ignores them (agents/chat.py): SmolLM2's template renders only
each message's role and content, so the endpoint gives it the tools and the tool calls the Qwen2
way (tool results in the template's own `tool` role, or Qwen2's form when it refuses that role),
and renders a reply it parsed tool calls from as the reply's own text."""

from __future__ import annotations

import json
from typing import Any

from relayrl.agents.chat import parse_tool_calls, render, renders_tools
from support.agentutil import chat_tokenizer, tiny_tokenizer, tokenizer_of

# SmolLM2-135M-Instruct's chat template (its GGUF's tokenizer.chat_template)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object", "properties": {}}}}]


def smollm2_like() -> Any:
    tok = tiny_tokenizer()
    tok.chat_template = SMOLLM2_TEMPLATE
    return tok


def test_a_template_that_ignores_tools_is_told_apart_from_one_that_renders_them() -> None:
    assert renders_tools(tokenizer_of(chat_tokenizer()))  # the tests' Qwen2-style template
    assert not renders_tools(smollm2_like())
    tok = smollm2_like()
    plain = [{"role": "user", "content": "hi"}]
    assert render(tok, plain, TOOLS) == render(tok, plain, None)  # natively, the tools would be lost


def test_tools_calls_and_results_are_rendered_the_qwen2_way_for_such_a_template() -> None:
    tok = smollm2_like()
    reply = '<tool_call>{"name":"calculate",  "arguments": {"expression":"2+3"}}</tool_call>'  # spaced as the model spaced it
    content, [call] = parse_tool_calls(reply)
    assistant = {"role": "assistant", "content": content, "tool_calls": [call]}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        assistant,
        {"role": "tool", "tool_call_id": call["id"], "content": "5"},
        {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
    ]
    first = render(tok, messages[:2], TOOLS, native_tools=False)
    assert first.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and json.dumps(TOOLS[0]) in first
    assert first.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    text = render(tok, messages, TOOLS, native_tools=False, replies={str(call["id"]): reply})
    # the reply's own text: the next call continues the sampled tokens
    assert text.startswith(first + reply + "<|im_end|>\n")
    assert text.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n")
    # a template that refuses the tool role gets Qwen2's user message of tool responses
    strict = smollm2_like()
    strict.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}{% endfor %}" + SMOLLM2_TEMPLATE
    )
    assert render(strict, messages, TOOLS, native_tools=False).endswith(
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # a call the endpoint did not parse (or one the agent changed) is written in Qwen2's form
    canonical = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert first + canonical + "<|im_end|>" in render(tok, messages, TOOLS, native_tools=False)
    changed = [
        *messages[:2],
        {**assistant, "tool_calls": [{**call, "function": {"name": "calculate", "arguments": '{"expression": "3+2"}'}}]},
    ]
    assert reply not in render(tok, changed, TOOLS, native_tools=False, replies={str(call["id"]): reply})
    # without a system message, the tools block is one
    assert render(tok, messages[1:2], TOOLS, native_tools=False).startswith("<|im_start|>system\n# Tools\n")


def test_a_call_whose_arguments_are_no_json_is_answered_as_json_and_accepted_back() -> None:
    tok = smollm2_like()
    reply = '<tool_call>{"name": "calculate", "arguments": "2+3"}</tool_call>'  # a small model's arguments: a bare string
    _, [call] = parse_tool_calls(reply)
    function = call["function"]
    assert isinstance(function, dict) and json.loads(function["arguments"]) == "2+3"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "5"},
    ]
    text = render(tok, messages, TOOLS, native_tools=False, replies={str(call["id"]): reply})  # sent back unchanged: no 400
    assert reply + "<|im_end|>" in text
