"""What must end with this process even when it exits at once.

A signal before a run starts, or a run that cannot wind down in time, ends the process with
`os._exit` (relayrl.cli.signals), which runs no `finally` block and no atexit handler. A part that
started processes which would outlive it (a local Ray cluster: its raylet's agents and workers run
in their own process groups) registers a hook here that ends them; `hard_exit` runs every hook,
then exits.

Invariant: a hook is bounded (the Ray cluster's takes at most 5 s: `END_BOUND_S` in
backends/ray/cluster.py, which adds to a signal's answer time) and never raises out of
`run_hooks` (an error in one does not stop the others or the exit); hooks run at most once each,
in registration order, and a part unregisters its hook once it ended its processes the ordinary
way. No lock: `run_hooks` runs in a signal handler, which may interrupt the main thread anywhere,
so the registry is a dict changed only by single operations (atomic under the GIL). This module
imports no other relayrl module.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import NoReturn

_hooks: dict[int, Callable[[], None]] = {}
_ids = itertools.count()


def on_hard_exit(hook: Callable[[], None]) -> Callable[[], None]:
    """Run `hook` if the process exits at once (`hard_exit`); returns the function that
    unregisters it (idempotent)."""
    key = next(_ids)
    _hooks[key] = hook

    def unregister() -> None:
        _hooks.pop(key, None)

    return unregister


def run_hooks() -> None:
    """Run (and forget) every registered hook, oldest first; an error in one is ignored."""
    for key in sorted(_hooks):
        hook = _hooks.pop(key, None)
        if hook is None:
            continue  # unregistered meanwhile
        try:
            hook()
        except Exception:  # noqa: S110 - exiting anyway: the other hooks and the exit matter more
            pass


def hard_exit(code: int) -> NoReturn:
    """End what the hooks end, then exit at once with `code` (`os._exit`)."""
    run_hooks()
    os._exit(code)
