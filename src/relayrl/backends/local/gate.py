"""The weight gate of one sampler replica: weight loads land between forward passes, never in one.

Job: with `rollout.interruptible`, a weight load runs in its own thread while a generation runs in
the sampler's thread. The decode loop wraps each forward pass in `step()` (which also tells it
the version of the weights that pass computes with); a load wraps its copy in `load()`, which
waits for the running pass to end, holds back the next one until the copy is done, then the
version changes. A load is preferred over the next step, so it waits at most one forward pass.

Invariant: no forward pass runs while weights are being copied (a pass never mixes two
versions), and the version a pass reports is the one whose weights it computed with; at most one
load runs at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["WeightGate"]


class WeightGate:
    """Forward passes (`step`, any number at once) exclude a weight load (`load`, one at a time)."""

    def __init__(self, version: int = 0) -> None:
        self._cond = threading.Condition()
        self._stepping = 0  # forward passes running now
        self._loading = False  # a load runs or waits for the running passes to end
        self._version = version

    @property
    def version(self) -> int:
        """The version of the weights loaded now."""
        return self._version

    @property
    def load_pending(self) -> bool:
        """A load runs or waits for the running forward passes to end (no new pass starts)."""
        return self._loading

    @contextmanager
    def step(self) -> Iterator[int]:
        """Hold the weights for one forward pass (or a whole call); yields their version."""
        with self._cond:
            while self._loading:
                self._cond.wait()
            self._stepping += 1
            version = self._version
        try:
            yield version
        finally:
            with self._cond:
                self._stepping -= 1
                self._cond.notify_all()

    @contextmanager
    def load(self, version: int) -> Iterator[None]:
        """Change the weights inside the block; they are `version`'s once it exits normally (an
        error keeps the previous version: the caller's load is all or nothing)."""
        with self._cond:
            while self._loading:
                self._cond.wait()
            self._loading = True
            while self._stepping:
                self._cond.wait()
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._cond:
                if ok:
                    self._version = version
                self._loading = False
                self._cond.notify_all()
