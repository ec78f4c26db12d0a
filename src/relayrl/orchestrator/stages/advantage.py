"""Group + advantages: group-relative advantages, and the groups that must not train.

Invariant: a group leaves either to the train queue with advantages set, or to the ledger as
filtered (all failed; zero reward variance under dynamic sampling, NaN-safe; a trajectory too
long for a packed row), returning its window credit. Advantages are finite whatever the rewards
(algorithms/advantages.py).

A trajectory whose reward call failed (`TrajectoryStatus.FAILED`, reward 0 as a placeholder) is
not a sample of the reward: it gets advantage 0 and takes no part in its group's statistics, the
zero-variance test included (a group whose scored members all tie is filtered as any tie is; one
whose members all failed is filtered as `all_failed`). The train loop packs only the scored
trajectories, so a failed one adds no token to the loss or its normaliser; it stays in its group
to be logged (status `failed`) and counted (the ledger's `trajectories_failed`).

Step-level advantages ("grpo" with scale_rewards = "batch", "reinforce_pp") need the step's groups:
this stage sets their group-centred part (r − mean_g; 0 for reinforce_pp) and the train loop
finishes them with `finish_step_advantages` when it takes a step's groups, before packing.
Shaping (algorithms/shaping.py), in this order, before the group is tested or its advantages are
computed: DAPO's soft overlong penalty is added to each scored trajectory's reward (and recorded
in its `overlong_penalty`); with `mask_truncated` a group none of whose scored members ended
below the token limit (finish reason "length") is filtered as `all_truncated` (it would train
nothing; the train loop leaves truncated trajectories out of the loss, but they keep their place
in the group's statistics); with `turn_discount` each multi-turn trajectory gets one advantage per
turn from its discounted returns (`turn_advantages`; `advantage` is its first turn's).
"""

from __future__ import annotations

import asyncio
import itertools
import operator
from dataclasses import dataclass

from relayrl.algorithms.advantages import AdvantageKind, group_advantages, rewards_tie, step_advantages
from relayrl.algorithms.shaping import discounted_returns, overlong_penalty, turn_advantages, turn_rewards
from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.window import DispatchWindow
from relayrl.types import FilterReason, Group, Trajectory, TrajectoryStatus

_PROMPT_TOKENS = operator.attrgetter("prompt_tokens")
_COMPLETION_TOKENS = operator.attrgetter("completion_tokens")
_STATUS = operator.attrgetter("status")


def scored(trajectories: list[Trajectory]) -> list[bool]:
    """Per trajectory, whether its reward counts (False: its reward call failed)."""
    return list(map(operator.is_not, map(_STATUS, trajectories), itertools.repeat(TrajectoryStatus.FAILED)))


def truncated(traj: Trajectory) -> bool:
    """Whether `traj` was cut at the token limit (finish reason "length")."""
    return traj.finish_reason == "length"


def trainable(trajectories: list[Trajectory], *, mask_truncated: bool = False) -> list[Trajectory]:
    """The trajectories the train loop packs: the scored ones, less the truncated ones under
    `mask_truncated`."""
    return [t for t in trajectories if t.status is not TrajectoryStatus.FAILED and not (mask_truncated and truncated(t))]


@dataclass(slots=True, frozen=True, kw_only=True)
class Shaping:
    """algorithm.overlong_buffer / overlong_penalty (L_max = `max_policy_tokens`),
    mask_truncated and turn_discount (algorithms/shaping.py); the defaults change nothing."""

    max_policy_tokens: int = 0
    overlong_buffer: int = 0
    overlong_penalty: float = 0.0
    mask_truncated: bool = False
    turn_discount: float | None = None


def shape_rewards(group: Group, shaping: Shaping, counted: list[bool]) -> None:
    """Add the overlong penalty to each scored trajectory's reward (and record it)."""
    if shaping.overlong_buffer <= 0:
        return
    for traj, s in zip(group.trajectories, counted):
        if s:
            penalty = overlong_penalty(traj.policy_tokens, shaping.max_policy_tokens, shaping.overlong_buffer, shaping.overlong_penalty)
            traj.overlong_penalty = penalty
            traj.reward += penalty


