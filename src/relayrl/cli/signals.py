"""How the process answers SIGINT (Ctrl-C) and SIGTERM (a scheduler preempting the job).

Outside a run (parsing, imports, loading a model) a signal exits at once: there is nothing to
wind down, and an interrupted import must not end in a traceback. During a run the handlers are
plain `signal.signal` handlers, which the main thread runs at its next bytecode even while the
event loop is busy (asyncio's own handlers wait for the loop); they only schedule the stop: the
last step that committed is checkpointed without waiting for the step in flight
(orchestrator/checkpointing.py `Checkpointer.stop`), then the run is cancelled, which winds it
down cleanly (summary "cancelled", trace closed, no task or worker thread left). Without
checkpoints, before the run's first commit (start-up), or when that checkpoint is not written
within three quarters of `grace_s`, the run is cancelled at once and a resume starts from the
newest checkpoint.

Invariant: a signal is answered within `grace_s` seconds whatever the run is doing: if the run has
not wound down by then (a callback stuck on the loop, a hung worker call), or a second signal
arrives, the process exits at once with the signal's exit code (130 / 143). Exiting at once
(`relayrl.exits.hard_exit`) first ends the processes a part registered (a local Ray cluster the
run started, at any moment of its start-up): no process of the run outlives it. Checkpoints are
complete or absent, so nothing a resume needs is lost; the run directory's lock goes with the
process. (A single C call that holds the GIL, such as one huge garbage collection, delays even
this: config/sizing.py refuses runs that would build such heaps.)
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from relayrl.exits import hard_exit

if TYPE_CHECKING:
    from relayrl.orchestrator.program import Program, RunResult

EXIT_CODES: dict[signal.Signals, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Stopped(Exception):
    """The run was cancelled because the process received SIGINT or SIGTERM."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _code(signum: int) -> int:
    return EXIT_CODES.get(signal.Signals(signum), 1)


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    print("interrupted", file=sys.stderr, flush=True)
    hard_exit(_code(signum))


def exit_on_signals() -> None:
    """Until a run starts: SIGINT and SIGTERM exit at once."""
    for sig in EXIT_CODES:
        signal.signal(sig, _exit_at_once)


async def run_until_stopped(program: Program, grace_s: float, resume_hint: Callable[[], str]) -> RunResult:
    """Run `program`; SIGINT / SIGTERM cancel it (raising `Stopped`), or end the process after
    `grace_s` seconds or a second signal, printing `resume_hint()`. A CancelledError that no
    signal caused propagates as the bug it is."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    stopped: list[int] = []
    done = threading.Event()

    def exit_now(reason: str, code: int) -> None:
        print(f"stopped ({reason}; no summary written){resume_hint()}", file=sys.stderr, flush=True)
        hard_exit(code)

    def deadline(code: int) -> None:
        if not done.wait(grace_s):
            exit_now(f"the run did not wind down within orchestrator.stop_grace_s={grace_s:g} s", code)

    cancelled: list[bool] = []

    def cancel_once() -> None:
        if not cancelled:
            cancelled.append(True)
            task.cancel()

    def begin_stop() -> None:
        # checkpoint the last step that committed, then cancel; without checkpoints (or when it is
        # not written within 3/4 of the grace) cancel at once, as a kill would find the newest checkpoint
        if program.checkpointer.stop(cancel_once):
            loop.call_later(grace_s * 0.75, cancel_once)
        else:
            cancel_once()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        code = _code(signum)
        if stopped:
            exit_now("second signal", code)
        stopped.append(code)
        loop.call_soon_threadsafe(begin_stop)
        threading.Thread(target=deadline, args=(code,), name="relayrl-stop-deadline", daemon=True).start()

    previous = {sig: signal.signal(sig, on_signal) for sig in EXIT_CODES}
    try:
        return await program.run()
    except asyncio.CancelledError:
        if stopped:
            raise Stopped(stopped[0]) from None
        raise
    finally:
        done.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
