"""What a failure means to the person who started the run: the two bases every relayrl error
the command line reports on its own derives from, and the first error of a task group.

- `UserError`: bad input (a config key or value, task data, a reward or environment entry, the
  model path, the run directory, a refused resume, a bad checkpoint). The message names what and
  where in one line; `relayrl` prints it and exits 2, with no traceback.
- `RunFailed`: a run that started and failed for a reason the user can act on (a reward that
  failed under `task.strict_rewards`, no reward worker, every group filtered, a trajectory that
  cannot be packed, non-finite steps). One line; `relayrl` exits 1, naming the checkpoint to
  resume from when resuming can help (`resumable`).
- Anything else (a `ValueError` from a bug included) is unexpected: `relayrl` prints one line
  naming the exception's type and exits 1, keeping its traceback in RUN_DIR/error.txt.

Invariant: this module imports no other relayrl module, so any module may import it; an
exception class is a `UserError` or a `RunFailed` only when its every raise site means that.
`first_error` returns one exception of a group, never a group.
"""

from __future__ import annotations

from typing import ClassVar


class UserError(ValueError):
    """Bad input; the message names what and where in one line. (A ValueError, as every such
    error was before this base existed, so callers that catch ValueError still catch it.)"""


class RunFailed(Exception):
    """A run that started and failed for a reason the user can act on; the message says what
    and where in one line. `resumable`: whether continuing from the newest checkpoint can help
    (the command line then names that checkpoint)."""

    resumable: ClassVar[bool] = True


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first error in `group` (nested groups flattened, depth first, in order) that is not an
    `asyncio.CancelledError`; a cancellation if that is all it holds."""
    from asyncio import CancelledError

    errors = leaf_errors(group)
    for exc in errors:
        if not isinstance(exc, CancelledError):
            return exc
    return errors[0] if errors else group


def leaf_errors(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """Every exception in `group` that is not a group, depth first, in order."""
    errors: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = list(exc.exceptions)
        else:
            errors.append(exc)
    return errors
