"""A step's end-of-step work: reduce metrics, log them, log trajectories, run `on_step_end`,
release memory. Runs in the bookkeeping thread in overlapped mode, on the event loop inline.

Invariant: steps are booked in step order; the step's result is stored before `on_step_end`
sees it; every part is a span on the bookkeeping lane carrying the OS thread that ran it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from relayrl.callbacks import Callback
from relayrl.telemetry.sinks import SinkSet
from relayrl.telemetry.trajlog import ParquetTrajectoryLog
from relayrl.telemetry.memory import freeze_long_lived, release_memory
from relayrl.telemetry.metrics import reduce_step
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import burn_cpu
from relayrl.types import StepRecord, StepResult


class StepBookkeeper:
    def __init__(
        self,
        *,
        tracer: Tracer,
        run_dir: Path | None,
        callbacks: Sequence[Callback],
        host_costs: dict[str, float],
        abort: threading.Event,
        log_trajectories: bool,
        release: bool,
        trim: bool = True,
        sinks: SinkSet | None = None,
    ) -> None:
        self._tracer = tracer
        self._callbacks = list(callbacks)
        self._costs = host_costs
        self._abort = abort
        self._release = release
        self._trim = trim
        self._metrics = sinks
        self._trajs = ParquetTrajectoryLog(run_dir) if run_dir and log_trajectories else None
        self.results: list[StepResult] = []

    def _part(self, name: str, step: int, fn: Callable[[], None]) -> None:
        with self._tracer.span("bookkeeping", name, step=step, thread=threading.current_thread().name):
            burn_cpu(self._costs.get(name, 0.0), self._abort)
            fn()

    def __call__(self, record: StepRecord) -> None:
        step = record.step
        if self.results and self.results[-1].step >= step:
            raise RuntimeError(f"bookkeeping for step {step} ran after step {self.results[-1].step}")
        result = StepResult(step=step, policy_version=record.policy_version)

        def reduce() -> None:
            result.metrics = reduce_step(record)
            self.results.append(result)  # rule 6: the result exists before on_step_end sees it

        def log_metrics() -> None:
            if self._metrics is not None:
                self._metrics.log(step, result.metrics)

        def log_trajectories() -> None:
            if self._trajs is not None:
                self._trajs.write(step, record.policy_version - 1, record.trajectories, record.filtered)

        def on_step_end() -> None:
            for cb in self._callbacks:
                cb.on_step_end(step, result)

        self._part("reduce_metrics", step, reduce)
        self._part("log_metrics", step, log_metrics)
        self._part("log_trajectories", step, log_trajectories)
        self._part("on_step_end", step, on_step_end)
        # the step's trajectories are logged: let them go, or every later collection walks them
        record.groups, record.filtered = [], []
        self._part("release_memory", step, self._release_memory if self._release else lambda: None)
        self._tracer.flush()

    def _release_memory(self) -> None:
        release_memory(self._trim)
        if len(self.results) == 1:
            # modules and caches created lazily by the first step are long-lived too: freeze them,
            # so each later collection walks only what the step itself allocated
            freeze_long_lived()

    def close(self) -> None:
        for writer in (self._metrics, self._trajs):
            if writer is not None:
                writer.close()
