"""Group-relative advantages: GRPO, Dr.GRPO and RLOO.

Invariant: advantages are computed within one group only and sum to zero for every estimator
when the group has at least two members (a group of one gets advantage 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageKind = Literal["grpo", "drgrpo", "rloo"]
EPS = 1e-6


def group_advantages(rewards: Sequence[float], kind: AdvantageKind = "grpo") -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    if kind == "drgrpo":
        return [r - mean for r in rewards]
    if kind == "rloo":
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    if kind == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        return [(r - mean) / (std + EPS) for r in rewards]
    raise ValueError(f"unknown advantage estimator {kind!r} (algorithm.advantage)")
