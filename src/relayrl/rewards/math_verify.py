"""The `math_verify` reward: mathematical equivalence of a completion's final answer and the
prompt's answer, by the math-verify package (the `tasks` extra), for LaTeX / boxed answers.

Job: parse the prompt's answer (the gold) and the completion with `math_verify.parse` and compare
them with `math_verify.verify`: "\\boxed{\\frac{1}{2}}" matches "0.5", "$(x+1)^2$" matches
"x^2+2x+1". Works with JSONL math prompts (`answer` holds the gold, plain or LaTeX) and any task
whose answers are mathematical.

Invariants:
- The reward is 1.0 or 0.0, and any text gives one: a gold or completion that cannot be parsed,
  or a comparison that fails inside math-verify, is 0.0, never an exception. (Only a missing
  package raises: a configuration error, not a wrong answer.)
- No signals: math-verify's own time limits use `signal.alarm`, which works only in the main
  thread, so they are off here; the reward runs the same in the scoring thread, a worker process
  or the main thread. Instead, numbers too large to compare (power towers such as 9^{9^{9^9}},
  huge factorials), on which sympy would compute for ever, are refused up front (0.0). That is not
  a bound on time for every pathological input (sympy can still take for ever on some LaTeX): the
  bound is the reward isolation's job. The built-in name `math_verify` (rewards/registry.py
  OPTIONAL_REWARDS) runs this function in the reward worker processes, each call killed at
  `task.reward_timeout_s` (a timeout, not a hung run); passed to the Python API as a callable it
  runs in a reward call thread under the same deadline (abandoned at it, not killed).
"""

from __future__ import annotations

import logging
import math
import threading
from types import ModuleType
from typing import Any

from relayrl.types import Trajectory

#: numbers with more decimal digits than this are not compared (sympy would take for ever)
MAX_DIGITS = 10_000
#: a completion longer than this is not re-read as one bare LaTeX expression
_MAX_BARE_CHARS = 200
_DELIMITERS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")

_setup_lock = threading.Lock()
_module: ModuleType | None = None


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns once per process that its timeouts are off: that is deliberate here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _package() -> ModuleType:
    global _module
    if _module is None:
        with _setup_lock:
            if _module is None:
                try:
                    import math_verify as mv
                except ModuleNotFoundError:
                    raise ModuleNotFoundError(
                        "the math_verify reward needs the Python package 'math_verify', which is not installed; "
                        "install the 'tasks' extra: pip install 'relayrl[tasks]'"
                    ) from None
                for name in ("math_verify.parser", "math_verify.grader"):
                    logging.getLogger(name).addFilter(_DropTimeoutNotice())
                _module = mv
    return _module


def _parse(text: str) -> list[Any]:
    try:
        return list(_package().parse(text, parsing_timeout=None))
    except ModuleNotFoundError:
        raise
    except Exception:  # math-verify catches its own errors; anything else is a parse failure too
        return []


def _has_expression(parsed: list[Any]) -> bool:
    import sympy

    return any(isinstance(p, sympy.Basic | sympy.MatrixBase) for p in parsed)


def _delimited(text: str) -> bool:
    return any(d in text for d in _DELIMITERS)


def parse_gold(answer: str) -> list[Any]:
    """The gold answer parsed; a bare one ("x^2+2x+1", "\\frac{1}{2}", "0.5") is read as LaTeX
    math, as if written between dollars."""
    answer = answer.strip()
    if not answer:
        return []
    if not _delimited(answer):
        parsed = _parse(f"${answer}$")
        if _has_expression(parsed):
            return parsed
    return _parse(answer)


def parse_completion(completion: str) -> list[Any]:
    """The completion's answer parsed (math-verify's extraction: the boxed or last expression);
    a short completion in which it finds nothing is read again as one bare LaTeX expression."""
    parsed = _parse(completion)
    bare = completion.strip()
    if not _has_expression(parsed) and bare and len(bare) <= _MAX_BARE_CHARS and not _delimited(bare):
        again = _parse(f"${bare}$")
        if _has_expression(again):
            return again
    return parsed


def _digits(value: Any) -> float:
    """An upper estimate of the decimal digits of a numeric sympy expression (inf if unknown)."""
    import sympy

    try:
        magnitude = abs(complex(sympy.N(value, 15)))
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return math.inf
    if math.isnan(magnitude) or math.isinf(magnitude):
        return math.inf
    return math.log10(magnitude) + 1 if magnitude > 1 else 1.0


def too_large(parsed: list[Any]) -> bool:
    """Whether an expression holds a number too large to compare: a power of numbers or a
    factorial whose result would have more than MAX_DIGITS digits."""
    import sympy

    for item in parsed:
        if not isinstance(item, sympy.Basic):
            continue
        for node in sympy.preorder_traversal(item):
            if isinstance(node, sympy.Pow) and node.base.is_number and node.exp.is_number:
                base_digits, exp_digits = _digits(node.base), _digits(node.exp)
                if exp_digits > 7 or (exp_digits > 1 and abs(float(sympy.N(node.exp))) * base_digits > MAX_DIGITS):
                    return True
            elif isinstance(node, sympy.factorial | sympy.factorial2 | sympy.subfactorial | sympy.gamma) and node.args[0].is_number:
                if _digits(node.args[0]) > 4:  # n! for n ≥ 10^4 has over 35,000 digits
                    return True
    return False


def answers_match(gold: str, completion: str) -> bool:
    """Whether the completion's answer equals the gold answer mathematically (math-verify)."""
    gold_parsed = parse_gold(gold)
    if not gold_parsed:
        return False
    answer = parse_completion(completion)
    if not answer or too_large(gold_parsed) or too_large(answer):
        return False
    try:
        return bool(_package().verify(gold_parsed, answer, timeout_seconds=None))
    except Exception:  # math-verify returns False on its own errors; be as safe for anything else
        return False


def math_verify(trajectory: Trajectory) -> float:
    """The reward `math_verify`: 1.0 when the completion's final answer (boxed, between dollars, or
    the last expression) equals the prompt's answer mathematically, else 0.0."""
    return 1.0 if answers_match(trajectory.prompt.answer, trajectory.completion_text) else 0.0
