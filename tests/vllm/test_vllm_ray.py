"""A vLLM sampler replica hosted in a Ray actor (`--ray` with `rollout.engine = "vllm"`): the
actor builds the engine with its factory, the weights reach it through the object store or (the
default, "auto") through the collective transport received in the engine's worker, and at
staleness 0 its log-probs are the trainer's (so every version was loaded into the engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.analysis import timeline
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.recipes import default_recipe
from support.simutil import run_checked

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_vllm_sampler_on_a_ray_actor_trains_with_matching_logprobs(tmp_path: Path, transport: str) -> None:
    """At staleness 0 the engine's log-probs are the trainer's, step after step (so every version
    reached the model), by either Ray transport. With "collective" (issue 31 §1) the engine's worker
    joins the Ray trainer's weight group in its actor's place and receives every version through
    vLLM's weight-transfer API (no copy into the actor, no weight file): each broadcast load span
    of the actor says so (`received_by = "engine"`); the trace passes the checker either way."""
    sets = [
        "rollout.engine=vllm",
        f"rollout.weight_transport={transport}",
        "rollout.max_staleness=0",
        "run.steps=3",
        "rollout.groups_per_step=8",
        "rollout.prompts_per_request=8",
        "eval.enabled=false",
        "ray.enabled=true",
        "ray.num_cpus=2",
    ]
    run_dir = tmp_path / "run"
    result = run_checked(build_program(load_config(default_recipe(), sets), run_dir=run_dir), timeout=600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/logprob_diff_max"] < 1e-3 for r in rows), [r["train/logprob_diff_max"] for r in rows]
    loads = [s for s in timeline.spans(result.tracer.events) if s.lane == "actor:sampler/0" and s.name == "load_weights"]
    broadcast = [s for s in loads if "transport" in s.args]
    if transport == "object_store":
        assert not broadcast, [s.args for s in loads]
        return
    assert len(broadcast) >= 2, [s.args for s in loads]  # versions 1 and 2 at least, each a broadcast round
    assert all(s.args["transport"] == "collective" and s.args["received_by"] == "engine" for s in broadcast), [s.args for s in loads]


def test_a_vllm_sampler_on_a_ray_actor_with_interruptible_loads_passes_the_checker(tmp_path: Path) -> None:
    """rollout.interruptible at max_staleness 1: the actor serves loads on its `load` concurrency
    group's own event loop, which the sampler runs on the engine's loop (a load there hung); the
    transport is "auto", the collective received in the engine's worker."""
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
    result = run_checked(build_program(load_config(default_recipe(), sets), run_dir=run_dir), timeout=600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    loads = [s for s in timeline.spans(result.tracer.events) if s.name == "load_weights" and "transport" in s.args]
    assert loads and all(s.args.get("received_by") == "engine" for s in loads), [s.args for s in loads]
