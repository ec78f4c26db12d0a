"""What an `asyncio.TaskGroup` that failed raised, as the caller should see it.

Invariant: `first_error` returns one exception of the group, never a group: the first (depth
first, in order) that is not a cancellation, so a run's error reaches its caller as itself.
"""

from __future__ import annotations

import asyncio


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first error in `group` (nested groups flattened) that is not a `CancelledError`; a
    cancellation if that is all it holds."""
    errors: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = list(exc.exceptions)
        else:
            errors.append(exc)
    for exc in errors:
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return errors[0] if errors else group
