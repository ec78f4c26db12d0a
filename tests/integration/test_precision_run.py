"""Precision and reproducibility end to end on the local backend: a short default-recipe run in
model.dtype "bfloat16" (bfloat16 autocast-free compute on the CPU) reports its trainer/sampler
log-prob agreement within the bfloat16 bound and has the truncated-IS correction on by default;
two identical LoRA runs are bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relayrl.backends.local.precision import AUTO_TIS_CAP, LOGPROB_DIFF_MEAN_BOUND
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.recipes import default_recipe
from support.simutil import run_checked


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_bf16_logprob_threshold(tmp_path: Path) -> None:
    """T14: 6 steps of the default recipe in bfloat16 on the CPU, on-policy (staleness 0): the
    mean |trainer − sampler| log-prob is reported and within the bfloat16 bound (float32's would
    fail: bfloat16 differs ~3e-3 per token), and the truncated-IS weight is on by default
    (decoupled PPO: no clip fractions, an IS weight near 1 per step)."""
    cfg = load_config(
        default_recipe(),
        ["run.steps=6", "rollout.max_staleness=0", "eval.enabled=false", "model.dtype=bfloat16", "orchestrator.release_memory=false"],
    )
    assert cfg.algorithm.tis_cap is None  # unset: auto
    run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=240)
    rows = [r for r in _rows(tmp_path / "run") if r["train/completion_tokens"] > 0]
    assert len(rows) == 6
    means = [r["train/logprob_diff_mean"] for r in rows]
    assert max(means) < LOGPROB_DIFF_MEAN_BOUND[torch.bfloat16], means
    assert max(means) > 0  # bfloat16 really computed (float32 agrees to ~1e-6)
    for r in rows:
        assert 0 < r["train/tis_weight_mean"] <= AUTO_TIS_CAP and "train/tis_capped_frac" in r
        assert abs(r["train/tis_weight_mean"] - 1.0) < 0.05
        assert "train/clip_frac_high" not in r


LORA_RUN = [
    "run.backend=local",
    "task.kind=arithmetic",
    "run.steps=3",
    "rollout.num_generations=4",
    "rollout.groups_per_step=4",
    "rollout.max_staleness=0",
    "eval.enabled=false",
    "orchestrator.release_memory=false",
    "train.lora.r=4",
    "train.learning_rate=1e-2",
]


def test_two_identical_lora_runs_are_bit_identical(tmp_path: Path) -> None:
    """Two LoRA runs of one config in one process (torch's global RNG in another state at the
    second): the adapters start from run.seed, so every step's figures are equal."""
    runs = []
    for name in ("a", "b"):
        torch.rand(7)  # whatever drew from the global RNG before
        run_checked(build_program(load_config(None, LORA_RUN), run_dir=tmp_path / name), timeout=120)
        runs.append(_rows(tmp_path / name))
    a, b = runs
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        for key in ("train/grad_norm", "train/loss", "reward_mean"):
            assert ra[key] == rb[key], (key, ra["step"], ra[key], rb[key])
    assert any(r["train/grad_norm"] > 0 for r in a)
