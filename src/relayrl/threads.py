"""Running blocking or GIL-heavy work off the event loop, in named worker threads.

`ThreadHost` is the one way work is hosted in a thread: a named single-thread executor (calls run
one at a time, in the order they were made) with an abort flag. The orchestrator's own threads
(`OrchestratorThreads`) and the local backend's workers (a compute object hosted in a `ThreadHost`) use it.

Invariant: a coroutine awaiting `run_in_thread` (or `ThreadHost.call`) that gets cancelled does
not return before its thread's work has stopped (it sets the abort flag, which cooperative work
checks, and waits), so cancellation never leaves work running behind the caller's back. User
code that never checks the flag (an environment's sync `step`) therefore never runs here: it runs
in envs/calls.py's environment call threads, which are abandoned rather than waited for.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

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


class ThreadHost:
    """One named worker thread ("relayrl-<name>") running calls one at a time, in call order,
    and an abort flag that cooperative work checks.

    `abort` is the host's flag (pass one to share it between hosts); `call` may be given a
    per-call flag instead, so that cancelling one call does not abort the calls after it.
    `initializer(*initargs)` runs first in the thread (e.g. its torch threads, its priority)."""

    def __init__(
        self,
        name: str,
        *,
        abort: threading.Event | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        self.name = name
        self.abort = abort if abort is not None else threading.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"relayrl-{name}", initializer=initializer, initargs=initargs)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def call(self, fn: Callable[[], T], abort: threading.Event | None = None) -> T:
        """Run `fn` in the thread after the calls made before it. If the caller is cancelled, set
        `abort` (default: the host's flag) and wait for `fn` to stop before re-raising."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        return await run_in_thread(self._executor, fn, self.abort if abort is None else abort)

    def close(self, abort: bool = True) -> None:
        """Cancel queued calls and wait for the running one; with `abort`, set the host's flag
        first so that cooperative work stops early. Idempotent; blocks (see `aclose`)."""
        self._closed = True
        if abort:
            self.abort.set()
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def aclose(self, abort: bool = True) -> None:
        """`close` without blocking the event loop."""
        if not self._closed:
            self._closed = True
            if abort:
                self.abort.set()
            await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)


class OrchestratorThreads:
    """The orchestrator's own named thread hosts (bookkeeping, packing, scoring, environments),
    sharing one abort flag. Not workers: in relayrl a worker is a sampler or a trainer."""

    def __init__(self, names: tuple[str, ...] = ("bookkeeping", "pack", "score", "env")) -> None:
        self.abort = threading.Event()
        self._hosts = {name: ThreadHost(name, abort=self.abort) for name in names}

    async def run(self, name: str, fn: Callable[[], T]) -> T:
        return await self._hosts[name].call(fn)

    def shutdown(self) -> None:
        self.abort.set()
        for host in self._hosts.values():
            host.close()


@contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """The interpreter's thread switch interval set to `seconds` inside the block (0: unchanged),
    restored after. While a thread runs Python (packing, bookkeeping, a reward function), another
    that wants the GIL (the event loop, Ray's reply callbacks) waits up to this long each time it
    does (`orchestrator.switch_interval_ms`)."""
    before = sys.getswitchinterval()
    if seconds > 0:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


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
