"""Reward calls of in-process sync callables (Python-API functions), each bounded by a deadline.

Job: run `call(0) … call(n - 1)` in order in a reward call thread ("relayrl-reward-call") while
the calling thread (the scoring thread) watches the call in progress: a call still running
`timeout_s` after it started is given the `timed_out` outcome, its thread is abandoned (a Python
thread cannot be stopped: it runs on until the call returns, then exits without touching the
results) and the remaining calls go on in a new thread. Sync callables cannot go to a worker
process (a closure, a lambda, a bound method of a live object cannot be pickled), so a thread is
the only place they can run with a deadline.

Invariants:
- Every call gets exactly one outcome, at most about `timeout_s` (plus `_POLL_S`) after it started;
  the calling thread never waits longer than that on one call.
- At most `MAX_ABANDONED_THREADS` abandoned threads are alive at once: abandoning one more raises
  `TooManyAbandoned` (the scorer fails the run, naming the function). The first one abandoned
  warns (`AbandonedRewardThreadWarning`).
- Outcomes are written only by the thread that ran the call, under a lock that the watcher takes
  to abandon it, so a call that returns just as its deadline passes gets exactly one outcome.
- Threads that are not abandoned have exited when `run` returns (they are joined).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

#: abandoned reward call threads (past task.reward_timeout_s, still running) a run tolerates
MAX_ABANDONED_THREADS = 4
#: how often the watcher checks the abort flag
_POLL_S = 0.1

R = TypeVar("R")


class AbandonedRewardThreadWarning(RuntimeWarning):
    """A reward call ran past task.reward_timeout_s in a reward call thread, which was abandoned."""


class TooManyAbandoned(RuntimeError):
    """Abandoning the thread of call `index` would leave more than MAX_ABANDONED_THREADS running."""

    def __init__(self, index: int, running: int) -> None:
        super().__init__(f"{running} abandoned reward call threads are still running (at most {MAX_ABANDONED_THREADS})")
        self.index = index
        self.running = running


class CallsAborted(RuntimeError):
    """The caller's abort flag was set (the run is being cancelled)."""


class _Runner(Generic[R]):
    """One reward call thread, running calls `start … n - 1` until done, stopped or abandoned."""

    __slots__ = ("abandoned", "current", "done", "lock", "started", "thread")

    def __init__(self, call: Callable[[int], R], results: list[R | None], start: int, stop: Callable[[R], bool] | None) -> None:
        self.lock = threading.Lock()
        self.current = -1  # the call in progress (-1: none)
        self.started = 0.0  # when it started (time.monotonic)
        self.abandoned = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._work, args=(call, results, start, stop), name="relayrl-reward-call", daemon=True)

    def _work(self, call: Callable[[int], R], results: list[R | None], start: int, stop: Callable[[R], bool] | None) -> None:
        lock, monotonic = self.lock, time.monotonic
        try:
            for k in range(start, len(results)):
                with lock:
                    if self.abandoned:
                        return
                    self.current, self.started = k, monotonic()
                outcome = call(k)
                with lock:
                    if self.abandoned:
                        return  # its deadline passed: the watcher gave it its outcome
                    results[k] = outcome
                    self.current = -1
                if stop is not None and stop(outcome):
                    return
        finally:
            self.done.set()


class ThreadedCalls:
    """A run's reward call threads: `run` one callable over a batch; the abandoned threads are
    tracked across batches (bounded, see the module docstring)."""

    def __init__(self, timeout_s: float, max_abandoned: int = MAX_ABANDONED_THREADS) -> None:
        self.timeout_s = timeout_s
        self.max_abandoned = max_abandoned
        self._abandoned: list[threading.Thread] = []
        self._warned = False

    def abandoned(self) -> list[threading.Thread]:
        """The abandoned threads still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return list(self._abandoned)

    def run(
        self,
        call: Callable[[int], R],
        n: int,
        timed_out: Callable[[int], R],
        abort: threading.Event,
        name: str,
        stop: Callable[[R], bool] | None = None,
    ) -> list[R | None]:
        """The outcomes of `call(0) … call(n - 1)`, each call bounded by `timeout_s` (`timed_out(k)`
        past it). `call` must not raise. With `stop`, no call starts after one whose outcome
        `stop` accepts (their outcomes stay None). Raises CallsAborted soon after `abort` is set,
        and TooManyAbandoned (see the module docstring). `name` names the function in warnings."""
        results: list[R | None] = [None] * n
        start = 0
        while start < n:
            runner = _Runner(call, results, start, stop)
            runner.thread.start()
            start = self._watch(runner, results, timed_out, abort, name, stop)
        return results

    def _watch(
        self,
        runner: _Runner[R],
        results: list[R | None],
        timed_out: Callable[[int], R],
        abort: threading.Event,
        name: str,
        stop: Callable[[R], bool] | None,
    ) -> int:
        """Wait for `runner` to finish (→ n) or for its call in progress to pass its deadline
        (→ the next call to run, in a new thread)."""
        n = len(results)
        while True:
            with runner.lock:
                k, started = runner.current, runner.started
            wait = _POLL_S if k < 0 else min(_POLL_S, started + self.timeout_s - time.monotonic())
            if runner.done.wait(max(0.0, wait)):
                runner.thread.join()
                return n
            if abort.is_set():
                with runner.lock:
                    runner.abandoned = True  # it starts no further call
                runner.thread.join(_POLL_S)  # a call about to return: its thread exits now
                if runner.thread.is_alive():
                    self._abandon(runner.thread, -1)
                raise CallsAborted("the reward calls' caller is stopping")
            with runner.lock:
                k = runner.current
                if k < 0 or time.monotonic() - runner.started < self.timeout_s:
                    continue
                runner.abandoned = True
            results[k] = outcome = timed_out(k)
            self._abandon(runner.thread, k)
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"reward function {name!r}: a call ran past task.reward_timeout_s = {self.timeout_s:g} s; it is marked failed "
                    "(timeout) and its thread is left running (a Python thread cannot be stopped). A run fails when more than "
                    f"{self.max_abandoned} such threads are still running: to bound this function for good, name it "
                    "'module:function' in task.reward_functions (it then runs in a worker process that is killed at the deadline)",
                    AbandonedRewardThreadWarning,
                    stacklevel=1,
                )
            if stop is not None and stop(outcome):
                return n
            return k + 1

    def _abandon(self, thread: threading.Thread, index: int) -> None:
        thread.name = "relayrl-reward-call (abandoned)"
        running = [t for t in self._abandoned if t.is_alive()]
        running.append(thread)
        self._abandoned = running
        if index >= 0 and len(running) > self.max_abandoned:
            raise TooManyAbandoned(index, len(running))
