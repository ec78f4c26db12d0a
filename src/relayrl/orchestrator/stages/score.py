"""Score: the run's reward functions on each batch of groups (rewards/scoring.py runs them: in the
scoring thread, in a reward call thread, in reward worker processes, or awaited on the loop for
async ones).

Invariant: every trajectory leaves with a finite reward; one on which a reward function failed
(timed out, raised, crashed, returned NaN/inf or a magnitude beyond MAX_ABS_REWARD) is marked
failed with reward 0 and each failed call is counted in the ledger by function and reason, before
the batch moves on. With `task.strict_rewards` the first failed call fails the run at once (a
`RewardError` naming the function and the trajectory; the batch's other calls are cancelled or
killed, not awaited), after that call was counted. A trajectory whose environment failed its
episode (already `failed`, orchestrator/stages/episodes.py) is not scored: it is counted in the
ledger as a failed call of the function `environment`, by reason, and moves on with reward 0; one
whose agent failed its sample (orchestrator/stages/agents.py) likewise, as the function `agent`.
A trajectory whose agent returned its reward (`agent_reward`) takes it and is not scored.
"""

from __future__ import annotations

import asyncio
import operator
import warnings

from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.stages.agents import AGENT_FAILURE, agent_failure_reason
from relayrl.orchestrator.stages.episodes import ENV_FAILURE, env_failure_reason
from relayrl.rewards.scoring import FailedCall, RewardError, Scorer, strict_error
from relayrl.types import Group, TrajectoryStatus

_STATUS = operator.attrgetter("status")


class RewardFailedWarning(RuntimeWarning):
    """A reward function's first failed call in this run (one warning per function)."""


def _note_first_failures(ledger: Ledger, failed: list[FailedCall]) -> None:
    """The first failed call of each reward function: remembered for the filter bound's message
    and printed once (function, reason, exception), so a failing reward is seen while the run
    goes on, not only in summary.json."""
    for f in failed:
        if ledger.first_failure(f.function, f"{f.reason.value}: {f.detail}"):
            warnings.warn(
                f"{f.describe()}; the trajectory is failed (reward 0, out of its group's baseline) and the run goes on; "
                "further failures of this function are only counted (the progress line's `failed`, summary.json reward_failures; "
                "task.strict_rewards = true fails the run instead)",
                RewardFailedWarning,
                stacklevel=2,
            )


async def score_stage(
    inbox: asyncio.Queue[list[Group]],
    outbox: asyncio.Queue[list[Group]],
    scorer: Scorer,
    ledger: Ledger,
    *,
    strict: bool = False,
) -> None:
    while True:
        groups = await inbox.get()
        trajectories = [t for g in groups for t in g.trajectories]
        if TrajectoryStatus.FAILED in map(_STATUS, trajectories):  # episodes their environment failed (a C scan)
            reasons = [env_failure_reason(t) for t in trajectories]
            agents = [agent_failure_reason(t) if r is None else None for t, r in zip(trajectories, reasons)]
            counted = [(ENV_FAILURE, r) for r in reasons if r is not None] + [(AGENT_FAILURE, r) for r in agents if r is not None]
            ledger.count_reward_failures(counted, len(counted))
            for t, r, a in zip(trajectories, reasons, agents):  # their own warnings were printed by their stage
                if (r or a) is not None and t.error:  # "environment: reason: detail"
                    ledger.first_failure(ENV_FAILURE if r is not None else AGENT_FAILURE, t.error.split(": ", 1)[-1])
            trajectories = [t for t, r, a in zip(trajectories, reasons, agents) if r is None and a is None]
        if any(t.agent_reward is not None for t in trajectories):  # agents that returned their reward
            for t in trajectories:
                if t.agent_reward is not None:
                    t.reward = t.agent_reward
            trajectories = [t for t in trajectories if t.agent_reward is None]
        try:
            failed = await scorer.score(trajectories, strict=strict)
        except RewardError as exc:  # strict_rewards' first failed call, or too many abandoned reward threads
            if exc.failed is not None:
                ledger.count_reward_failures([(exc.failed.function, exc.failed.reason.value)], 1)
            raise
        if failed:
            ledger.count_reward_failures([(f.function, f.reason.value) for f in failed], len({id(f.trajectory) for f in failed}))
            _note_first_failures(ledger, failed)
            if strict:  # a weighted sum that overflows is found only when the batch is settled
                raise strict_error(failed)
        await outbox.put(groups)
