"""The stall watchdog (`orchestrator.stall_timeout_s`): a run in which no step commits for that
long writes where everything is (every thread's stack, every asyncio task's stack) to
`stall.txt` in the run directory, prints where it is stuck, and fails with `StallError` instead of
hanging forever.

A thread watches the clock, so a blocked event loop is caught too: the thread writes the threads'
stacks (the loop's thread shows what blocks it) and wakes the loop, where `run()` adds the tasks'
stacks and raises. If the loop does not answer within `grace_s`, the thread ends the process with
exit 1, naming the file.

Invariant: the clock restarts at every commit (`progress()`); the thread ends with `run()`.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import threading
import time
import traceback
from pathlib import Path

STALL_FILE = "stall.txt"


class StallError(RuntimeError):
    """No step committed within `orchestrator.stall_timeout_s`."""


def _thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def _where(task: asyncio.Task[object]) -> str:
    """`task`'s innermost frame, as file:line in function."""
    stack = task.get_stack()
    if not stack:
        return "(not started or finished)"
    frame = stack[-1]
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"


class StallWatchdog:
    def __init__(self, timeout_s: float, run_dir: Path | None, grace_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.path = run_dir / STALL_FILE if run_dir is not None else None
        self.grace_s = grace_s
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._answered = threading.Event()
        self._stalled_for = 0.0

    def progress(self) -> None:
        """A step committed: the clock restarts."""
        self._last = time.monotonic()

    def _write(self, text: str, mode: str) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, mode, encoding="utf-8") as f:
                f.write(text)
        except OSError:
            pass  # the stall is reported whether or not its stacks could be written

    def _watch(self, loop: asyncio.AbstractEventLoop, fired: asyncio.Event) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            idle = time.monotonic() - self._last
            if idle < self.timeout_s:
                continue
            self._stalled_for = idle
            head = f"no step committed for {idle:.0f}s (orchestrator.stall_timeout_s = {self.timeout_s:g})"
            self._write(f"{head}\n\n=== threads ===\n{_thread_stacks()}", "w")
            loop.call_soon_threadsafe(fired.set)
            if self._answered.wait(self.grace_s) or self._stop.is_set():
                return
            where = f"; stacks in {self.path}" if self.path else ""
            print(f"relayrl: no step committed for {idle:.0f}s and the event loop is blocked{where}", file=sys.stderr, flush=True)
            os._exit(1)

    async def run(self) -> None:
        """Wait for a stall (forever, if none), then report it and raise `StallError`."""
        if self.timeout_s <= 0:
            await asyncio.Event().wait()
        fired = asyncio.Event()
        self._last = time.monotonic()
        thread = threading.Thread(target=self._watch, args=(asyncio.get_running_loop(), fired), name="relayrl-watchdog", daemon=True)
        thread.start()
        try:
            await fired.wait()
            self._answered.set()
            me = asyncio.current_task()
            tasks = sorted((t for t in asyncio.all_tasks() if t is not me), key=lambda t: t.get_name())
            lines = [f"  {t.get_name()}: {_where(t)}" for t in tasks]
            stacks = io.StringIO()
            for t in tasks:
                t.print_stack(file=stacks)
            self._write("\n\n=== asyncio tasks ===\n" + stacks.getvalue(), "a")
            where = f" (stacks in {self.path})" if self.path else ""
            report = f"relayrl: no step committed for {self._stalled_for:.0f}s; tasks are at:\n" + "\n".join(lines)
            print(report, file=sys.stderr, flush=True)
            raise StallError(f"no step committed for {self._stalled_for:.0f}s (orchestrator.stall_timeout_s = {self.timeout_s:g}){where}")
        finally:
            self._stop.set()
            await asyncio.to_thread(thread.join)
