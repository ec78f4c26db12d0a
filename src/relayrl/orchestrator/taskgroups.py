"""What an `asyncio.TaskGroup` that failed raised, as the caller should see it.

Invariant: `first_error` returns one exception of the group, never a group: the first (depth
first, in order) that is not a cancellation, so a run's error reaches its caller as itself. It
lives in relayrl/errors.py (rewards/ uses it too and must not import the orchestrator).
"""

from __future__ import annotations

from relayrl.errors import first_error

__all__ = ["first_error"]
