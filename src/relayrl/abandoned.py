"""Asyncio tasks given up on while still running: a call past its bound that ignores being
cancelled (a worker stuck in native code, user code that catches `CancelledError`).

Job: `abandon` keeps such a task referenced until it ends, then retrieves and drops its outcome;
`cancel_within` cancels a task, waits a grace period for it, and abandons it if it runs on. The
environment calls (envs/calls.py), the bounded worker calls (orchestrator/deadlines.py) and an
agent episode's tasks (agents/tasks.py) give up on tasks this one way.

Invariant: an abandoned task is never garbage-collected while it runs (the event loop keeps only
weak references to tasks) and never reports "exception was never retrieved"; nothing waits for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["abandon", "cancel_within", "running"]

_running: set[asyncio.Future[Any]] = set()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: its outcome no longer matters


def _forget(task: asyncio.Future[Any]) -> None:
    _running.discard(task)
    _retrieve(task)


def abandon(task: asyncio.Future[Any]) -> None:
    """Keep `task` referenced until it ends, then drop its outcome (at once if it has ended)."""
    if task.done():
        _retrieve(task)
        return
    _running.add(task)
    task.add_done_callback(_forget)


async def cancel_within(task: asyncio.Future[Any], grace: float) -> None:
    """Cancel `task` and wait up to `grace` seconds for it to end; one still running is abandoned."""
    task.cancel()
    abandon(task)
    await asyncio.wait({task}, timeout=grace)


def running() -> int:
    """Abandoned tasks still running."""
    return len(_running)
