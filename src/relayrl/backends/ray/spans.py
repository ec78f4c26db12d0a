"""Spans timed inside Ray actors, put onto the driver's trace on the driver's clock.

An actor method returns `Timed`: its value and when it ran, on the actor's wall clock. The
driver-side adapter (`actors.RaySampler` / `RayTrainer`) hands that to its `ActorSpans`, which
records a span in the actor's lane (`actor:trainer`, `actor:sampler/<i>`) with the driver-side
call window (`call_start`, `call_end`, run clock) in its args.

Clock merging: before its first span (and again after the actor's process was restarted, possibly
on another node) `ActorSpans` asks the actor for its wall clock five times and keeps the exchange
with the shortest round trip: offset = actor clock − the driver clock at the midpoint, error =
half that round trip (NTP's estimate). Each estimate is traced as a `relayrl_clock` metadata event
of the lane; `check-trace` verifies that every actor span lies inside its call window, give or take
that error.

Invariant: recording never fails a call: with no tracer attached, nothing is recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from relayrl.telemetry.tracer import Tracer

CLOCK_SAMPLES = 5


@dataclass(slots=True, frozen=True)
class Timed:
    """What an actor method returns: its value, and its start and end on the actor's wall clock."""

    value: Any
    start: float
    end: float


class ActorSpans:
    def __init__(self, lane: str) -> None:
        self.lane = lane
        self.tracer: Tracer | None = None
        self.offset = 0.0  # actor wall clock − driver wall clock (s)
        self.error = 0.0  # how far off `offset` may be (s)
        self._synced = False

    def attach(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def unsync(self) -> None:
        """The actor's process was replaced: estimate its clock again before the next span."""
        self._synced = False

    async def sync(self, actor: Any) -> None:
        """Estimate the actor's clock offset (no-op once done, or with no tracer)."""
        if self._synced or self.tracer is None:
            return
        best: tuple[float, float] | None = None
        for _ in range(CLOCK_SAMPLES):
            sent = time.time()
            remote = float(await actor.clock.remote())
            back = time.time()
            if best is None or back - sent < best[0]:
                best = (back - sent, remote - (sent + back) / 2)
        assert best is not None
        self.error, self.offset = best[0] / 2, best[1]
        self._synced = True
        self.tracer.clock(self.lane, offset_s=round(self.offset, 7), error_s=round(self.error, 7))

    def now(self) -> float:
        """The run clock (0.0 with no tracer): a call's start, for `record`."""
        return self.tracer.now() if self.tracer is not None else 0.0

    def record(self, name: str, call_start: float, timed: Timed, **args: object) -> None:
        """Record `timed` (an actor's span for the call issued at `call_start`, just returned)."""
        tracer = self.tracer
        if tracer is None:
            return
        call_end = tracer.now()
        wall_to_run = call_end - time.time() - self.offset  # actor wall clock + this = run clock
        tracer.complete(
            self.lane,
            name,
            timed.start + wall_to_run,
            timed.end + wall_to_run,
            call_start=round(call_start, 7),
            call_end=round(call_end, 7),
            **args,
        )
