"""GPU memory in telemetry: the trainer's step metrics carry its peak allocated CUDA memory
(`gpu_mem_peak_gb`, so metrics.jsonl's `train/gpu_mem_peak_gb`), read and reset once per step;
a sampler replica on a GPU of its own reports its peak once per step (`rollout/gpu_mem_peak_gb`,
the largest of their GPUs' peaks); absent on the CPU; and `relayrl report` shows each run's maximum. A
recorder stands in for torch.cuda's memory counters (no GPU here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.analysis.rundata import RunData, key_figures
from relayrl.backends.local import sampler as sampler_module
from relayrl.backends.local import trainer as trainer_module
from relayrl.backends.local.build import owns_gpu
from relayrl.backends.local.gpumem import step_peak_gb
from relayrl.backends.local.sampler import LocalSampler
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.bench.trainer import _steps
from relayrl.config.schema import load_config
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


def test_a_sampler_reports_its_peak_only_on_a_gpu_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.backends.local.generation import SamplingParams
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
    from support.fakecuda import pretend_cuda

    asked: list[torch.device] = []

    def peak(device: torch.device) -> float:
        asked.append(device)
        return 1.25

    monkeypatch.setattr(sampler_module, "step_peak_gb", peak)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    own = LocalSampler(model, tok, SamplingParams(), own_gpu=True)
    shared = LocalSampler(model, tok, SamplingParams(), own_gpu=False)
    try:
        assert own.gpu_mem_peak_gb() == 1.25 and asked == [model.device]
        assert shared.gpu_mem_peak_gb() is None and len(asked) == 1
    finally:
        for s in (own, shared):
            s._host.close()
    pretend_cuda(monkeypatch, count=2, total_gib=80)
    cfg = load_config(None, ["run.backend=local", "train.device=cuda:0", "rollout.device=cuda:1"])
    assert owns_gpu(cfg, torch.device("cuda", 1)) and not owns_gpu(cfg, torch.device("cuda", 0))  # the trainer's GPU: its counter
    assert not owns_gpu(cfg, torch.device("cpu"))
    assert owns_gpu(
        load_config(None, ["run.backend=local", "train.device=cuda:0", "train.world_size=2"]), torch.device("cuda", 0)
    )  # ranks: other processes
    assert not owns_gpu(load_config(None, ["run.backend=local", "train.device=cuda:0", "ray.enabled=true"]), torch.device("cuda", 1))


def test_the_samplers_peak_reaches_the_step_metrics_and_the_report(tmp_path: Path) -> None:
    """A run whose sampler replicas report peaks: each step's row has the largest one as
    rollout/gpu_mem_peak_gb, and the report shows the run's maximum."""
    import asyncio
    import json

    from relayrl.backends.sim.workers import SimSampler
    from support.simutil import make_program, sim_config

    peaks = iter([2.0, 3.5, 1.0, 0.5, 4.0, 1.5] * 10)
    cfg = sim_config("run.steps=3", "rollout.num_samplers=2")
    program = make_program(cfg, tmp_path)
    for sampler in program.backend.samplers:
        assert isinstance(sampler, SimSampler)
        sampler.gpu_mem_peak_gb = lambda: next(peaks)  # type: ignore[method-assign]
    asyncio.run(program.run())
    run_dir = program.run_dir
    assert run_dir is not None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    got = [r["rollout/gpu_mem_peak_gb"] for r in rows]
    assert len(got) == 3 and all(g in (3.5, 1.0, 4.0) for g in got), got  # each step: the larger of its two replicas'
    figures = {f.key: f for f in key_figures(RunData(run_dir, metrics=rows))}
    assert figures["rollout_gpu_mem_peak_gb"].value == max(got)
