"""`bench ray-scale`'s bound on trainer busy under the oldest-token staleness rule
(bench/suite.py `oldest_token_bound`): exact on a deterministic workload, and what it says of the
heavy-tailed one."""

from __future__ import annotations

import pytest

from relayrl.bench.suite import RAY_SCALE_TIME_SCALE, oldest_token_bound, ray_scale_config


def test_at_staleness_0_each_step_waits_for_its_whole_generation() -> None:
    # every completion 100 tokens: a call takes 0.01 + 0.001 * 100 = 0.11 s; 16 calls on 8 replicas
    # = 0.22 s per step; 128 trajectories of 112 tokens in rows of 4,096: 4 rows (36 per row), 2
    # micro-batches of 2 rows: 2 * 1.0 + 0.5 = 2.5 s of training
    cfg = ray_scale_config(
        0,
        4,
        8,
        1.0,
        extra=[
            "sim.length_sigma=0",
            "sim.length_median=100",
            "sim.generate_per_token=0.001",
            "sim.generate_per_request=0.01",
            "sim.train_step=1.0",
            "sim.optim_step=0.5",
        ],
    )
    assert oldest_token_bound(cfg, steps=20) == pytest.approx(2.5 / (2.5 + 0.22))


def test_a_window_of_one_step_hides_generation_shorter_than_a_step() -> None:
    cfg = ray_scale_config(1, 4, 8, 1.0, extra=["sim.length_sigma=0", "sim.length_median=100", "sim.generate_per_token=0.001"])
    assert oldest_token_bound(cfg, steps=20) == pytest.approx(1.0)


def test_the_heavy_tailed_workload_is_bounded_below_the_target_at_staleness_1_only() -> None:
    one, two = (oldest_token_bound(ray_scale_config(s, 16, 8, RAY_SCALE_TIME_SCALE), steps=400) for s in (1, 2))
    assert 0.8 < one < 0.95 < two
