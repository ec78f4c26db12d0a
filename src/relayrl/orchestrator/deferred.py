"""Deferred end-of-step jobs and the events that bound them.

The train loop passes through a totally ordered sequence of points:
    first_train(N) < before_optim(N) < commit(N) < first_train(N+1) < ... < run_end
Each deferred job states the point after which it may start and the point before which it must
finish. `reach(p)` marks p reached: it releases the jobs waiting to start at p and then awaits
every job that must finish by p (re-raising the first error).

Invariant: every job is a task of the run's TaskGroup (so the first error anywhere cancels it and
nothing outlives the run), it starts no earlier than its start point, and `reach` does not return
before every job due at that point has finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum


class Phase(IntEnum):
    FIRST_TRAIN = 0  # train_step(N, mb 0) has been issued
    BEFORE_OPTIM = 1  # about to issue optim_step(N)
    COMMIT = 2  # optim_step(N) returned


@dataclass(slots=True, frozen=True, order=True)
class Point:
    step: int
    phase: Phase

    def __str__(self) -> str:
        return "run_end" if self == RUN_END else f"{self.phase.name.lower()}({self.step})"


RUN_END = Point(2**62, Phase.COMMIT)


def first_train(step: int) -> Point:
    return Point(step, Phase.FIRST_TRAIN)


def before_optim(step: int) -> Point:
    return Point(step, Phase.BEFORE_OPTIM)


def commit(step: int) -> Point:
    return Point(step, Phase.COMMIT)


@dataclass(slots=True)
class _Job:
    name: str
    start_after: Point
    finish_before: Point
    started: asyncio.Future[None]
    task: asyncio.Task[None] | None = None


class DeferredJobs:
    def __init__(self, task_group: asyncio.TaskGroup) -> None:
        self._tg = task_group
        self._reached: Point | None = None
        self._jobs: list[_Job] = []

    @property
    def reached(self) -> Point | None:
        return self._reached

    def schedule(
        self,
        name: str,
        fn: Callable[[], Awaitable[None]],
        *,
        start_after: Point,
        finish_before: Point,
    ) -> asyncio.Task[None]:
        if finish_before < start_after:
            raise ValueError(f"job {name}: finish point {finish_before} precedes start point {start_after}")
        if self._reached is not None and finish_before <= self._reached:
            raise ValueError(f"job {name}: finish point {finish_before} already passed ({self._reached})")
        loop = asyncio.get_running_loop()
        job = _Job(name, start_after, finish_before, loop.create_future())
        if self._reached is not None and start_after <= self._reached:
            job.started.set_result(None)
        task = self._tg.create_task(self._run(job, fn), name=f"deferred:{name}")
        job.task = task
        self._jobs.append(job)
        return task

    async def _run(self, job: _Job, fn: Callable[[], Awaitable[None]]) -> None:
        await job.started
        await fn()

    async def reach(self, point: Point) -> None:
        """Mark `point` reached: release jobs that may start, then join jobs due by it."""
        if self._reached is not None and point < self._reached:
            raise ValueError(f"point {point} reached after {self._reached}")
        self._reached = point
        due: list[_Job] = []
        for job in self._jobs:
            if job.start_after <= point and not job.started.done():
                job.started.set_result(None)
            if job.finish_before <= point:
                due.append(job)
        if not due:
            return
        self._jobs = [j for j in self._jobs if j.finish_before > point]
        tasks = [j.task for j in due if j.task is not None]
        await asyncio.wait(tasks)
        for task in tasks:
            if task.cancelled():
                raise asyncio.CancelledError()
            exc = task.exception()
            if exc is not None:
                raise exc

    def pending(self) -> list[str]:
        return [j.name for j in self._jobs]
