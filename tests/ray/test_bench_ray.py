"""The Ray benchmarks (configuration D of e2e, weight sync, ray-scale) run end to end at a reduced
scale; each starts its own local Ray cluster and shuts it down (figures are printed by the CLI, not
asserted as timings). The benchmarks without Ray are in tests/integration/test_bench.py."""

from __future__ import annotations

import pytest

from relayrl.bench.suite import run_e2e, run_ray_scale, run_weight_sync

E2E_KEYS = {"samples_per_s", "trainer_busy", "sampler_busy", "gap_median_s", "exposed_bookkeeping_s", "wall_s"}
TINY_E2E = ["rollout.groups_per_step=2", "rollout.num_generations=2", "rollout.prompts_per_request=2", "orchestrator.checkpoint_every=0"]


@pytest.mark.slow
def test_e2e_bench_with_ray_adds_configuration_d_with_the_same_keys() -> None:
    pytest.importorskip("ray")
    figures = run_e2e(steps=2, extra=TINY_E2E, ray=True)
    assert set(figures) == {"A", "B", "C", "D"}
    for label in "ABCD":
        assert set(figures[label]) == E2E_KEYS
    assert figures["D"]["samples_per_s"] > 0
    import ray

    assert not ray.is_initialized()  # the cluster started for D is shut down


@pytest.mark.slow
def test_weight_sync_bench_reports_bytes_times_and_bandwidth() -> None:
    pytest.importorskip("ray")
    figures = run_weight_sync(replicas=1, models=("tiny",), versions=1)
    tiny = figures["tiny"]
    assert isinstance(tiny, dict)
    assert tiny["bytes"] > 0 and tiny["params"] > 0
    for mode in ("numpy", "tensors"):
        assert {"s_per_version", "gb_per_s", "export_s", "first_s_per_version", "warmup_versions"} <= tiny[mode].keys()
        assert tiny[mode]["gb_per_s"] > 0
        assert tiny[mode]["export_s"] < tiny[mode]["s_per_version"]  # the replicas' load is part of a version's time
    assert tiny["numpy"]["warmup_versions"] > tiny["tensors"]["warmup_versions"] == 1  # numpy goes round the store first
    assert tiny["ratio_numpy_over_tensors"] > 0
    assert figures["replicas"] == 1


RAY_SCALE_KEYS = {
    "trainer_busy",
    "exposed_generation_mean_s",
    "exposed_generation_max_s",
    "exposed_generation_first_s",
    "staleness_mean",
    "staleness_max",
    "step_time_median_s",
    "sync_round_mean_s",
    "sync_round_max_s",
    "completions_per_s",
    "wall_s",
}


@pytest.mark.slow
def test_ray_scale_bench_reports_each_staleness_and_the_control_plane() -> None:
    pytest.importorskip("ray")
    figures = run_ray_scale(steps=3, replicas=2, time_scale=0.02)
    for s in (1, 2):
        f = figures[f"max_staleness_{s}"]
        assert isinstance(f, dict) and set(f) == RAY_SCALE_KEYS
        assert 0 < f["trainer_busy"] <= 1
        assert 0 <= f["staleness_mean"] <= f["staleness_max"] <= s
        assert 0 <= f["exposed_generation_mean_s"] <= f["exposed_generation_max_s"]
        assert f["exposed_generation_first_s"] > 0  # the first step always waits for its groups
        assert f["completions_per_s"] > 0
    cp = figures["control_plane"]
    assert isinstance(cp, dict)
    assert cp["trajectories"] == 4 * 3 * 16 * 8  # 4x the steps, 16 groups of 8 per step
    assert cp["trajectories_per_s"] > 0
    assert figures["replicas"] == 2 and figures["target_trainer_busy"] == 0.95
    bounds = figures["oldest_token_bound"]
    assert isinstance(bounds, dict) and set(bounds) == {"1", "2"} and 0 < bounds["1"] <= bounds["2"] <= 1
    import ray

    assert not ray.is_initialized()  # the cluster the bench started is shut down
