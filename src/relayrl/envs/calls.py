"""Calling an environment's `start` and `step` for the episode runner: every call bounded by
`rollout.env_step_timeout_s`, none able to hang the run, each given exactly one outcome.

- Coroutine functions are awaited on the event loop, all calls of a batch at once, each in its
  own task; one past the bound is cancelled and waited for at most `CANCEL_GRACE_S` (one that
  ignores cancelling is left to end on its own, referenced until then).
- Plain functions run one after another in an environment call thread ("relayrl-env-call"), one
  batch at a time (the batches of several sampler replicas and of the held-out evaluation take
  turns, so an environment's sync code never runs on two threads at once, abandoned calls aside),
  which the event loop watches without polling (it sleeps until the deadline of the call in
  progress): a call still running at its deadline gets the `timeout` outcome, its thread is
  abandoned (a Python thread cannot be stopped: it runs on until the call returns, then exits
  without touching the results) and the batch's remaining calls go on in a new thread.
- Whatever a call raises, `SystemExit` and `GeneratorExit` included, is its `raised` outcome,
  never raised here (a `KeyboardInterrupt` on the loop's thread is the process's, and propagates).

Invariants:
- At most `MAX_ABANDONED_THREADS` abandoned environment call threads are alive at once:
  abandoning one more fails the run (`TooManyStuckCalls`, naming the environment and the call).
- When the caller is cancelled (the run stopping: a signal, the stall watchdog, another stage's
  error), the thread in progress is abandoned at once and starts no further call, and a task in
  progress is cancelled and waited for at most `CANCEL_GRACE_S`: stopping never waits on user
  code that does not return. Environment call threads are daemon threads, so neither does the
  process's exit.
- Results are written only by the thread that ran the call, under a lock that the watcher takes
  to abandon it, so a call that returns just as its deadline passes gets exactly one outcome.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

from relayrl.abandoned import cancel_within
from relayrl.errors import first_error

__all__ = ["CANCEL_GRACE_S", "MAX_ABANDONED_THREADS", "Call", "CallFailed", "EnvCalls", "TooManyStuckCalls", "describe"]

#: abandoned environment call threads (past rollout.env_step_timeout_s, still running) a run tolerates
MAX_ABANDONED_THREADS = 4
#: how long a cancelled async call is waited for before it is left to end on its own
CANCEL_GRACE_S = 2.0
_THREAD_NAME = "relayrl-env-call"

#: one call: (method, its argument, where it is: "step (prompt 'p', sample 0, turn 2)")
Call = tuple[Callable[[object], object], object, str]


@dataclass(slots=True, frozen=True)
class CallFailed:
    """Why a call has no value: `reason` "timeout" or "raised"; `detail` one line."""

    reason: str
    detail: str


class TooManyStuckCalls(RuntimeError):
    """Abandoning one more call's thread would leave more than MAX_ABANDONED_THREADS running."""

    def __init__(self, where: str, running: int) -> None:
        super().__init__(f"{running} abandoned environment call threads are still running (at most {MAX_ABANDONED_THREADS})")
        self.where = where
        self.running = running


