"""Advantages: group-relative (GRPO, Dr.GRPO, RLOO) and step-level (GRPO with batch std scaling,
REINFORCE++).

Per trajectory i of group g with reward r_i, over the scored members (below):
- "grpo", scale_rewards "group": (r_i − mean_g) / (std_g + ε), std_g with n − 1 (GRPO);
- "grpo", "batch": (r_i − mean_g) / (std_step + ε), std_step the std (n − 1) of every scored
  reward of the step, raw (TRL's scale_rewards = "batch");
- "grpo", "none", and "drgrpo": r_i − mean_g (Dr. GRPO, Liu et al. 2025);
- "rloo": r_i − mean of the group's other members (leave-one-out);
- "reinforce_pp": (r_i − mean_step) / (std_step + ε) over the step's scored rewards, no group
  baseline (REINFORCE++, Hu 2025; OpenRLHF's `reinforce_plus_plus`). By default (algorithm.whiten
  = "token") the mean and std are over the step's *tokens*, as OpenRLHF and verl whiten the
  per-token returns (verl's `masked_whiten`): each reward weighs as many times as its trajectory
  has trained tokens, std with N − 1 over the N tokens, so the token-weighted mean advantage is 0;
  "sequence" weighs every trajectory once (relayrl's earlier rule: with short right and long
  wrong answers the token-weighted mean advantage is then negative). It whitens the sequence
  reward only: its per-token KL penalty (algorithm.kl_in_reward) is added per token in the
  trainer, after this.
ε = 1e-6. The step-level ones need the step's groups: the advantage stage sets the group-centred
part (or 0 for reinforce_pp) and the train loop finishes them when it takes the step's groups
(`step_advantages`).

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

AdvantageKind = Literal["grpo", "drgrpo", "rloo", "reinforce_pp"]
ScaleRewards = Literal["group", "batch", "none"]
EPS = 1e-6


def group_advantages(rewards: Sequence[float], kind: AdvantageKind = "grpo", scored: Sequence[bool] | None = None) -> list[float]:
    """One advantage per reward. `scored[i]` False: member i's reward call failed (advantage 0,
    no part in the statistics; see the module docstring); None: every member was scored."""
    if kind not in ("grpo", "drgrpo", "rloo", "reinforce_pp"):
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
    if kind == "reinforce_pp":  # finished over the step (`step_advantages`)
        return [0.0] * n
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


def stage_kind(kind: AdvantageKind, scale_rewards: ScaleRewards) -> AdvantageKind:
    """What the per-group stage computes: "grpo" scaled by the step ("batch") or not at all
    ("none") is r − mean_g there, i.e. "drgrpo"'s formula."""
    return "drgrpo" if kind == "grpo" and scale_rewards != "group" else kind


def needs_step(kind: AdvantageKind, scale_rewards: ScaleRewards) -> bool:
    """Whether advantages are finished over the step's groups (`step_advantages`)."""
    return kind == "reinforce_pp" or (kind == "grpo" and scale_rewards == "batch")


def _mean_std(rewards: Sequence[float]) -> tuple[float, float] | None:
    """Mean and std (n − 1) of finite `rewards`; None with fewer than two or a spread that overflows."""
    values = [r for r in rewards if math.isfinite(r)]
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    var = sum((r - mean) * (r - mean) for r in values) / (n - 1)
    if not math.isfinite(var):
        return None
    return mean, math.sqrt(var)


def _weighted_mean_std(rewards: Sequence[float], weights: Sequence[float]) -> tuple[float, float] | None:
    """Mean and std (N − 1, N = Σ weights: tokens) of `rewards` each counted `weights` times
    (verl's masked_whiten over per-token returns); None with fewer than two tokens."""
    total = sum(weights)
    if total < 2:
        return None
    mean = sum(w * r for r, w in zip(rewards, weights)) / total
    var = sum(w * (r - mean) * (r - mean) for r, w in zip(rewards, weights)) / (total - 1)
    if not math.isfinite(var):
        return None
    return mean, math.sqrt(var)


def step_advantages(
    rewards: Sequence[float],
    group_centred: Sequence[float],
    scored: Sequence[bool],
    kind: AdvantageKind,
    tokens: Sequence[int] | None = None,
) -> list[float]:
    """The step's advantages, flat over its groups' trajectories: `rewards`, the per-group stage's
    `group_centred` advantages (r − mean_g) and `scored` flags, one each. "grpo" (batch scaling):
    group_centred / (std_step + ε); "reinforce_pp": (r − mean_step) / (std_step + ε); the step's
    statistics over its scored finite rewards (for "reinforce_pp" with `tokens`, each trajectory's
    trained tokens, weighted by them: per-token whitening). Unscored members keep 0; a step with
    fewer than two scored rewards gets 0 throughout. Always finite."""
    if not len(rewards) == len(group_centred) == len(scored):
        raise ValueError(f"{len(rewards)} rewards, {len(group_centred)} advantages and {len(scored)} scored flags")
    counted = [s and math.isfinite(r) for r, s in zip(rewards, scored)]
    if kind == "reinforce_pp" and tokens is not None:
        if len(tokens) != len(rewards):
            raise ValueError(f"{len(rewards)} rewards and {len(tokens)} token counts")
        kept = [(r, t) for r, t, c in zip(rewards, tokens, counted) if c]
        stats = _weighted_mean_std([r for r, _ in kept], [t for _, t in kept]) if len(kept) >= 2 else None
    else:
        stats = _mean_std([r for r, c in zip(rewards, counted) if c])
    if stats is None:
        return [0.0] * len(rewards)
    mean, std = stats
    if kind == "reinforce_pp":
        out = [(r - mean) / (std + EPS) if c else 0.0 for r, c in zip(rewards, counted)]
    elif kind == "grpo":
        out = [a / (std + EPS) if c else 0.0 for a, c in zip(group_centred, counted)]
    else:
        raise ValueError(f"advantage estimator {kind!r} is not finished over the step (algorithm.advantage)")
    return [a if math.isfinite(a) else 0.0 for a in out]
