"""The progress line's per-step trainer busy counts the optimizer call, as the summary's does."""

from __future__ import annotations

import io

from rich.console import Console

from relayrl.telemetry.progress import ProgressPrinter
from relayrl.types import StepResult


def _printed(metrics: dict[str, float | int | None]) -> str:
    out = io.StringIO()
    printer = ProgressPrinter(3, console=Console(file=out, highlight=False, width=200), live=False)
    printer.on_step_begin(1)
    printer.on_step_end(1, StepResult(step=1, policy_version=1, metrics=metrics))
    return out.getvalue()


def test_busy_counts_the_optim_step_call() -> None:
    # several updates per step (train.ppo_epochs) run inside optim_step: 0.4 s of 1 s is training
    assert "busy 90%" in _printed({"step_time_sec": 1.0, "train_time": 0.4, "optim_time": 0.5})


def test_busy_of_metrics_without_optim_time_is_the_training_share() -> None:
    assert "busy 40%" in _printed({"step_time_sec": 1.0, "train_time": 0.4})


def test_the_line_counts_the_steps_failed_trajectories_when_there_are_any() -> None:
    assert "failed 3 " in _printed({"step_time_sec": 1.0, "train_time": 0.4, "failed_trajectories": 3})
    assert "failed" not in _printed({"step_time_sec": 1.0, "train_time": 0.4, "failed_trajectories": 0})
