"""Chrome trace-event writer (`trace.json`, opens in Perfetto and chrome://tracing).

Invariant: every span is a complete event (`ph: X`, `ts`/`dur` in µs since the run started) on a
named lane (`cat` = lane, one numeric `tid` per lane with `thread_name` metadata). Events are
appended to the file by `flush()` (from a worker thread) as a JSON array whose closing bracket is
written by `close()`; a crashed run leaves a readable prefix (`load_trace` tolerates it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

TraceEvent = dict[str, object]
PID = 1

# Lanes and their fixed thread ids; sampler lanes are added on demand after these.
LANES: dict[str, int] = {
    "trainer": 1,
    "trainer.fetch": 2,  # get_metrics overlaps train_step, so it gets a sub-lane of the trainer
    "orchestrator": 3,
    "bookkeeping": 4,
}


class Tracer:
    def __init__(self, path: Path | None, run_info: dict[str, object]) -> None:
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._lanes = dict(LANES)
        self.events: list[TraceEvent] = []
        self._written = 0
        self._file: IO[str] | None = None
        self._first = True
        self._emit({"ph": "M", "pid": PID, "tid": 0, "name": "process_name", "args": {"name": "relayrl"}})
        self._emit({"ph": "M", "pid": PID, "tid": 0, "name": "relayrl_run", "args": dict(run_info)})
        for lane, tid in LANES.items():
            self._lane_meta(lane, tid)
        if path is not None:
            self._file = open(path, "w", encoding="utf-8")
            self._file.write("[")
            self.flush()

    def now(self) -> float:
        """Seconds since the run started (the trace's time base)."""
        return time.perf_counter() - self._t0

    def _lane_meta(self, lane: str, tid: int) -> None:
        self._emit({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        self._emit({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})

    def _tid(self, lane: str) -> int:
        tid = self._lanes.get(lane)
        if tid is None:
            with self._lock:
                tid = self._lanes.get(lane)
                if tid is None:
                    tid = max(self._lanes.values()) + 1
                    self._lanes[lane] = tid
                    self._lane_meta(lane, tid)
        return tid

    def _emit(self, event: TraceEvent) -> None:
        self.events.append(event)  # list.append is atomic under the GIL

    def complete(self, lane: str, name: str, start: float, end: float, **args: object) -> None:
        """Record a span from `start` to `end` (seconds on the run's clock)."""
        self._emit(
            {
                "ph": "X",
                "pid": PID,
                "tid": self._tid(lane),
                "cat": lane,
                "name": name,
                "ts": round(start * 1e6, 1),
                "dur": round(max(0.0, end - start) * 1e6, 1),
                "args": args,
            }
        )

    @contextmanager
    def span(self, lane: str, name: str, **args: object) -> Iterator[dict[str, object]]:
        """Time the body; the yielded dict lets the body add args (e.g. results)."""
        extra: dict[str, object] = {}
        start = self.now()
        try:
            yield extra
        finally:
            self.complete(lane, name, start, self.now(), **args, **extra)

    def flush(self) -> None:
        """Append the events recorded since the last flush to the file."""
        with self._lock:
            if self._file is None:
                return
            pending = self.events[self._written :]
            self._written += len(pending)
            parts: list[str] = []
            for event in pending:
                parts.append(("\n" if self._first else ",\n") + json.dumps(event, separators=(",", ":")))
                self._first = False
            self._file.write("".join(parts))
            self._file.flush()

    def close(self, status: str) -> None:
        """Mark the run's end (`status`: completed, failed, cancelled) and close the array."""
        self._emit({"ph": "i", "s": "g", "pid": PID, "tid": 0, "name": "run_end", "ts": round(self.now() * 1e6, 1), "args": {"status": status}})
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None


def load_trace(path: Path) -> list[TraceEvent]:
    """Read a trace written by `Tracer`, also one whose run crashed before `close()`."""
    text = path.read_text(encoding="utf-8").rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("traceEvents", [])
    if not isinstance(data, list):
        raise ValueError(f"{path}: not a trace-event array")
    return data
