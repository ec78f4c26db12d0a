"""Event-loop health: how late a periodic tick wakes up.

Invariant: the monitor only measures; it never blocks the loop (one sleep per tick), and the
maximum lag since the last `take_max_ms()` is what each step reports as `loop_lag_max_ms`.
"""

from __future__ import annotations

import asyncio
import time


class LoopLagMonitor:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._max_s = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = time.perf_counter() - start - self.interval_s
            self._max_s = max(self._max_s, lag)

    def take_max_ms(self) -> float:
        """The largest lag seen since the previous call, in milliseconds; resets the window."""
        value, self._max_s = self._max_s, 0.0
        return value * 1e3
