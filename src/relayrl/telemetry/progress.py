"""Terminal progress: a live bar in a terminal, one plain line per step otherwise.

Shows step, reward, held-out accuracy, step time, trainer busy %, boundary gap and ETA.

Invariant: callbacks only format figures already reduced; they run in the bookkeeping thread
(`on_step_end`) or on the loop after an evaluation (`on_eval`) and never block the trainer.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from relayrl.telemetry.callbacks import Callback
from relayrl.types import EvalResult, StepResult


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


class ProgressPrinter(Callback):
    def __init__(self, total_steps: int, console: Console | None = None, live: bool | None = None) -> None:
        self._total = total_steps
        self._first: int | None = None  # the first step this process runs (numbered from 1; > 1 when resumed)
        self._console = console or Console(highlight=False, soft_wrap=True)
        self._start = time.perf_counter()
        self._accuracy: float | None = None
        self._live = self._console.is_terminal if live is None else live
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def _bar(self) -> Progress:
        if self._progress is None:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                console=self._console,
                transient=False,
            )
            self._task = self._progress.add_task("", total=self._total, completed=(self._first or 1) - 1)
            self._progress.start()
        return self._progress

    def _line(self, done: int, m: dict[str, float | int | None]) -> str:
        elapsed = time.perf_counter() - self._start
        eta = elapsed / max(1, done - (self._first or 1) + 1) * (self._total - done)
        step_time = m.get("step_time_sec")
        train_time = m.get("train_time")
        optim_time = m.get("optim_time", 0.0)  # several updates per step run inside optim_step
        busy = (
            (train_time + optim_time) / step_time
            if isinstance(step_time, float) and isinstance(train_time, float) and isinstance(optim_time, float) and step_time > 0
            else None
        )
        gap = m.get("boundary_gap_sec")
        gap_ms = gap * 1e3 if isinstance(gap, float) else None
        failed = m.get("failed_trajectories")  # a reward (or environment, agent) failed on them
        return (
            f"reward {_fmt(m.get('reward_mean'), '.3f')}  acc {_fmt(self._accuracy, '.3f')}  "
            f"step {_fmt(step_time, '.2f')}s  busy {_fmt(busy, '.0%')}  gap {_fmt(gap_ms, '.1f')}ms  "
            f"stale {_fmt(m.get('staleness_mean'), '.2f')}  " + (f"failed {failed}  " if failed else "") + f"eta {eta:.0f}s"
        )

    def on_step_begin(self, step: int) -> None:
        if self._first is None:
            self._first = step
            self._start = time.perf_counter()

    def on_step_end(self, step: int, result: StepResult) -> None:
        done = step  # steps are numbered from 1: step N's end means N done
        line = self._line(done, result.metrics)
        if self._live:
            bar = self._bar()
            assert self._task is not None
            bar.update(self._task, completed=done, description=line)
            if done >= self._total:
                bar.stop()
        else:
            self._console.print(f"step {done}/{self._total}  {line}")

    def on_eval(self, result: EvalResult) -> None:
        self._accuracy = result.accuracy
        reward = "" if result.reward_mean is None else f", mean reward {result.reward_mean:.3f}"
        message = f"held-out accuracy {result.accuracy:.3f}{reward} (policy version {result.version}, {result.num_prompts} prompts)"
        if self._progress is not None:
            self._progress.console.print(message)
        else:
            self._console.print(message)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
