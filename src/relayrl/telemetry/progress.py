"""Terminal progress: one line per step (plain lines when stdout is not a terminal).

Invariant: `on_step_end` only formats and prints figures already reduced; it never blocks the
trainer (it runs in the bookkeeping thread like every other end-of-step callback).
"""

from __future__ import annotations

import time

from rich.console import Console

from relayrl.callbacks import Callback
from relayrl.types import StepResult


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


class ProgressPrinter(Callback):
    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self._total = total_steps
        self._console = console or Console(highlight=False)
        self._start = time.perf_counter()

    def on_step_end(self, step: int, result: StepResult) -> None:
        m = result.metrics
        elapsed = time.perf_counter() - self._start
        done = step + 1
        eta = elapsed / done * (self._total - done)
        gap = m.get("boundary_gap_sec")
        gap_ms = gap * 1e3 if isinstance(gap, float) else None
        self._console.print(
            f"step {done}/{self._total}  reward {_fmt(m.get('reward_mean'), '.3f')}  "
            f"step {_fmt(m.get('step_time_sec'), '.2f')}s  gap {_fmt(gap_ms, '.1f')}ms  "
            f"stale {_fmt(m.get('staleness_mean'), '.2f')}  filtered {m.get('filtered_groups', 0)}  "
            f"eta {eta:.0f}s"
        )
