"""The scorer: runs a run's reward functions on trajectories, each where it belongs, and turns
their results into rewards or failures.

Where a function runs (its `Placement`, tasks/rewards.py):
- INLINE (built-ins, Python-API callables): in this process, in the scoring thread;
- POOL (sync functions named `module:function` / `file.py:function`): in the reward worker
  processes (rewardpool.py), driven from the scoring thread, each call bounded by
  `task.reward_timeout_s` and the optional per-process limits;
- ASYNC (`async def`): awaited on the event loop, at most `task.reward_concurrency` calls at once
  (one semaphore for the run), each bounded by `task.reward_timeout_s`.
A batch's three parts run at the same time; nothing blocking runs on the event loop, and every
task the scorer creates belongs to a TaskGroup that awaits it.

Invariants:
- Every trajectory leaves `score` with a finite reward: the weighted sum of its functions'
  values, or 0.0 with status FAILED when any function failed on it (timed out, raised, crashed
  its worker, or returned NaN or an infinity: reason `non_finite`); `error` then names the first
  failing function, the reason and the detail. Every failed call is returned, so the caller
  counts it by function and reason.
- With only INLINE functions (the default recipes), a batch is one call into the scoring thread,
  as before the pool existed: no process is started and nothing else is added per trajectory.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from relayrl.rewardpool import CallOutcome, PoolLimits, RewardPool, describe
from relayrl.tasks.rewards import Placement, ResolvedReward, as_reward
from relayrl.threads import Workers
from relayrl.types import RewardFailure, Trajectory, TrajectoryStatus


class RewardError(RuntimeError):
    """A reward function failed while `task.strict_rewards` is on; names the function and the
    trajectory."""


@dataclass(slots=True, frozen=True)
class Failure:
    """Why one function gave one trajectory no value."""

    reason: RewardFailure
    detail: str


#: one function's result on one trajectory: its value, or why there is none
Outcome = float | Failure


@dataclass(slots=True, frozen=True)
class FailedCall:
    function: str
    reason: RewardFailure
    detail: str
    trajectory: Trajectory

    def describe(self) -> str:
        t = self.trajectory
        return (
            f"reward function {self.function!r} failed on trajectory {t.sample_index} of group {t.group_id} "
            f"(prompt {t.prompt.prompt_id!r}): {self.reason.value}: {self.detail}"
        )


@dataclass(slots=True, frozen=True)
class ScorerSettings:
    """The `task.reward_*` keys the scorer uses (see config.TaskConfig)."""

    workers: int = 2
    timeout_s: float = 30.0
    concurrency: int = 32
    memory_mb: int = 0
    cpu_s: float = 0.0


def _finite(x: float) -> bool:
    return x - x == 0.0  # False for NaN and ±inf; the cheapest test


class Scorer:
    """A run's reward functions. `score` sets rewards; `outcomes` only reports each function's
    result (the held-out evaluator's use). `close()` ends the worker processes, if any started."""

    def __init__(self, rewards: Sequence[ResolvedReward], settings: ScorerSettings, workers: Workers) -> None:
        self.rewards = list(rewards)
        self.settings = settings
        self._workers = workers
        self._inline = [(i, r) for i, r in enumerate(self.rewards) if r.placement is Placement.INLINE]
        self._async = [(i, r) for i, r in enumerate(self.rewards) if r.placement is Placement.ASYNC]
        self._pooled = [(i, r) for i, r in enumerate(self.rewards) if r.placement is Placement.POOL]
        self.pool: RewardPool | None = None
        if self._pooled:
            specs = [r.spec for _, r in self._pooled]
            assert all(s is not None for s in specs)
            limits = PoolLimits(settings.timeout_s, settings.memory_mb, settings.cpu_s)
            self.pool = RewardPool([s for s in specs if s is not None], settings.workers, limits)  # started at its first call
        self._semaphore: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    # -- running the functions ---------------------------------------------------------------

    def _run_sync(self, trajectories: Sequence[Trajectory], grid: list[list[Outcome]]) -> None:
        """The INLINE and POOL parts of a batch (in the scoring thread)."""
        for i, r in self._inline:
            fn = r.fn
            for t, row in zip(trajectories, grid):
                try:
                    value = fn(t)
                    row[i] = value if value.__class__ is float else as_reward(value)
                except Exception as exc:  # a reward function may raise anything
                    row[i] = Failure(RewardFailure.RAISED, describe(exc))
        if self.pool is not None:
            calls = [(k, t) for k in range(len(self._pooled)) for t in trajectories]
            results: list[CallOutcome] = self.pool.run(calls, self._workers.abort)
            n = len(trajectories)
            for k, (i, _) in enumerate(self._pooled):
                for row, res in zip(grid, results[k * n : (k + 1) * n]):
                    row[i] = res.value if res.failure is None else Failure(res.failure, res.detail)

    def _sem(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore[0] is not loop:
            self._semaphore = (loop, asyncio.Semaphore(self.settings.concurrency))
        return self._semaphore[1]

    async def _call_async(self, r: ResolvedReward, t: Trajectory, row: list[Outcome], i: int) -> None:
        async with self._sem():
            try:
                async with asyncio.timeout(self.settings.timeout_s) as deadline:
                    row[i] = as_reward(await r.fn(t))  # type: ignore[misc]
            except TimeoutError as exc:
                if deadline.expired():
                    row[i] = Failure(RewardFailure.TIMEOUT, f"no result within {self.settings.timeout_s:g} s (task.reward_timeout_s)")
                else:
                    row[i] = Failure(RewardFailure.RAISED, describe(exc))
            except Exception as exc:  # a reward function may raise anything
                row[i] = Failure(RewardFailure.RAISED, describe(exc))

    async def _run(self, trajectories: Sequence[Trajectory], settle: bool) -> tuple[list[list[Outcome]], list[FailedCall]]:
        grid: list[list[Outcome]] = [[0.0] * len(self.rewards) for _ in trajectories]
        failed: list[FailedCall] = []

        def sync_part(then_settle: bool) -> None:
            self._run_sync(trajectories, grid)
            if then_settle:
                failed.extend(self._settle(trajectories, grid))

        if not self._async:  # the common case: one call into the scoring thread
            await self._workers.run("score", functools.partial(sync_part, settle))
            return grid, failed
        try:
            async with asyncio.TaskGroup() as tg:
                if self._inline or self._pooled:
                    tg.create_task(self._workers.run("score", functools.partial(sync_part, False)))
                for i, r in self._async:
                    for t, row in zip(trajectories, grid):
                        tg.create_task(self._call_async(r, t, row, i))
        except BaseExceptionGroup as group:  # only the sync part can fail (a worker that cannot start)
            raise group.exceptions[0] from None
        if settle:
            failed.extend(await self._workers.run("score", functools.partial(self._settle, trajectories, grid)))
        return grid, failed

    async def score(self, trajectories: Sequence[Trajectory]) -> list[FailedCall]:
        """Run every function on every trajectory and set its reward, status and error; the
        failed calls, in trajectory then function order."""
        _, failed = await self._run(trajectories, settle=True)
        return failed

    async def outcomes(self, trajectories: Sequence[Trajectory]) -> list[list[Outcome]]:
        """Every function's outcome on every trajectory ([trajectory][function]); nothing is set.
        A non-finite value is reported as a `non_finite` Failure."""
        grid, _ = await self._run(trajectories, settle=False)
        for row in grid:
            for i, x in enumerate(row):
                if isinstance(x, float) and not _finite(x):
                    row[i] = Failure(RewardFailure.NON_FINITE, f"returned {x!r}")
        return grid

    def _settle(self, trajectories: Sequence[Trajectory], grid: list[list[Outcome]]) -> list[FailedCall]:
        rewards = self.rewards
        failed: list[FailedCall] = []
        for t, row in zip(trajectories, grid):
            total = 0.0
            first: FailedCall | None = None
            for r, x in zip(rewards, row):
                if x.__class__ is float:
                    v = r.weight * x
                    if v - v == 0.0:  # finite (x and its weighted value): the common case, inlined
                        total += v
                        continue
                if isinstance(x, Failure):
                    call = FailedCall(r.name, x.reason, x.detail, t)
                else:
                    detail = f"returned {x!r}" if not _finite(x) else f"{x!r} × weight {r.weight!r} overflows"
                    call = FailedCall(r.name, RewardFailure.NON_FINITE, detail, t)
                failed.append(call)
                first = first or call
            if first is None and total - total != 0.0:  # finite parts whose sum overflows: blame the largest
                largest = max(zip(rewards, row), key=lambda p: abs(p[0].weight * float(p[1])))  # type: ignore[arg-type]
                first = FailedCall(largest[0].name, RewardFailure.NON_FINITE, "the weighted sum of the rewards overflows", t)
                failed.append(first)
            if first is None:
                t.reward = total
            else:
                t.reward = 0.0
                t.status = TrajectoryStatus.FAILED
                t.error = f"{first.function}: {first.reason.value}: {first.detail}"
        return failed

    def close(self) -> None:
        """End the reward worker processes (if any started). Idempotent; blocks briefly."""
        if self.pool is not None:
            self.pool.close()


def strict_error(failed: Sequence[FailedCall]) -> RewardError:
    """The error that fails a run under `task.strict_rewards`: its first failed call."""
    return RewardError(f"{failed[0].describe()} (task.strict_rewards = true)")
