"""A tool-calling agent through /v1/chat/completions (`task.agent =
"examples/agents/tool_agent.py:agent"`), for a chat model: one whose template renders `tools` and
Qwen2-style `<tool_call>` blocks, or one whose template ignores tools (e.g. the SmolLM2 recipe's
model, with model.chat_template), which the endpoint gives them the Qwen2 way (agents/chat.py).

The policy is offered one tool, `calculate` (an arithmetic expression); each tool call it makes is
answered with the expression's value as a `tool` message and the conversation goes on, up to 4
calls. The episode ends at the first reply without a tool call: the agent returns None, so the
run's reward functions score that reply (the trajectory's completion_text). `make_agent` makes
one with another system prompt or worked examples before the question (a small model such as
SmolLM2-135M calls the tool only when shown how: tests/integration/test_agent_smollm2.py).
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "The value of an arithmetic expression (integers, + - * / and parentheses).",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of `expression`, or an error message the policy reads."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not an arithmetic expression")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(result)


def _expression(arguments: str) -> str:
    """The `expression` argument of a call (a model may write it badly: then the tool says so)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments
    return str(value.get("expression", "")) if isinstance(value, dict) else str(value)


SYSTEM = "Use the calculate tool, then reply with the number alone."


def make_agent(system: str = SYSTEM, examples: Sequence[Mapping[str, Any]] = ()) -> Callable[[Any], Awaitable[float | None]]:
    """The agent, with `system` as its system prompt and `examples` (chat messages, e.g. worked
    episodes) between it and the question."""

    async def agent(ctx: Any) -> float | None:
        # the endpoint is plain HTTP on loopback: no TLS, so no CA certificates to load (~70 ms a client)
        http = openai.DefaultAsyncHttpxClient(verify=False)
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, http_client=http) as client:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": system},
                *(dict(m) for m in examples),
                {"role": "user", "content": ctx.prompt.text},
            ]
            for _ in range(4):
                response = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
                message = response.choices[0].message
                if not message.tool_calls:
                    return None  # the reward functions score this reply
                calls = [c.model_dump() for c in message.tool_calls]
                messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(_expression(call.function.arguments))})
        return 0.0  # still calling tools after 4 calls

    return agent


agent = make_agent()
