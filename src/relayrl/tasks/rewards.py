"""Reward functions and their registry (`task.reward_functions` names them).

Invariant: a reward function sees one trajectory and returns a float; it may raise, and the
score stage (not the function) turns that into a failed trajectory with reward 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from relayrl.types import Trajectory

RewardFunction = Callable[[Trajectory], float]


def exact_match(trajectory: Trajectory) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer."""
    return 1.0 if trajectory.completion_text.strip() == trajectory.prompt.answer.strip() else 0.0


def numeric_match(trajectory: Trajectory) -> float:
    """1.0 when the completion parses to the same number as the answer."""
    try:
        return 1.0 if float(trajectory.completion_text.strip()) == float(trajectory.prompt.answer) else 0.0
    except ValueError:
        return 0.0


_INTEGER = re.compile(r"-?\d+")


def first_integer_match(trajectory: Trajectory) -> float:
    """1.0 when the first integer in the completion equals the answer (for chatty models)."""
    found = _INTEGER.search(trajectory.completion_text)
    return 1.0 if found is not None and found.group() == trajectory.prompt.answer.strip() else 0.0


def last_integer_match(trajectory: Trajectory) -> float:
    """1.0 when the last integer in the completion equals the answer ("3 + 5 = 8" → 8)."""
    found = _INTEGER.findall(trajectory.completion_text)
    return 1.0 if found and found[-1] == trajectory.prompt.answer.strip() else 0.0


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "first_integer_match": first_integer_match,
    "last_integer_match": last_integer_match,
}


def resolve(names: list[str]) -> list[RewardFunction]:
    fns: list[RewardFunction] = []
    for i, name in enumerate(names):
        fn = REWARD_FUNCTIONS.get(name)
        if fn is None:
            known = ", ".join(sorted(REWARD_FUNCTIONS))
            raise ValueError(f"task.reward_functions[{i}]: unknown reward function {name!r} (known: {known})")
        fns.append(fn)
    return fns
