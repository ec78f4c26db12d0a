"""A short local multi-turn run with every objective option of issue 23 (this part) on: GSPO's
sequence ratio, the entropy bonus and entropy-quantile masking, the k2 KL as a per-token reward
penalty, DAPO's overlong penalty, mask_truncated and per-turn discounted credit. It trains,
passes check-trace, and its metrics say what each option did."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.telemetry.trajlog import read_trajectories
from support.simutil import run_checked


@pytest.mark.slow  # ~15 s on 2 cores
def test_local_run_with_every_objective_option_passes_check_trace(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "run.backend=local",
            "task.kind=arithmetic",
            "task.environment=arithmetic_feedback",
            "task.heldout_size=8",
            "run.steps=3",
            "rollout.num_generations=4",
            "rollout.groups_per_step=4",
            "rollout.max_new_tokens=4",
            "rollout.max_turns=3",
            "train.row_tokens=48",
            "orchestrator.release_memory=false",
            "algorithm.ratio_level=sequence",
            "algorithm.clip_eps_low=0.0003",
            "algorithm.clip_eps_high=0.0004",
            "algorithm.entropy_coef=0.01",
            "algorithm.top_entropy_quantile=0.5",
            "algorithm.kl_beta=0.05",
            "algorithm.kl_estimator=k2",
            "algorithm.kl_in_reward=true",
            "algorithm.overlong_buffer=8",
            "algorithm.overlong_penalty=0.5",
            "algorithm.mask_truncated=true",
            "algorithm.turn_discount=0.9",
        ],
    )
    assert cfg.algorithm.loss_aggregation == "seq_mean_token_mean"  # GSPO's
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=240)
    rows = [r.metrics for r in result.results]
    assert len(rows) == 3
    for m in rows:
        for key in (
            "train/seq_ratio_min",
            "train/seq_ratio_max",
            "train/entropy_masked_frac",
            "train/kl_mean",
            "train/kl_reward_penalty_mean",
            "train/entropy_mean",
            "truncated_masked",
        ):
            value = m[key]
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
        assert 0.0 < float(m["train/entropy_masked_frac"]) < 1.0  # type: ignore[arg-type]
        assert m["train/skipped_nonfinite"] == 0.0
    log = read_trajectories(tmp_path / "run").to_pylist()
    trained = [row for row in log if row["status"] == "ok"]
    # the actions of an episode no longer share one advantage: each turn has its own (the log shows them)
    assert all(len(row["turn_advantages"]) == row["turns"] for row in trained)
    assert any(len(set(row["turn_advantages"])) > 1 for row in trained)
    assert all(row["advantage"] == row["turn_advantages"][0] for row in trained)
    # the overlong penalty is in the reward and logged with it (policy tokens beyond 12 − 8 = 4)
    assert any(row["overlong_penalty"] < 0 for row in trained)
