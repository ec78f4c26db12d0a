"""A step's end-of-step work: reduce metrics, log them, log trajectories, run `on_step_end`,
release memory. Runs in the bookkeeping thread in overlapped mode, on the event loop inline.

Invariant: steps are booked in step order; the step's result is stored before `on_step_end`
sees it; every part is a span on the bookkeeping lane carrying the OS thread that ran it.

Memory: what the bookkeeper keeps does not grow with the number of steps when the run writes
metrics.jsonl: `results` holds the first and the last result and reads the others back from the
file. An in-memory run (no run directory, so no metrics.jsonl) keeps every result.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import overload

from relayrl.backends.protocols import HostWork
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.memory import freeze_long_lived, release_memory
from relayrl.telemetry.metrics import reduce_step
from relayrl.telemetry.sinks import SinkSet
from relayrl.telemetry.tracer import Tracer
from relayrl.telemetry.trajlog import ParquetTrajectoryLog
from relayrl.types import StepRecord, StepResult


class StepResults(Sequence[StepResult]):
    """The run's step results in step order, as a read-only sequence.

    In memory: the first result (the summary's and the checkpoints' first reward) and the last
    (the step-order check, the summary's last reward) — and every result when there is no
    `metrics_path` (an in-memory run). The others are read back from `metrics_path` (metrics.jsonl,
    which has one row per step, its reduced metrics as they are in `StepResult.metrics`) when
    indexed or iterated: a file read per access, meant for after the run.
    """

    def __init__(self, metrics_path: Path | None) -> None:
        self._path = metrics_path
        self._all: list[StepResult] | None = [] if metrics_path is None else None
        self.first: StepResult | None = None
        self.last: StepResult | None = None
        self._count = 0

    def append(self, result: StepResult) -> None:
        if self.first is None:
            self.first = result
        self.last = result
        self._count += 1
        if self._all is not None:
            self._all.append(result)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> StepResult: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepResult]: ...

    def __getitem__(self, index: int | slice) -> StepResult | list[StepResult]:
        if isinstance(index, slice):
            return self._load()[index]
        if self._all is not None:
            return self._all[index]
        i = index + self._count if index < 0 else index
        if not 0 <= i < self._count:
            raise IndexError("step result index out of range")
        if i == 0 and self.first is not None:
            return self.first
        if i == self._count - 1 and self.last is not None:
            return self.last
        return self._load()[i]

    def __iter__(self) -> Iterator[StepResult]:
        return iter(self._load())

    def __reversed__(self) -> Iterator[StepResult]:
        return reversed(self._load())  # one read, not one per index

    def _load(self) -> list[StepResult]:
        if self._all is not None:
            return list(self._all)
        if self.first is None or self.last is None:
            return []
        first, last = self.first, self.last
        middle: list[StepResult] = []
        if self._count > 2 and self._path is not None:
            with open(self._path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        row = json.loads(line)
                    except ValueError:  # a line being written (a crash): not a booked step
                        continue
                    step = row.get("step") if isinstance(row, dict) else None
                    # rows before `first` belong to the run this one resumed
                    if isinstance(step, int) and first.step < step < last.step:
                        middle.append(StepResult(step=step, policy_version=int(row.get("policy_version", 0)), metrics=row))
        return [first, *middle, last] if last is not first else [first]


class StepBookkeeper:
    def __init__(
        self,
        *,
        tracer: Tracer,
        run_dir: Path | None,
        callbacks: Sequence[Callback],
        host_work: HostWork | None,
        abort: threading.Event,
        log_trajectories: bool,
        release: bool,
        trim: bool = True,
        sinks: SinkSet | None = None,
        checkpoint_after: Callable[[int], bool] | None = None,
    ) -> None:
        self._tracer = tracer
        self._callbacks = list(callbacks)
        self._host_work = host_work
        self._abort = abort
        self._release = release
        self._trim = trim
        self._metrics = sinks
        self._trajs = ParquetTrajectoryLog(run_dir) if run_dir and log_trajectories else None
        # whether a checkpoint follows step N's logs: the trajectory log then closes its open file
        # (trajlog.py), so a checkpoint never claims a step that a kill could still lose
        self._checkpoint_after = checkpoint_after
        self.results = StepResults(sinks.jsonl.path if sinks is not None else None)

    def _part(self, name: str, step: int, fn: Callable[[], None]) -> None:
        with self._tracer.span("bookkeeping", name, step=step, thread=threading.current_thread().name):
            if self._host_work is not None:
                self._host_work.spend(name, self._abort)
            fn()

    def __call__(self, record: StepRecord) -> None:
        step = record.step
        last = self.results.last
        if last is not None and last.step >= step:
            raise RuntimeError(f"bookkeeping for step {step} ran after step {last.step}")
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
                if self._checkpoint_after is not None and self._checkpoint_after(step):
                    self._trajs.roll()

        def on_step_end() -> None:
            for cb in self._callbacks:
                cb.on_step_end(step, result)

        self._part("reduce_metrics", step, reduce)
        self._part("log_metrics", step, log_metrics)
        self._part("log_trajectories", step, log_trajectories)
        self._part("on_step_end", step, on_step_end)
        # the step's trajectories are logged: let them go, or every later collection walks them
        # (the record's only write after the train loop's, which wrote everything else)
        record.groups, record.filtered = [], []
        self._part("release_memory", step, self._release_memory if self._release else lambda: None)
        self._tracer.flush()

    def _release_memory(self) -> None:
        release_memory(self._trim)
        if len(self.results) == 1:
            # modules and caches created lazily by the first step are long-lived too: freeze them,
            # so each later collection walks only what the step itself allocated
            freeze_long_lived()

    def seal_trajectories(self) -> None:
        """Close the trajectory log's open file (bookkeeping thread): every step logged so far is
        then in a complete file. For a checkpoint decided after its step's logs were written (a
        stop: orchestrator/checkpointing.py)."""
        if self._trajs is not None:
            self._trajs.roll()

    def close(self) -> None:
        for writer in (self._metrics, self._trajs):
            if writer is not None:
                writer.close()
