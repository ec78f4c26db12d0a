"""Group + advantages: group-relative advantages, and the groups that must not train.

Invariant: a group leaves either to the train queue with advantages set, or to the ledger as
filtered (all failed; zero reward variance under dynamic sampling, NaN-safe; a trajectory too
long for a packed row), returning its
window credit. Advantages are finite whatever the rewards (algorithms/advantages.py).
"""

from __future__ import annotations

import asyncio

from relayrl.algorithms.advantages import AdvantageKind, group_advantages, rewards_tie
from relayrl.ledger import Ledger
from relayrl.types import FilteredGroup, FilterReason, Group, TrajectoryStatus
from relayrl.window import DispatchWindow


def filter_reason(group: Group, dynamic_sampling: bool, row_tokens: int | None = None) -> FilterReason | None:
    """Why `group` must not train (None: it trains). `row_tokens`: a trajectory longer than a
    packed row cannot be packed, so its group is filtered rather than failing its step."""
    trajs = group.trajectories
    if row_tokens is not None and any(t.num_tokens > row_tokens for t in trajs):
        return FilterReason.TOO_LONG
    if all(t.status is TrajectoryStatus.FAILED for t in trajs):
        return FilterReason.ALL_FAILED
    if dynamic_sampling and rewards_tie([t.reward for t in trajs]):
        return FilterReason.ZERO_VARIANCE
    return None


async def advantage_stage(
    inbox: asyncio.Queue[list[Group]],
    outbox: asyncio.Queue[Group],
    kind: AdvantageKind,
    dynamic_sampling: bool,
    ledger: Ledger,
    window: DispatchWindow,
    row_tokens: int | None = None,
) -> None:
    while True:
        for group in await inbox.get():
            reason = filter_reason(group, dynamic_sampling, row_tokens)
            if reason is not None:
                ledger.filtered(FilteredGroup(group, reason))
                window.release_filtered()
                continue
            for traj, adv in zip(group.trajectories, group_advantages(group.rewards, kind)):
                traj.advantage = adv
            await outbox.put(group)
