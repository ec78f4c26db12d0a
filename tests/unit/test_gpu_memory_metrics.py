"""GPU memory in telemetry: the trainer's step metrics carry its peak allocated CUDA memory
(`gpu_mem_peak_gb`, so metrics.jsonl's `train/gpu_mem_peak_gb`), read and reset once per step;
absent on the CPU; and `relayrl report` shows the run's maximum. A recorder stands in for
torch.cuda's memory counters (no GPU here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.analysis.rundata import RunData, key_figures
from relayrl.backends.local import trainer as trainer_module
from relayrl.backends.local.gpumem import step_peak_gb
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.bench.trainer import _steps
from relayrl.telemetry.metrics import reduce_step
from support.modelutil import random_qwen2

pytestmark = pytest.mark.torch


@pytest.fixture
def counters(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    peaks = iter([3 * 2**30, 5 * 2**29])

    def max_allocated(device: Any = None) -> int:
        calls.append(("max", device))
        return next(peaks)

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    return calls


def test_the_peak_is_read_and_reset_per_call_on_cuda_only(counters: list[tuple[str, Any]]) -> None:
    cuda = torch.device("cuda", 3)
    assert step_peak_gb(torch.device("cpu")) is None and not counters
    assert step_peak_gb(cuda) == 3.0
    assert step_peak_gb(cuda) == 2.5
    assert counters == [("max", cuda), ("reset", cuda)] * 2


def test_the_trainers_step_metrics_carry_the_peak_on_cuda_and_not_on_the_cpu(
    counters: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    settings = TrainerSettings(learning_rate=1e-4, total_steps=4, loss=LossConfig(), torch_threads=1)
    compute = TrainerCompute(random_qwen2(128), settings)
    steps = _steps(128, 2, 1, 64)
    compute.train_step(steps[0][0])
    compute.optim_step()
    assert "gpu_mem_peak_gb" not in compute.metrics() and not counters  # the CPU: absent, torch.cuda untouched
    compute.train_step(steps[1][0])
    compute.device = torch.device("cuda", 0)  # (as a trainer on cuda:0 is, from here on: only the counters are asked)
    monkeypatch.setattr(trainer_module, "handoff", lambda device: None)  # (the export's CUDA event: none on a CPU build)
    compute.optim_step()
    slot = compute.metrics()
    assert slot["gpu_mem_peak_gb"] == 3.0
    assert counters == [("max", torch.device("cuda", 0)), ("reset", torch.device("cuda", 0))]
    assert reduce_step_train_key(slot) == 3.0


def reduce_step_train_key(slot: dict[str, float]) -> Any:
    """metrics.jsonl's name for it: the trainer's slot is written under train/."""
    from relayrl.types import StepRecord

    record = StepRecord(step=1, groups=[], policy_version=1, trainer_metrics=slot)
    return reduce_step(record)["train/gpu_mem_peak_gb"]


def test_the_report_shows_the_runs_peak_only_where_it_was_measured(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [{"step": i, "train/gpu_mem_peak_gb": p} for i, p in enumerate([1.5, 7.25, 3.0])]
    figures = {f.key: f for f in key_figures(RunData(tmp_path, metrics=rows))}
    assert figures["train_gpu_mem_peak_gb"].value == 7.25
    assert figures["train_gpu_mem_peak_gb"].text == "7.25 GiB"
    cpu = {f.key for f in key_figures(RunData(tmp_path, metrics=[{"step": 0}]))}
    assert "train_gpu_mem_peak_gb" not in cpu
