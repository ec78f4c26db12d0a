"""A tool-calling agent through /v1/chat/completions (`task.agent =
"examples/agents/tool_agent.py:agent"`), for a chat model whose template renders `tools` and
Qwen2-style `<tool_call>` blocks (e.g. the SmolLM2 recipe's model, with model.chat_template).

The policy is offered one tool, `calculate` (an arithmetic expression); each tool call it makes is
answered with the expression's value as a `tool` message and the conversation goes on, up to 4
calls. The episode ends at the first reply without a tool call: the agent returns None, so the
run's reward functions score that reply (the trajectory's completion_text).
"""

from __future__ import annotations

import ast
import json
import operator
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


async def agent(ctx: Any) -> float | None:
    # the endpoint is plain HTTP on loopback: no TLS, so no CA certificates to load (~70 ms a client)
    http = openai.DefaultAsyncHttpxClient(verify=False)
    async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, http_client=http) as client:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "Use the calculate tool, then reply with the number alone."},
            {"role": "user", "content": ctx.prompt.text},
        ]
        for _ in range(4):
            response = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
            message = response.choices[0].message
            if not message.tool_calls:
                return None  # the reward functions score this reply
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [c.model_dump() for c in message.tool_calls]})
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments or "{}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(arguments.get("expression", "")))})
    return 0.0  # still calling tools after 4 calls
