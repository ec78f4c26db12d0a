"""The scorer: runs a run's reward functions on trajectories, each where it belongs, and turns
their results into rewards or failures.

Where a function runs (its `Placement`, rewards/registry.py):
- INLINE (the `REWARD_FUNCTIONS` built-ins: string and regex checks that cannot hang): in this
  process, in the scoring thread, on the trajectory itself, with no deadline (the hot path);
- THREAD (Python-API sync callables): in a reward call thread watched from the scoring thread
  (rewards/threads.py), each call bounded by `task.reward_timeout_s`, on a copy of the trajectory;
- POOL (the optional built-ins such as `math_verify`, and sync functions named `module:function` /
  `file.py:function`): in the reward worker processes (rewards/pool.py), driven from the scoring
  thread, each call bounded by `task.reward_timeout_s` and the optional per-process limits, on a
  pickled copy;
- ASYNC (`async def`): awaited on the event loop, at most `task.reward_concurrency` calls at once
  (one semaphore for the run), each bounded by `task.reward_timeout_s`, on a copy.
A batch's async part runs at the same time as its sync parts; nothing blocking runs on the event
loop, and every task the scorer creates belongs to a TaskGroup that awaits it.

Invariants:
- A value is a reward only if it is a float within ±MAX_ABS_REWARD (a function's int, bool,
  numpy scalar or 0-d array is converted by `as_reward` first, on every path); it is clipped to
  ±`task.reward_clip` (when > 0), then weighted.
- Every trajectory leaves `score` with a finite reward: the weighted sum of its functions'
  values, or 0.0 with status FAILED when any function failed on it (timed out, raised, crashed
  its worker, or returned NaN, an infinity or a magnitude beyond MAX_ABS_REWARD: reason
  `non_finite`); `error` then names the first failing function, the reason and the detail. Every
  failed call is returned, so the caller counts it by function and reason.
- With `strict`, the first failed call ends the batch at once with a `RewardError` carrying that
  call: no further call starts, calls in flight are cancelled (async), killed (worker processes)
  or abandoned (reward call threads).
- A user function never receives the trajectory that is trained on (a copy, or a pickled one in a
  worker process), so one that changes its argument cannot corrupt training; built-ins do.
- With only INLINE functions (the default recipes), a batch is one call into the scoring thread,
  as before the pool existed: no process or thread is started and nothing else is added per
  trajectory.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from relayrl.errors import RunFailed, first_error, leaf_errors
from relayrl.rewards.pool import CallOutcome, PoolLimits, RewardPool, describe
from relayrl.rewards.registry import MAX_ABS_REWARD, OUT_OF_RANGE, NonFiniteReward, Placement, ResolvedReward, as_reward, trajectory_copy
from relayrl.rewards.threads import MAX_ABANDONED_THREADS, ThreadedCalls, TooManyAbandoned
from relayrl.threads import OrchestratorThreads
from relayrl.types import RewardFailure, Trajectory, TrajectoryStatus


class RewardError(RunFailed, RuntimeError):
    """A reward call failed while `task.strict_rewards` is on (or left too many reward call
    threads running); names the function and the trajectory. `failed` is that call (the score
    stage counts it before the run fails)."""

    def __init__(self, message: str, failed: FailedCall | None = None) -> None:
        super().__init__(message)
        self.failed = failed


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
    clip: float = 0.0  # task.reward_clip: each value clipped to ±clip before weighting; 0 = off
    worker_log: Path | None = None  # the reward workers' stdout and stderr (rewards/output.py); None: a short head on stderr


def _failure_of(x: object) -> Failure | None:
    """None for a value the scorer takes (a float within ±MAX_ABS_REWARD), else why not."""
    if x.__class__ is float:
        if -MAX_ABS_REWARD <= x <= MAX_ABS_REWARD:
            return None
        if x - x != 0.0:  # NaN or an infinity
            return Failure(RewardFailure.NON_FINITE, f"returned {x!r}")
        return Failure(RewardFailure.NON_FINITE, f"{OUT_OF_RANGE}: returned {x!r}")
    if isinstance(x, Failure):
        return x
    return Failure(RewardFailure.RAISED, f"a reward function must return a number, got {type(x).__name__}")  # as_reward prevents it


def _clipped(x: float, clip: float) -> float:
    return clip if x > clip else -clip if x < -clip else x


def _taken_totals(weights: Sequence[float], columns: list[list[Outcome]], n: int, clip: float) -> list[float] | None:
    """The `n` trajectories' weighted sums, added in the order `Scorer._settle` adds them row by
    row, when every value (`columns[i]`: function i's outcomes) is one the scorer takes (a float
    within ±MAX_ABS_REWARD) and every sum is finite; None otherwise (`_settle` then goes row by
    row). A function's column at a time, in C: nothing runs in Python per trajectory unless
    `clip` is on."""
    lo, hi = -MAX_ABS_REWARD, MAX_ABS_REWARD
    totals = [0.0] * n
    for w, column in zip(weights, columns):
        if not set(map(type, column)) <= {float}:  # a Failure (or anything else, which as_reward prevents)
            return None
        floats = cast("list[float]", column)
        check = sum(floats)
        if check - check != 0.0 or min(floats, default=0.0) < lo or max(floats, default=0.0) > hi:
            return None  # NaN, an infinity or a value out of range (with no NaN, min and max are exact)
        values = map(_clipped, floats, itertools.repeat(clip)) if clip else floats
        totals = list(map(operator.add, totals, map(operator.mul, itertools.repeat(w), values)))
    check = sum(totals)
    return totals if check - check == 0.0 else None  # a finite sum: every total is finite


def _call_value(value: object) -> Outcome:
    """A function's return value as an outcome (`as_reward`, its failures as Failures)."""
    try:
        return as_reward(value)
    except NonFiniteReward as exc:
        return Failure(RewardFailure.NON_FINITE, str(exc))
    except Exception as exc:
        return Failure(RewardFailure.RAISED, describe(exc))


