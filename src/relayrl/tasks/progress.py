"""Progress of generating a task's data before a run starts, on the console.

Job: `GenerationProgress.tick(done)` is called for each item generated; once generation has taken
more than `quiet_s` it prints one line to stderr every `every_s` seconds (items done of total,
percent, seconds so far), and `finish()` prints a last line if any was printed. Generation that
is quick prints nothing.

Invariant: a tick costs a counter check (the clock is read every `_CHECK_EVERY` items); nothing
here defers signals: generation runs in the main thread, where SIGINT / SIGTERM exit at once
before a run starts (cli/signals.py).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_CHECK_EVERY = 256


class GenerationProgress:
    def __init__(self, what: str, total: int, quiet_s: float = 1.5, every_s: float = 5.0, out: TextIO | None = None) -> None:
        self.what = what
        self.total = total
        self.quiet_s = quiet_s
        self.every_s = every_s
        self._out = out
        self._start = time.monotonic()
        self._next = self._start + quiet_s
        self.lines = 0

    def _say(self, text: str) -> None:
        print(f"relayrl: {text}", file=self._out or sys.stderr, flush=True)
        self.lines += 1

    def tick(self, done: int) -> None:
        if done % _CHECK_EVERY:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        self._say(f"generating {self.what}: {done:,}/{self.total:,} ({done / self.total:.0%}, {now - self._start:.0f} s)")

    def finish(self) -> None:
        if self.lines:
            self._say(f"generated {self.what}: {self.total:,} in {time.monotonic() - self._start:.1f} s")
