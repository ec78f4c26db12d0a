"""Score: reward functions, run in the scoring thread (never on the event loop).

Invariant: every trajectory leaves with a reward; a reward function that raises marks that
trajectory failed with reward 0, and the failure is counted in the ledger by function name.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Sequence

from relayrl.ledger import Ledger
from relayrl.tasks.rewards import RewardFunction
from relayrl.threads import Workers
from relayrl.types import Group, TrajectoryStatus


def score_groups(groups: Sequence[Group], reward_fns: Sequence[RewardFunction]) -> Counter[str]:
    """Set each trajectory's reward (sum over functions); returns failures by function name."""
    failures: Counter[str] = Counter()
    for group in groups:
        for traj in group.trajectories:
            total = 0.0
            for fn in reward_fns:
                try:
                    total += float(fn(traj))
                except Exception as exc:  # a user's reward function may raise anything
                    failures[fn.__name__] += 1
                    traj.status = TrajectoryStatus.FAILED
                    traj.error = f"{fn.__name__}: {type(exc).__name__}: {exc}"
                    total = 0.0
                    break
            traj.reward = total
    return failures


async def score_stage(
    inbox: asyncio.Queue[list[Group]],
    outbox: asyncio.Queue[list[Group]],
    reward_fns: Sequence[RewardFunction],
    workers: Workers,
    ledger: Ledger,
) -> None:
    while True:
        groups = await inbox.get()
        failures = await workers.run("score", functools.partial(score_groups, groups, reward_fns))
        if failures:
            ledger.reward_errors.update(failures)
            ledger.trajectories_failed += sum(failures.values())
        await outbox.put(groups)
