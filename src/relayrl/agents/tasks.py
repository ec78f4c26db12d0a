"""The asyncio tasks of one agent episode: the agent's own call and every task it starts.

Job: `EpisodeTasks.start` runs an agent's call in its own task, in a context that names the
episode; while any episode runs, a task factory on the loop files every task created in such a
context (by the agent, or by a task it started, transitively) under its episode. `end` cancels
the episode's tasks still running (the agent's, past its timeout, and its background tasks) and
waits for them at most `CANCEL_GRACE_S`; then the coroutine of one that caught the cancellation
is closed (GeneratorExit where it waits: a CancelledError handler does not catch it), and one
that catches even that is left to end on its own, referenced until then, and counted (`end`'s
return value): the process cannot end it (the run does not wait for it, but asyncio's shutdown
does, until a signal: see README "Agents").

Invariants:
- an episode's tasks never outlive its `end` unless they ignore cancelling; tasks created outside
  an agent's context (the endpoint's request handlers, the run's stages) are never touched;
- the factory chains to the one installed before it and is removed when the last episode ends
  (unless something replaced it meanwhile). Threads an agent starts are not tracked: a Python
  thread cannot be stopped.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

from relayrl.abandoned import abandon

__all__ = ["CANCEL_GRACE_S", "Clocked", "EpisodeTasks"]

#: how long an episode's cancelled tasks are waited for before they are left to end on their own
CANCEL_GRACE_S = 2.0

T = TypeVar("T")

_EPISODE: contextvars.ContextVar[EpisodeTasks | None] = contextvars.ContextVar("relayrl_agent_episode", default=None)


class _Factory:
    """The loop's task factory while episodes run: the previous one's task, filed under the
    episode of the context it is created in."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.users = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        context = kwargs.get("context")
        owner = context.get(_EPISODE, None) if context is not None else _EPISODE.get()
        if self.previous is not None:
            task = self.previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        if owner is not None and isinstance(task, asyncio.Task):
            owner._tasks.add(task)
        return task


def _acquire(loop: asyncio.AbstractEventLoop) -> None:
    factory = loop.get_task_factory()
    if not isinstance(factory, _Factory):
        factory = _Factory(factory)
        loop.set_task_factory(factory)
    factory.users += 1


def _release(loop: asyncio.AbstractEventLoop) -> None:
    factory = loop.get_task_factory()
    if isinstance(factory, _Factory):
        factory.users -= 1
        if factory.users <= 0:
            loop.set_task_factory(factory.previous)


def _close(task: asyncio.Task[Any]) -> None:
    """Throw GeneratorExit into a task's coroutine where it waits, then cancel the task, whose
    next step then ends it; a coroutine that catches GeneratorExit too cannot be ended."""
    try:
        task.get_coro().close()
    except RuntimeError:  # "coroutine ignored GeneratorExit"
        return
    task.cancel()


class Clocked:
    """`await Clocked(coro, report)` awaits `coro` as `await coro` would, and calls
    `report(seconds)` for its longest step (the code it ran between two awaits, holding the event
    loop) when it ends: an agent that blocks the loop (time.sleep, blocking I/O) is told apart."""

    def __init__(self, coro: Coroutine[Any, Any, T], report: Callable[[float], None]) -> None:
        self._coro = coro
        self._report = report

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, longest = self._coro, 0.0
        value: Any = None
        thrown: BaseException | None = None
        try:
            while True:
                began = time.perf_counter()
                try:
                    yielded = coro.throw(thrown) if thrown is not None else coro.send(value)
                except StopIteration as stop:
                    return stop.value
                finally:
                    longest = max(longest, time.perf_counter() - began)
                try:
                    value, thrown = (yield yielded), None
                except GeneratorExit:
                    coro.close()
                    raise
                except BaseException as exc:  # thrown into the awaiting task (a cancellation): passed on
                    value, thrown = None, exc
        finally:
            self._report(longest)


class EpisodeTasks:
    """One episode's tasks (see the module): `start` its agent call once, `end` it once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """`coro` in a task of its own, in the episode's context."""
        loop = asyncio.get_running_loop()
        _acquire(loop)
        self._loop = loop
        context = contextvars.copy_context()
        context.run(_EPISODE.set, self)
        return loop.create_task(coro, name=self.name, context=context)

    async def end(self) -> int:
        """Cancel the episode's tasks still running and wait for them (CANCEL_GRACE_S at most);
        the number left running (they ignored cancelling)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCEL_GRACE_S
        cancelled: set[asyncio.Task[Any]] = set()
        try:
            while True:  # a task cancelled may start another one on its way out
                fresh = {t for t in self._tasks if not t.done() and t not in cancelled}
                if not fresh or loop.time() >= deadline:
                    break
                for task in fresh:
                    task.cancel()
                cancelled |= fresh
                await asyncio.wait(cancelled, timeout=max(0.0, deadline - loop.time()))
            stubborn = [t for t in self._tasks if not t.done()]
            for task in stubborn:  # they caught CancelledError: close their coroutines (GeneratorExit at the await)
                _close(task)
            if stubborn:
                await asyncio.wait(stubborn, timeout=0.1)
        finally:
            if self._loop is not None:
                _release(self._loop)
                self._loop = None
            left = {t for t in self._tasks if not t.done()}
            for task in self._tasks:  # those left running stay referenced until they end; every outcome is dropped
                abandon(task)
            self._tasks.clear()
        return len(left)
