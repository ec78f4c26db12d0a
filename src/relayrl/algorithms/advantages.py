"""Group-relative advantages: GRPO, Dr.GRPO and RLOO.

Invariant: advantages are computed within one group only, over its *scored* members, are always
finite, and sum to zero for every estimator when the group has at least two scored members. A
member is scored unless its reward call failed (`scored[i]` False: a timeout, a raise, a crash or
a NaN, `TrajectoryStatus.FAILED`) or its reward is NaN or infinite (the score stage never lets one
through, this is the last line of defence). An unscored member gets advantage 0 and takes no part
in the group's statistics (mean, std, the RLOO baseline, the group size n): the others are
computed as if it were absent. So a failure's placeholder reward 0 never becomes a signal — with
rewards ±1, [-1, -1, -1, failed] gives [0, 0, 0, 0], not +1.5 for the completion that broke the
verifier — and one bad reward can never turn its group's advantages, and then the weights, into
NaN. A group with fewer than two scored members gets advantage 0 throughout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageKind = Literal["grpo", "drgrpo", "rloo"]
EPS = 1e-6


def group_advantages(rewards: Sequence[float], kind: AdvantageKind = "grpo", scored: Sequence[bool] | None = None) -> list[float]:
    """One advantage per reward. `scored[i]` False: member i's reward call failed (advantage 0,
    no part in the statistics; see the module docstring); None: every member was scored."""
    if kind not in ("grpo", "drgrpo", "rloo"):
        raise ValueError(f"unknown advantage estimator {kind!r} (algorithm.advantage)")
    if scored is not None and not all(scored):
        if len(scored) != len(rewards):
            raise ValueError(f"{len(scored)} scored flags for {len(rewards)} rewards")
        inner = iter(group_advantages([r for r, s in zip(rewards, scored) if s], kind))
        return [next(inner) if s else 0.0 for s in scored]
    total = sum(rewards)
    if total - total != 0.0:  # a NaN or an infinity among them (a finite sum means none is)
        finite = [r for r in rewards if math.isfinite(r)]
        if len(finite) < len(rewards):
            inner = iter(group_advantages(finite, kind))
            return [next(inner) if math.isfinite(r) else 0.0 for r in rewards]
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = total / n
    if kind == "drgrpo":
        out = [r - mean for r in rewards]
    elif kind == "rloo":
        out = [r - (total - r) / (n - 1) for r in rewards]
    else:
        std = math.sqrt(sum((r - mean) * (r - mean) for r in rewards) / (n - 1))  # `**` raises on overflow
        out = [(r - mean) / (std + EPS) for r in rewards]
    check = sum(out)  # finite: so is every advantage (the common case, one pass in C)
    if check - check != 0.0 and not all(math.isfinite(a) for a in out):  # finite rewards whose spread overflows (|r| ~ 1e308)
        return [0.0] * n
    return out


def rewards_tie(rewards: Sequence[float], scored: Sequence[bool] | None = None) -> bool:
    """Whether a group's rewards carry no signal: its scored finite rewards (failed calls and
    NaN/inf ignored, as `group_advantages` ignores them) take at most one value. (A set of rewards
    would not do: NaN != NaN, so an all-NaN group looks varied.)"""
    if scored is not None and not all(scored):
        rewards = [r for r, s in zip(rewards, scored) if s]
    finite = [r for r in rewards if math.isfinite(r)]
    return all(r == finite[0] for r in finite[1:]) if finite else True
