"""The built-in environment `calculator`: integer questions with a calculator tool.

Job: an action containing a tool call `<calc>EXPR</calc>` (the first one counts) is answered with
`<result>VALUE</result>` plus `result_suffix` (a newline by default): reward 0, `tool_call`, and
the episode goes on. VALUE is an integer when the value is integral, else a decimal of at most six
places; a bad expression gives `<result>error: ...</result>`, and a call beyond `max_calls`
`<result>error: too many calls</result>`. An action without a tool call is the final answer,
scored as `arithmetic_feedback` scores its first turn: reward 1 and solved when its first integer
equals the prompt's answer, else 0; the episode ends. A tool call at the last turn
(`rollout.max_turns`) ends the episode unanswered (reward 0).

Invariants:
- EXPR is evaluated by walking its `ast` (never eval / exec / compile to code): only numbers
  (int, float), + - * / // % **, unary minus and plus, and parentheses. The expression's length,
  every constant, every intermediate value and every exponent are bounded before the operation
  that could exceed them runs, so no call takes more than microseconds or more than a few bytes.
- Observations use only characters of the shipped tiny model's tokenizer (no '_', no '%').
- The environment holds no per-episode state (see arithmetic_feedback.py).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.envs.arithmetic_feedback import action_integer, check_pick, integer_answer
from relayrl.envs.base import EnvStep
from relayrl.types import Prompt

__all__ = ["CalcError", "Calculator", "CalculatorEpisode", "evaluate", "format_value"]

#: longest expression evaluated (characters)
MAX_EXPRESSION_CHARS = 200
#: largest magnitude of any constant, intermediate value or result
MAX_MAGNITUDE = 10**15
#: largest magnitude of an exponent
MAX_EXPONENT = 64

_TOOL_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is what the policy
    reads after "error: "."""


def _bounded(value: object) -> Number:
    if isinstance(value, complex):
        raise CalcError("not a real number")
    if not isinstance(value, int | float):
        raise CalcError("unsupported expression")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("number too large")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError("number too large")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError("exponent too large")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE) + 1:
        raise CalcError("number too large")  # refused before computing it
    try:
        return _bounded(base**exponent)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("number too large") from None


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalcError("unsupported expression")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left = _eval(node.left)
        right = _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        fn = _BINARY.get(type(node.op))
        if fn is None:
            raise CalcError("unsupported expression")
        try:
            return _bounded(fn(left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("number too large") from None
    raise CalcError("unsupported expression")  # names, calls, attributes, subscripts, ...


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; a CalcError for anything else or out of bounds."""
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError("expression too long")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("invalid syntax") from None
    return _eval(tree)


def format_value(value: Number) -> str:
    """An integer when `value` is integral, else a decimal with at most six places."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


@dataclass(slots=True)
class CalculatorEpisode:
    """One episode: the answer, the turns taken and the tool calls made."""

    answer: int
    max_calls: int
    result_suffix: str
    max_turns: int
    pick: str = "first"
    turns: int = field(default=0)
    calls: int = field(default=0)

    def step(self, action: str) -> EnvStep:
        self.turns += 1
        call = _TOOL_CALL.search(action)
        if call is None:
            solved = action_integer(action, self.pick) == self.answer
            return EnvStep(None, reward=1.0 if solved else 0.0, solved=solved)
        self.calls += 1
        if self.turns >= self.max_turns:
            return EnvStep(None, tool_call=True)  # no turn left to read the result
        if self.calls > self.max_calls:
            result = "error: too many calls"
        else:
            try:
                result = format_value(evaluate(call.group(1)))
            except CalcError as exc:
                result = f"error: {exc}"
        return EnvStep(f"<result>{result}</result>{self.result_suffix}", tool_call=True)


class Calculator:
    """Integer questions with a `<calc>EXPR</calc>` tool (see the module docstring).

    Options (`task.environment_config`): `max_calls` (default 4): tool calls answered per
    episode; `result_suffix` (default a newline): appended to every `<result>...</result>`;
    `pick` ("first", default, or "last"): which integer of a final answer counts.
    `max_turns` comes from `rollout.max_turns`."""

    __slots__ = ("max_calls", "result_suffix", "max_turns", "pick")

    def __init__(self, *, max_turns: int, max_calls: int = 4, result_suffix: str = "\n", pick: str = "first") -> None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0:
            raise ValueError(f"max_calls must be an integer >= 0, got {max_calls!r}")
        if not isinstance(result_suffix, str):
            raise ValueError(f"result_suffix must be a string, got {result_suffix!r}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        self.max_calls = max_calls
        self.result_suffix = result_suffix
        self.max_turns = max_turns
        self.pick = check_pick(pick)

    def start(self, prompt: Prompt) -> CalculatorEpisode:
        return CalculatorEpisode(integer_answer(prompt, "calculator"), self.max_calls, self.result_suffix, self.max_turns, self.pick)
