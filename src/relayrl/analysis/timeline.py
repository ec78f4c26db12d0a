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


ACTOR_TRAINER = "actor:trainer"  # spans timed inside a Ray trainer actor (backends.ray.spans)


def trainer_lane(all_spans: list[Span]) -> str:
    """Where the trainer's own work is timed: inside the trainer actor when it ran on Ray (the
    orchestrator's "trainer" lane then also counts the calls' round trips), else "trainer"."""
    return ACTOR_TRAINER if any(s.lane == ACTOR_TRAINER for s in all_spans) else "trainer"


def boundary_gaps(all_spans: list[Span]) -> list[float]:
    """End of optim_step(N) to the start of train_step(N+1, mb 0), for every N that has both, as
    the trainer saw them (`trainer_lane`)."""
    lane = trainer_lane(all_spans)
    optim_end = {s.step: s.end for s in all_spans if s.lane == lane and s.name == "optim_step"}
    first = {s.step: s.start for s in all_spans if s.lane == lane and s.name == "train_step" and s.args.get("microbatch") == 0}
    return [first[n + 1] - optim_end[n] for n in sorted(optim_end) if n + 1 in first]


def _trainer_work(all_spans: list[Span]) -> list[Span]:
    lane = trainer_lane(all_spans)
    return [s for s in all_spans if s.lane == lane and s.name in ("train_step", "optim_step")]


def trainer_busy_fraction(all_spans: list[Span]) -> float:
    """Share of the trainer's active window (first train_step start → last optim_step end) spent
    inside train_step or optim_step."""
    busy = _trainer_work(all_spans)
    if not busy:
        return 0.0
    window = max(s.end for s in busy) - min(s.start for s in busy)
    return sum(s.dur for s in busy) / window if window > 0 else 1.0


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total = 0.0
    for a, b in xs:
        for c, d in ys:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


def lane_busy_fraction(all_spans: list[Span], lane_prefix: str, name: str) -> float:
    """Share of the trainer's active window in which some `name` span of these lanes ran."""
    busy = _trainer_work(all_spans)
    if not busy:
        return 0.0
    lo, hi = min(s.start for s in busy), max(s.end for s in busy)
    spans_ = _union(
        [
            (max(lo, s.start), min(hi, s.end))
            for s in all_spans
            if s.lane.startswith(lane_prefix) and s.name == name and s.end > lo and s.start < hi
        ]
    )
    return _length(spans_) / (hi - lo) if hi > lo else 0.0


def exposed_bookkeeping_time(all_spans: list[Span]) -> float:
    """Trainer idle time inside its active window that is neither waiting for data nor waiting for
    a weight sync: time the trainer lost to orchestrator work that could have overlapped."""
    busy = _union([(s.start, s.end) for s in _trainer_work(all_spans)])
    if not busy:
        return 0.0
    idle = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] > a[1]]
    explained = _union([(s.start, s.end) for s in all_spans if s.name in ("wait_data", "weight_sync")])
    return _length(idle) - _intersection(idle, explained)
