"""Running blocking or GIL-heavy work off the event loop, in named worker threads.

Invariant: a coroutine awaiting `run_in_thread` that gets cancelled does not return before its
thread's work has stopped (it sets the abort flag, which cooperative work checks, and waits), so
cancellation never leaves work running behind the caller's back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


async def run_in_thread(executor: Executor, fn: Callable[[], T], abort: threading.Event) -> T:
    """Run `fn` in `executor`. If the caller is cancelled, set `abort` (which cooperative work
    checks) and wait for the thread to stop before re-raising: nothing keeps running behind it."""
    future = asyncio.get_running_loop().run_in_executor(executor, fn)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        abort.set()
        if not future.done():
            await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # retrieved, so it is not reported as never retrieved
        raise


class Workers:
    """The orchestrator's named single-thread executors and the shared abort flag."""

    def __init__(self, names: tuple[str, ...] = ("bookkeeping", "pack", "score")) -> None:
        self.abort = threading.Event()
        self._executors = {
            name: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"relayrl-{name}")
            for name in names
        }

    async def run(self, name: str, fn: Callable[[], T]) -> T:
        return await run_in_thread(self._executors[name], fn, self.abort)

    def shutdown(self) -> None:
        self.abort.set()
        for executor in self._executors.values():
            executor.shutdown(wait=True, cancel_futures=True)


def burn_cpu(seconds: float, abort: threading.Event | None = None) -> None:
    """Busy-run Python bytecode for `seconds`, holding the GIL as real orchestrator work does
    (the interpreter still hands the GIL to other threads every switch interval)."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < deadline:
        for _ in range(200):
            x += 1
        if abort is not None and abort.is_set():
            return
