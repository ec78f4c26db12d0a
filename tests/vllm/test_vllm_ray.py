"""A vLLM sampler replica hosted in a Ray actor (`--ray` with `rollout.engine = "vllm"`): the
actor builds the engine with its factory, the weights reach it through the object store, and at
staleness 0 its log-probs are the trainer's (so every version was loaded into the engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.recipes import default_recipe
from support.simutil import run_checked

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_a_vllm_sampler_on_a_ray_actor_trains_with_matching_logprobs(tmp_path: Path) -> None:
    sets = [
        "rollout.engine=vllm",
        "rollout.max_staleness=0",
        "run.steps=3",
        "rollout.groups_per_step=8",
        "rollout.prompts_per_request=8",
        "eval.enabled=false",
        "ray.enabled=true",
        "ray.num_cpus=2",
    ]
    run_dir = tmp_path / "run"
    run_checked(build_program(load_config(default_recipe(), sets), run_dir=run_dir), timeout=600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/logprob_diff_max"] < 1e-3 for r in rows), [r["train/logprob_diff_max"] for r in rows]


def test_a_vllm_sampler_on_a_ray_actor_with_interruptible_loads_passes_the_checker(tmp_path: Path) -> None:
    """rollout.interruptible at max_staleness 1: the actor serves loads on its `load` concurrency
    group's own event loop, which the sampler runs on the engine's loop (a load there hung)."""
    sets = [
        "rollout.engine=vllm",
        "rollout.max_staleness=1",
        "rollout.interruptible=true",
        "run.steps=3",
        "rollout.groups_per_step=8",
        "rollout.prompts_per_request=8",
        "eval.enabled=false",
        "ray.enabled=true",
        "ray.num_cpus=2",
    ]
    run_dir = tmp_path / "run"
    run_checked(build_program(load_config(default_recipe(), sets), run_dir=run_dir), timeout=600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
