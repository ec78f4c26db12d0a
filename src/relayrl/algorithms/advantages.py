"""Group-relative advantages: GRPO, Dr.GRPO and RLOO.

Invariant: advantages are computed within one group only, are always finite, and sum to zero for
every estimator when the group has at least two finite rewards. A reward that is NaN or infinite
(the score stage never lets one through, this is the last line of defence) takes no part: its
trajectory gets advantage 0 and the others are computed as if it were absent, so one bad reward
can never turn its group's advantages, and then the weights, into NaN. A group with fewer than
two finite rewards gets advantage 0 throughout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageKind = Literal["grpo", "drgrpo", "rloo"]
EPS = 1e-6


def group_advantages(rewards: Sequence[float], kind: AdvantageKind = "grpo") -> list[float]:
    if kind not in ("grpo", "drgrpo", "rloo"):
        raise ValueError(f"unknown advantage estimator {kind!r} (algorithm.advantage)")
    finite = [r for r in rewards if math.isfinite(r)]
    if len(finite) < len(rewards):
        inner = iter(group_advantages(finite, kind))
        return [next(inner) if math.isfinite(r) else 0.0 for r in rewards]
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    if kind == "drgrpo":
        out = [r - mean for r in rewards]
    elif kind == "rloo":
        total = sum(rewards)
        out = [r - (total - r) / (n - 1) for r in rewards]
    else:
        std = math.sqrt(sum((r - mean) * (r - mean) for r in rewards) / (n - 1))  # `**` raises on overflow
        out = [(r - mean) / (std + EPS) for r in rewards]
    if not all(math.isfinite(a) for a in out):  # finite rewards whose spread overflows (|r| ~ 1e308)
        return [0.0] * n
    return out


def rewards_tie(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards carry no signal: its finite rewards (NaN/inf ignored) take at
    most one value. (A set of rewards would not do: NaN != NaN, so an all-NaN group looks varied.)"""
    finite = [r for r in rewards if math.isfinite(r)]
    return all(r == finite[0] for r in finite[1:]) if finite else True