def describe(exc: BaseException) -> str:
    """An exception as one short line: `Type: message`."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


class _Runner:
    """One environment call thread, running `calls[i]` for the i of `order[start:]`, one after
    another, until done or abandoned. `current` is the position in `order` of the call in
    progress or about to start, `started` when it became current (time.monotonic);
    `current == len(order)`: all done."""

    __slots__ = ("abandoned", "current", "done", "lock", "loop", "started", "thread")

    def __init__(
        self, calls: Sequence[Call], order: list[int], out: list[tuple[object, float]], start: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.lock = threading.Lock()
        self.current = start
        self.started = time.monotonic()
        self.abandoned = False
        self.loop = loop
        self.done: asyncio.Future[None] = loop.create_future()
        self.thread = threading.Thread(target=self._work, args=(calls, order, out), name=_THREAD_NAME, daemon=True)

    def _work(self, calls: Sequence[Call], order: list[int], out: list[tuple[object, float]]) -> None:
        lock, monotonic, perf = self.lock, time.monotonic, time.perf_counter
        k = self.current
        try:
            while k < len(order):
                with lock:
                    if self.abandoned:
                        return  # the caller stopped between two calls: start no further one
                method, arg, _ = calls[order[k]]
                began = perf()
                value: object
                try:
                    value = method(arg)
                except BaseException as exc:  # user code in a worker thread: SystemExit, KeyboardInterrupt raised by it too
                    value = CallFailed("raised", describe(exc))
                seconds = perf() - began
                with lock:
                    if self.abandoned:
                        return  # its deadline passed, or the caller stopped: the watcher gave it its outcome
                    out[order[k]] = (value, seconds)
                    k = self.current = k + 1
                    self.started = monotonic()
        finally:
            with lock:
                signal = not self.abandoned
            if signal:
                try:
                    self.loop.call_soon_threadsafe(_finish, self.done)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def _invoke(method: Callable[[object], object], arg: object) -> object:
    """`await method(arg)`, whatever it raises as a CallFailed (but our own cancelling and a
    KeyboardInterrupt: asyncio would let SystemExit end the loop)."""
    try:
        return await cast(Awaitable[object], method(arg))
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # cancelled by us (its deadline) or by the caller
        return CallFailed("raised", "CancelledError (raised by the environment, not a cancellation)")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # user code: SystemExit and GeneratorExit are its errors, not ours
        return CallFailed("raised", describe(exc))


class EnvCalls:
    """An environment's calls for one run (see the module): `run` a batch; the abandoned threads
    are tracked across batches. `timeout_s` 0: no bound (the stall watchdog is the only one)."""

    def __init__(self, timeout_s: float, max_abandoned: int = MAX_ABANDONED_THREADS) -> None:
        self.timeout_s = timeout_s
        self.max_abandoned = max_abandoned
        self._abandoned: list[threading.Thread] = []
        self._plain_turn = asyncio.Lock()  # one batch of plain calls at a time (see the module)

    def abandoned(self) -> list[threading.Thread]:
        """The abandoned threads still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return list(self._abandoned)

    def _timed_out(self) -> CallFailed:
        return CallFailed("timeout", f"no result within {self.timeout_s:g} s (rollout.env_step_timeout_s)")

    async def run(self, calls: Sequence[Call]) -> list[tuple[object, float]]:
        """Each call's outcome (its value, or a CallFailed) and the seconds it took, in order:
        coroutine functions awaited on the loop, all at once; plain ones one after another in an
        environment call thread. Raises TooManyStuckCalls (see the module)."""
        out: list[tuple[object, float]] = [(None, 0.0)] * len(calls)
        asynchronous = [i for i, c in enumerate(calls) if inspect.iscoroutinefunction(c[0])]
        plain = [i for i, c in enumerate(calls) if not inspect.iscoroutinefunction(c[0])]
        if not asynchronous:
            await self._run_plain(calls, plain, out)
            return out
        try:
            async with asyncio.TaskGroup() as tg:
                for i in asynchronous:
                    tg.create_task(self._run_async(calls[i], out, i), name="env-calls")
                if plain:
                    await self._run_plain(calls, plain, out)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return out

    async def _run_async(self, call: Call, out: list[tuple[object, float]], i: int) -> None:
        method, arg, _ = call
        began = time.perf_counter()
        task: asyncio.Task[object] = asyncio.create_task(_invoke(method, arg), name="env-call")
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s if self.timeout_s > 0 else None)
        except asyncio.CancelledError:
            await cancel_within(task, CANCEL_GRACE_S)
            raise
        if done:
            out[i] = (task.result(), time.perf_counter() - began)
            return
        await cancel_within(task, CANCEL_GRACE_S)
        out[i] = (self._timed_out(), self.timeout_s)

    async def _run_plain(self, calls: Sequence[Call], order: list[int], out: list[tuple[object, float]]) -> None:
        """`calls[i]` for each i of `order`, one after another, in environment call threads."""
        loop = asyncio.get_running_loop()
        start = 0
        async with self._plain_turn:
            while start < len(order):
                runner = _Runner(calls, order, out, start, loop)
                runner.thread.start()
                start = await self._watch(runner, calls, order, out)

    async def _watch(self, runner: _Runner, calls: Sequence[Call], order: list[int], out: list[tuple[object, float]]) -> int:
        """Wait for `runner` to finish its calls (→ len(order)) or for its call in progress to
        pass its deadline (→ the position in `order` of the next call to run, in a new thread)."""
        n = len(order)
        try:
            while True:
                with runner.lock:
                    k, started = runner.current, runner.started
                if k >= n:
                    await runner.done  # set right after: the thread is exiting
                    return n
                wait = None if self.timeout_s <= 0 else started + self.timeout_s - time.monotonic()
                if wait is None or wait > 0:
                    done, _ = await asyncio.wait({runner.done}, timeout=wait)
                    if done:
                        return n
                    continue
                with runner.lock:
                    if runner.current != k:
                        continue  # it returned just now: the next call has its own deadline
                    runner.abandoned = True
                out[order[k]] = (self._timed_out(), self.timeout_s)
                self._abandon(runner.thread, calls[order[k]][2])
                return k + 1
        except asyncio.CancelledError:
            with runner.lock:
                runner.abandoned = True  # it starts no further call and writes nothing
            if runner.thread.is_alive():
                runner.thread.name = f"{_THREAD_NAME} (abandoned)"
            raise

    def _abandon(self, thread: threading.Thread, where: str) -> None:
        thread.name = f"{_THREAD_NAME} (abandoned)"
        running = [t for t in self._abandoned if t.is_alive()]
        running.append(thread)
        self._abandoned = running
        if len(running) > self.max_abandoned:
            raise TooManyStuckCalls(where, len(running))
