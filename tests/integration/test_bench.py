"""Benchmarks without Ray run end to end at a reduced scale (figures are printed by the CLI, not
asserted as timings; only relations that follow from the simulated costs are checked). The Ray
ones are in tests/ray/test_bench_ray.py."""

from __future__ import annotations

import json
from typing import cast

from relayrl.bench.suite import BOUNDARY_PROFILE, run_boundary, run_control_plane
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


def test_collate_bench_json_output() -> None:
    """`bench collate --json` (a quick run): one object, every case with the new and the old
    path's tokens, collate_ms and batch_bytes; prompt sharing saves the same tokens on both, and
    the new batch is smaller than the old (which carries the L x L mask)."""
    res = relayrl("bench", "collate", "--json", "--repeats", "1", "--scale", "0.05", timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [c["name"] for c in data["cases"]] == ["3k", "6k", "11k"]
    for case in data["cases"]:
        for path in ("new", "old"):
            assert {"tokens", "collate_ms", "batch_bytes"} <= case[path].keys()
        assert case["new"]["tokens"] == case["old"]["tokens"] == case["tokens"] < case["tokens_unshared"]
        assert case["new"]["batch_bytes"] < case["old"]["batch_bytes"]
        assert case["new"]["mask_ms"] >= 0  # the trainer's own build of the mask
    assert data["device"] == "cpu"
    res = relayrl("bench", "collate", "--scale", "2", timeout=60)
    assert res.returncode == 2 and "--scale" in res.stderr


def test_agent_bench_runs_the_agent_and_the_environment_path_on_the_same_task() -> None:
    from relayrl.bench.agents import AGENT_TARGET, run_agent

    figures = run_agent(steps=3)  # the CPU a step is read from the second step's end to the last's
    agent, loop, env = figures["agent"], figures["loop"], figures["env"]
    assert isinstance(agent, dict) and isinstance(loop, dict) and isinstance(env, dict)
    assert agent["samples_per_s"] > 0 and loop["samples_per_s"] > 0 and env["samples_per_s"] > 0
    assert agent["sampling_calls_per_step"] >= 1 and loop["sampling_calls_per_step"] >= 1 and env["sampling_calls_per_step"] >= 1
    assert figures["ratio"] == agent["samples_per_s"] / env["samples_per_s"]
    assert figures["loop_ratio"] == loop["samples_per_s"] / env["samples_per_s"]
    ratio = figures["ratio"]
    assert isinstance(ratio, float) and figures["met"] == (ratio >= AGENT_TARGET)
    # the agent processes' CPU is counted apart, and only where they run
    assert agent["cpu_agents_s_per_step"] > 0 and loop["cpu_agents_s_per_step"] == env["cpu_agents_s_per_step"] == 0
    assert all(f["cpu_run_s_per_step"] > 0 for f in (agent, loop, env))
    assert agent["cpu_s_per_step"] == agent["cpu_run_s_per_step"] + agent["cpu_agents_s_per_step"]
    assert figures["cpu_bound_ratio"] == env["cpu_s_per_step"] / agent["cpu_s_per_step"]
    # the share of the cores busy: the CPU a step over the steps' wall times the cores (a run's
    # threads cannot keep more than every core busy; /proc's ticks are read every 50 ms, hence the slack)
    assert isinstance(figures["cores"], int) and figures["cores"] >= 1 and figures["model"] == "tiny"
    assert all(0 < f["cpu_busy"] <= 1.1 for f in (agent, loop, env))
    for key in ("endpoint", "endpoint_processes"):
        endpoint = figures[key]
        assert isinstance(endpoint, dict)
        assert endpoint["cpu_ms_per_call"] > 0 and endpoint["wall_ms_per_call"] > 0 and endpoint["sampling_calls_per_round"] >= 2


def test_agent_bench_runs_every_configuration_on_the_model_asked() -> None:
    """`bench agent --model smollm2`: the three configurations run the smollm2 recipe's model file
    (plain completions: no chat template) with dynamic sampling off, and differ from each other
    only in how they roll out; the default keeps the agent recipe's tiny model; an unknown model is
    refused in one line."""
    from relayrl.bench.agents import AGENT_CONFIGS, _config
    from relayrl.config.schema import load_config
    from relayrl.recipes import shipped_recipe

    smollm2 = load_config(shipped_recipe("smollm2")).model
    for label in AGENT_CONFIGS:
        cfg = _config(label, 3, [], "smollm2")
        assert (cfg.model.package, cfg.model.gguf_file) == (smollm2.package, smollm2.gguf_file)
        assert cfg.model.chat_template is False and cfg.algorithm.dynamic_sampling is False
        tiny = _config(label, 3, [])
        assert tiny.model.package is None and tiny.model.gguf_file is None and tiny.algorithm.dynamic_sampling is True
        assert cfg.rollout.groups_per_step == tiny.rollout.groups_per_step and cfg.run.steps == tiny.run.steps == 3
    assert (_config("agent", 3, [], "smollm2").task.agent is not None) and _config("env", 3, [], "smollm2").task.agent is None
    res = relayrl("bench", "agent", "--model", "qwen", timeout=60)
    assert res.returncode == 2 and "--model 'qwen': one of tiny, smollm2" in res.stderr
