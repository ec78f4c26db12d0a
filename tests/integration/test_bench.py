"""Benchmarks run end to end at a reduced scale (figures are printed by the CLI, not asserted as
timings; only relations that follow from the simulated costs are checked)."""

from __future__ import annotations

import json
from typing import cast

import pytest

from relayrl.bench.suite import BOUNDARY_PROFILE, run_boundary, run_control_plane, run_e2e, run_ray_scale, run_weight_sync
from support.cli import relayrl


def test_boundary_bench_reports_both_modes_and_the_inline_gap_holds_the_bookkeeping() -> None:
    scale = 0.05
    figures = run_boundary(steps=3, time_scale=scale)
    inline, over = figures["inline"], figures["overlapped"]
    assert isinstance(inline, dict) and isinstance(over, dict)
    # inline pays fetch + reduction + logging + callbacks + release + packing at every boundary
    inline_floor = scale * sum(
        BOUNDARY_PROFILE[f"sim.{k}"]
        for k in (
            "get_metrics",
            "reduce_metrics",
            "log_metrics",
            "log_trajectories",
            "on_step_end",
            "release_memory",
            "pack_per_microbatch",
        )
    )
    assert inline["gap_median_s"] >= inline_floor
    assert over["gap_median_s"] < inline["gap_median_s"]
    assert 0 < over["busy_fraction"] <= 1 and over["busy_fraction"] > inline["busy_fraction"]
    assert figures["ratio"] == over["gap_median_s"] / inline["gap_median_s"]


def test_boundary_bench_json_output() -> None:
    res = relayrl("bench", "boundary", "--json", "--steps", "2", "--time-scale", "0.02", timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert {"inline", "overlapped", "ratio"} <= data.keys()
    assert {"gap_median_s", "busy_fraction", "loop_lag_max_ms"} <= data["inline"].keys()


def test_control_plane_bench_pushes_every_trajectory_through() -> None:
    figures = run_control_plane(steps=2, one_core=False)
    assert figures["trajectories"] == 2 * 64 * 16
    assert cast(float, figures["trajectories_per_s"]) > 0


E2E_KEYS = {"samples_per_s", "trainer_busy", "sampler_busy", "gap_median_s", "exposed_bookkeeping_s", "wall_s"}
TINY_E2E = ["rollout.groups_per_step=2", "rollout.num_generations=2", "rollout.prompts_per_request=2", "orchestrator.checkpoint_every=0"]


def test_e2e_bench_with_ray_adds_configuration_d_with_the_same_keys() -> None:
    pytest.importorskip("ray")
    figures = run_e2e(steps=2, extra=TINY_E2E, ray=True)
    assert set(figures) == {"A", "B", "C", "D"}
    for label in "ABCD":
        assert set(figures[label]) == E2E_KEYS
    assert figures["D"]["samples_per_s"] > 0
    import ray

    assert not ray.is_initialized()  # the cluster started for D is shut down


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
    import ray

    assert not ray.is_initialized()  # the cluster the bench started is shut down