def _longest(trajs: list[Trajectory]) -> int:
    """The most tokens any of `trajs` has (`Trajectory.num_tokens`), in C: this runs for every
    trajectory of the run."""
    lengths = map(operator.add, map(len, map(_PROMPT_TOKENS, trajs)), map(len, map(_COMPLETION_TOKENS, trajs)))
    return max(lengths, default=0)


def filter_reason(
    group: Group,
    *,
    dynamic_sampling: bool,
    row_tokens: int | None = None,
    counted: list[bool] | None = None,
    mask_truncated: bool = False,
) -> FilterReason | None:
    """Why `group` must not train (None: it trains). `row_tokens`: a trajectory longer than a
    packed row cannot be packed, so its group is filtered rather than failing its step (a failed
    trajectory is never packed, so only the scored ones count). `counted`: `scored(...)` of its
    trajectories, if known. `mask_truncated`: a group whose scored members were all truncated
    trains nothing."""
    trajs = group.trajectories
    flags = scored(trajs) if counted is None else counted
    if row_tokens is not None and _longest(trajs) > row_tokens:  # rare: then look at the scored ones
        if any(s and t.num_tokens > row_tokens for s, t in zip(flags, trajs)):
            return FilterReason.TOO_LONG
    if not any(flags):
        return FilterReason.ALL_FAILED
    if mask_truncated and all(truncated(t) for t, s in zip(trajs, flags) if s):
        return FilterReason.ALL_TRUNCATED
    if dynamic_sampling and rewards_tie([t.reward for t in trajs], flags):
        return FilterReason.ZERO_VARIANCE
    return None


def finish_step_advantages(groups: list[Group], *, kind: AdvantageKind, token_whiten: bool = False) -> None:
    """Set the advantages of a step's trajectories that depend on the whole step (batch std
    scaling of "grpo", "reinforce_pp", with `token_whiten` over its trained tokens;
    algorithms/advantages.py `step_advantages`)."""
    trajs = [t for g in groups for t in g.trajectories]
    tokens = [sum(t.loss_mask) if t.loss_mask else len(t.completion_tokens) for t in trajs] if token_whiten else None
    values = step_advantages([t.reward for t in trajs], [t.advantage for t in trajs], scored(trajs), kind, tokens)
    for traj, adv in zip(trajs, values):
        traj.advantage = adv


async def advantage_stage(
    inbox: asyncio.Queue[list[Group]],
    outbox: asyncio.Queue[Group],
    ledger: Ledger,
    window: DispatchWindow,
    *,
    kind: AdvantageKind,
    dynamic_sampling: bool,
    row_tokens: int | None = None,
    shaping: Shaping | None = None,
) -> None:
    shaping = shaping or Shaping()
    while True:
        for group in await inbox.get():
            trajs = group.trajectories
            flags = scored(trajs)
            shape_rewards(group, shaping, flags)
            reason = filter_reason(
                group, dynamic_sampling=dynamic_sampling, row_tokens=row_tokens, counted=flags, mask_truncated=shaping.mask_truncated
            )
            if reason is not None:
                ledger.filtered(group, reason, window)
                continue
            set_advantages(group, flags, kind=kind, turn_discount=shaping.turn_discount)
            ledger.kept()
            await outbox.put(group)


def set_advantages(group: Group, counted: list[bool], *, kind: AdvantageKind, turn_discount: float | None = None) -> None:
    """Each trajectory's advantage (and, with `turn_discount` and multi-turn trajectories, its
    per-turn advantages; see algorithms/shaping.py)."""
    trajs = group.trajectories
    if turn_discount is not None and any(t.turns for t in trajs):
        returns = [discounted_returns(turn_rewards(t), turn_discount) for t in trajs]
        for traj, per_turn in zip(trajs, turn_advantages(returns, kind, counted)):
            traj.advantage = per_turn[0] if per_turn else 0.0
            traj.turn_advantages = per_turn if traj.turns else None
        return
    for traj, adv in zip(trajs, group_advantages([t.reward for t in trajs], kind, counted)):
        traj.advantage = adv
