"""Figures read off a trace: boundary gaps, trainer busy fraction, spans by step.

Invariant: computed from trace events alone, so a live run, a finished run and a crashed run's
trace are analysed the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from relayrl.telemetry.tracer import TraceEvent


@dataclass(slots=True, frozen=True)
class Span:
    lane: str
    name: str
    start: float  # seconds
    end: float
    args: dict[str, object]

    @property
    def step(self) -> int:
        return int(self.args.get("step", -1))  # type: ignore[call-overload]

    @property
    def dur(self) -> float:
        return self.end - self.start


def spans(events: Iterable[TraceEvent]) -> list[Span]:
    out: list[Span] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        ts = float(e["ts"]) / 1e6  # type: ignore[arg-type]
        dur = float(e.get("dur", 0.0)) / 1e6  # type: ignore[arg-type]
        args = e.get("args") or {}
        out.append(Span(str(e.get("cat", "")), str(e["name"]), ts, ts + dur, dict(args)))  # type: ignore[call-overload]
    out.sort(key=lambda s: s.start)
    return out


def run_info(events: Iterable[TraceEvent]) -> dict[str, object]:
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "relayrl_run":
            return dict(e.get("args") or {})  # type: ignore[call-overload]
    return {}


def boundary_gaps(all_spans: list[Span]) -> list[float]:
    """End of optim_step(N) to the start of train_step(N+1, mb 0), for every N that has both."""
    optim_end = {s.step: s.end for s in all_spans if s.lane == "trainer" and s.name == "optim_step"}
    first = {s.step: s.start for s in all_spans if s.lane == "trainer" and s.name == "train_step" and s.args.get("microbatch") == 0}
    return [first[n + 1] - optim_end[n] for n in sorted(optim_end) if n + 1 in first]


def trainer_busy_fraction(all_spans: list[Span]) -> float:
    """Share of the trainer's active window (first train_step start → last optim_step end) spent
    inside train_step or optim_step."""
    busy = [s for s in all_spans if s.lane == "trainer" and s.name in ("train_step", "optim_step")]
    if not busy:
        return 0.0
    window = max(s.end for s in busy) - min(s.start for s in busy)
    return sum(s.dur for s in busy) / window if window > 0 else 1.0


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
