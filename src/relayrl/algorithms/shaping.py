"""Reward shaping before advantages: DAPO's soft overlong penalty and per-turn discounted returns
for multi-turn credit (pure Python; the advantage stage applies them).

Job: turn a trajectory's length into its overlong penalty, and a multi-turn trajectory's per-turn
rewards into per-turn advantages normalised within its group.

Invariant: both are finite for finite inputs, and off by default they change nothing: with
`overlong_buffer` 0 the penalty is 0; without `turn_discount` every token of a trajectory keeps
its one group-relative advantage.

Overlong penalty (DAPO, Yu et al. 2025, eq. 13), for a trajectory of L policy tokens (a single
completion's tokens; a multi-turn episode's actions, observations excluded), with
L_max = rollout.max_new_tokens × rollout.max_turns and buffer B = `overlong_buffer`:

    R_overlong(L) = 0                                   if L ≤ L_max − B
                  = −penalty · (L − (L_max − B)) / B     if L_max − B < L ≤ L_max

added to the trajectory's reward (so to the group statistics, dynamic sampling's tie test included)
before advantages.

Multi-turn credit (`turn_discount` = γ): trajectory i's per-turn rewards r_0..r_{K−1} are its
turns' environment reward parts, the last turn also taking the rest of the trajectory's reward
(R − Σ_k parts: the other reward functions score the whole episode), so Σ_k r_k = R. Each turn k's
action gets the discounted return from its turn,

    G_k = Σ_{j ≥ k} γ^{j−k} · r_j

normalised by the group's first-turn returns G_0 (over its scored members, as `group_advantages`
does with rewards): "grpo" A_k = (G_k − mean G_0) / (std G_0 + ε) (0 throughout when the G_0 all
tie: the group has no signal), "drgrpo" A_k = G_k − mean G_0, "rloo" A_k = G_k − mean of the other
members' G_0. A_0 is then exactly the advantage of the group's first-turn returns; an unscored
member gets 0 on every turn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from relayrl.algorithms.advantages import EPS, AdvantageKind, group_advantages
from relayrl.types import Trajectory


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong reward (≤ 0) for `length` policy tokens (see the module docstring)."""
    if buffer <= 0 or penalty == 0.0:
        return 0.0
    start = max_length - buffer
    if length <= start:
        return 0.0
    return -penalty * min(length - start, buffer) / buffer


def turn_rewards(traj: Trajectory) -> list[float]:
    """Per policy turn, its reward: the turn's environment part; the last turn also takes the rest
    of the trajectory's reward (so they sum to `traj.reward`). A single completion: [reward]."""
    if not traj.turns:
        return [traj.reward]
    parts = [turn.reward for turn in traj.turns]
    parts[-1] += traj.reward - sum(parts)
    return parts


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_k = Σ_{j ≥ k} γ^{j−k}·r_j, for every k."""
    out = [0.0] * len(rewards)
    running = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def turn_advantages(returns: Sequence[Sequence[float]], kind: AdvantageKind, scored: Sequence[bool]) -> list[list[float]]:
    """Per member, per turn, A_k from its returns G_k (see the module docstring); `scored[i]`
    False: member i gets 0 on every turn and takes no part in the statistics."""
    first = [g[0] if g else 0.0 for g in returns]
    base = group_advantages(first, kind, scored)  # A_0: the group-relative advantage of the G_0
    kept = [g for g, s in zip(first, scored) if s and math.isfinite(g)]
    n = len(kept)
    if n < 2:
        return [[0.0] * len(g) for g in returns]
    scale = 1.0
    if kind == "grpo":
        mean = sum(kept) / n
        std = math.sqrt(sum((g - mean) * (g - mean) for g in kept) / (n - 1))
        if std == 0.0:
            return [[0.0] * len(g) for g in returns]
        scale = 1.0 / (std + EPS)
    out: list[list[float]] = []
    for g, a0, s in zip(returns, base, scored):
        if not s or not g or not math.isfinite(g[0]):
            out.append([0.0] * len(g))
            continue
        # A_k = A_0 + (G_k − G_0)·scale: the same baseline and scale as the first turn's
        row = [a0 + (gk - g[0]) * scale for gk in g]
        out.append(row if all(map(math.isfinite, row)) else [0.0] * len(g))
    return out