def strict_error(failed: Sequence[FailedCall]) -> RewardError:
    """The error that fails a run under `task.strict_rewards`: its first failed call."""
    return RewardError(f"{failed[0].describe()} (task.strict_rewards = true)", failed[0])


def _check_strict(r: ResolvedReward, t: Trajectory, x: object) -> None:
    """Under `task.strict_rewards`: raise the RewardError for a call whose outcome is no reward."""
    failure = _failure_of(x)
    if failure is not None:
        raise strict_error([FailedCall(r.name, failure.reason, failure.detail, t)])


class Scorer:
    """A run's reward functions. `score` sets rewards; `outcomes` only reports each function's
    result (the held-out evaluator's use). `close()` ends the worker processes, if any started."""

    def __init__(self, rewards: Sequence[ResolvedReward], settings: ScorerSettings, threads: OrchestratorThreads) -> None:
        self.rewards = list(rewards)
        self.settings = settings
        self._threads = threads
        self._inline = [(i, r) for i, r in enumerate(self.rewards) if r.placement is Placement.INLINE]
        self._threaded = [(i, r) for i, r in enumerate(self.rewards) if r.placement is Placement.THREAD]
        self._async = [(i, r) for i, r in enumerate(self.rewards) if r.placement is Placement.ASYNC]
        self._pooled = [(i, r) for i, r in enumerate(self.rewards) if r.placement is Placement.POOL]
        self.threads = ThreadedCalls(settings.timeout_s)
        self.pool: RewardPool | None = None
        if self._pooled:
            specs = [r.spec for _, r in self._pooled]
            assert all(s is not None for s in specs)
            limits = PoolLimits(settings.timeout_s, settings.memory_mb, settings.cpu_s)
            # started at its first call
            self.pool = RewardPool([s for s in specs if s is not None], settings.workers, limits, log_path=settings.worker_log)
        self._semaphore: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    # -- running the functions ---------------------------------------------------------------

    def _inline_column(self, r: ResolvedReward, trajectories: Sequence[Trajectory], strict: bool) -> list[Outcome]:
        """An INLINE function's outcomes on the batch, in trajectory order (in the scoring thread)."""
        fn = r.fn
        column: list[Outcome] = []
        for t in trajectories:
            x: Outcome
            try:
                value = fn(t)
                x = value if value.__class__ is float else as_reward(value)
            except NonFiniteReward as exc:
                x = Failure(RewardFailure.NON_FINITE, str(exc))
            except Exception as exc:  # a reward function may raise anything
                x = Failure(RewardFailure.RAISED, describe(exc))
            column.append(x)
            if strict:
                _check_strict(r, t, x)
        return column

    def _score_inline(self, trajectories: Sequence[Trajectory], strict: bool) -> list[FailedCall]:
        """`score` when every function is INLINE (the default recipes), in the scoring thread: the
        outcomes stay columns, one per function, and no row is made per trajectory unless some
        value is not taken (`_settle`)."""
        return self._settle(trajectories, None, [self._inline_column(r, trajectories, strict) for _, r in self._inline])

    def _run_sync(self, trajectories: Sequence[Trajectory], grid: list[list[Outcome]], strict: bool) -> None:
        """The INLINE, THREAD and POOL parts of a batch (in the scoring thread)."""
        for i, r in self._inline:
            for row, x in zip(grid, self._inline_column(r, trajectories, strict)):
                row[i] = x
        for i, r in self._threaded:
            self._run_threaded(i, r, trajectories, grid, strict)
        if self.pool is not None:
            self._run_pooled(trajectories, grid, strict)

    def _run_threaded(self, i: int, r: ResolvedReward, trajectories: Sequence[Trajectory], grid: list[list[Outcome]], strict: bool) -> None:
        fn = r.fn
        timeout_s = self.settings.timeout_s

        def call(k: int) -> Outcome:
            try:
                return _call_value(fn(trajectory_copy(trajectories[k])))
            except BaseException as exc:  # SystemExit too: a reward that calls sys.exit() raised
                return Failure(RewardFailure.RAISED, describe(exc))

        def timed_out(k: int) -> Outcome:
            return Failure(RewardFailure.TIMEOUT, f"no result within {timeout_s:g} s (task.reward_timeout_s); its thread was abandoned")

        stop: Callable[[Outcome], bool] | None = (lambda x: _failure_of(x) is not None) if strict else None
        try:
            results = self.threads.run(call, len(trajectories), timed_out, self._threads.abort, r.name, stop)
        except TooManyAbandoned as exc:
            failed = FailedCall(r.name, RewardFailure.TIMEOUT, timed_out(exc.index).detail, trajectories[exc.index])  # type: ignore[union-attr]
            raise RewardError(
                f"{failed.describe()}; {exc.running} of its calls are still running in abandoned threads (at most "
                f"{MAX_ABANDONED_THREADS}): name it 'module:function' in task.reward_functions to run it in a worker process, "
                "which is killed at the deadline",
                failed,
            ) from None
        for t, row, x in zip(trajectories, grid, results):
            if x is not None:
                row[i] = x
                if strict:
                    _check_strict(r, t, x)

    def _run_pooled(self, trajectories: Sequence[Trajectory], grid: list[list[Outcome]], strict: bool) -> None:
        assert self.pool is not None
        n = len(trajectories)
        calls = [(k, t) for k in range(len(self._pooled)) for t in trajectories]
        on_outcome: Callable[[int, CallOutcome], None] | None = None
        if strict:

            def on_outcome(j: int, res: CallOutcome) -> None:
                k, m = divmod(j, n)
                _check_strict(self._pooled[k][1], trajectories[m], res.value if res.failure is None else Failure(res.failure, res.detail))

        results: list[CallOutcome] = self.pool.run(calls, self._threads.abort, on_outcome)
        for k, (i, _) in enumerate(self._pooled):
            for row, res in zip(grid, results[k * n : (k + 1) * n]):
                row[i] = res.value if res.failure is None else Failure(res.failure, res.detail)

    def _sem(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore[0] is not loop:
            self._semaphore = (loop, asyncio.Semaphore(self.settings.concurrency))
        return self._semaphore[1]

    async def _call_async(self, r: ResolvedReward, t: Trajectory, row: list[Outcome], i: int, strict: bool) -> None:
        x: Outcome
        async with self._sem():
            try:
                async with asyncio.timeout(self.settings.timeout_s) as deadline:
                    x = as_reward(await r.fn(trajectory_copy(t)))  # type: ignore[misc]
            except TimeoutError as exc:
                if deadline.expired():
                    x = Failure(RewardFailure.TIMEOUT, f"no result within {self.settings.timeout_s:g} s (task.reward_timeout_s)")
                else:
                    x = Failure(RewardFailure.RAISED, describe(exc))
            except NonFiniteReward as exc:
                x = Failure(RewardFailure.NON_FINITE, str(exc))
            except Exception as exc:  # a reward function may raise anything
                x = Failure(RewardFailure.RAISED, describe(exc))
        row[i] = x
        if strict:
            _check_strict(r, t, x)

    async def _run(
        self, trajectories: Sequence[Trajectory], settle: bool, strict: bool = False
    ) -> tuple[list[list[Outcome]], list[FailedCall]]:
        if settle and len(self._inline) == len(self.rewards):  # the default recipes: one call into the scoring thread
            return [], await self._threads.run("score", functools.partial(self._score_inline, trajectories, strict))
        zeros = (0.0,) * len(self.rewards)
        grid: list[list[Outcome]] = list(map(list, itertools.repeat(zeros, len(trajectories))))  # a row each, made in C
        failed: list[FailedCall] = []

        def sync_part(then_settle: bool) -> None:
            self._run_sync(trajectories, grid, strict)
            if then_settle:
                failed.extend(self._settle(trajectories, grid))

        if not self._async:  # the common case: one call into the scoring thread
            await self._threads.run("score", functools.partial(sync_part, settle))
            return grid, failed
        try:
            async with asyncio.TaskGroup() as tg:
                if self._inline or self._threaded or self._pooled:
                    tg.create_task(self._threads.run("score", functools.partial(sync_part, False)))
                for i, r in self._async:
                    for t, row in zip(trajectories, grid):
                        tg.create_task(self._call_async(r, t, row, i, strict))
        except BaseExceptionGroup as group:  # a RewardError (strict), or a worker that cannot start
            strict_error = next((e for e in leaf_errors(group) if isinstance(e, RewardError)), None)
            raise (strict_error if strict_error is not None else first_error(group)) from None
        if settle:
            failed.extend(await self._threads.run("score", functools.partial(self._settle, trajectories, grid)))
        return grid, failed

    async def score(self, trajectories: Sequence[Trajectory], strict: bool = False) -> list[FailedCall]:
        """Run every function on every trajectory and set its reward, status and error; the
        failed calls, in trajectory then function order. With `strict`, the first failed call
        raises its RewardError at once (see the module docstring) and nothing is set."""
        _, failed = await self._run(trajectories, settle=True, strict=strict)
        return failed

    async def outcomes(self, trajectories: Sequence[Trajectory]) -> list[list[Outcome]]:
        """Every function's outcome on every trajectory ([trajectory][function]), clipped as
        rewards are; nothing is set. A value that is no reward (NaN, infinite, beyond
        ±MAX_ABS_REWARD) is reported as a `non_finite` Failure."""
        grid, _ = await self._run(trajectories, settle=False)
        clip = self.settings.clip
        for row in grid:
            for i, x in enumerate(row):
                failure = _failure_of(x)
                if failure is not None:
                    row[i] = failure
                elif clip:
                    row[i] = _clipped(x, clip)  # type: ignore[arg-type]
        return grid

    def _settle(
        self, trajectories: Sequence[Trajectory], grid: list[list[Outcome]] | None, columns: list[list[Outcome]] | None = None
    ) -> list[FailedCall]:
        """Set each trajectory's reward, status and error from its outcomes: `grid` by trajectory,
        or `columns` by function (`_score_inline`'s); the failed calls."""
        rewards = self.rewards
        clip = self.settings.clip
        if columns is None:
            assert grid is not None
            columns = [list(map(operator.itemgetter(i), grid)) for i in range(len(rewards))]
        totals = _taken_totals([r.weight for r in rewards], columns, len(trajectories), clip)
        if totals is not None:  # every value taken, every sum finite (the common case): no failure
            for t, total in zip(trajectories, totals):
                t.reward = total
            return []
        if grid is None:
            grid = [list(row) for row in zip(*columns)]
        lo, hi = -MAX_ABS_REWARD, MAX_ABS_REWARD
        failed: list[FailedCall] = []
        for t, row in zip(trajectories, grid):
            total = 0.0
            first: FailedCall | None = None
            for r, x in zip(rewards, row):
                if x.__class__ is float and lo <= x <= hi:  # the common case, inlined
                    total += r.weight * (_clipped(x, clip) if clip else x)
                    continue
                failure = _failure_of(x)
                assert failure is not None
                call = FailedCall(r.name, failure.reason, failure.detail, t)
                failed.append(call)
                first = first or call
            if first is None and total - total != 0.0:  # values in range whose weighted sum overflows: blame the largest
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
        """End the reward worker processes (if any started). Idempotent; blocks briefly.
        Abandoned reward call threads cannot be ended: they exit when their call returns."""
        if self.pool is not None:
            self.pool.close()
