"""Agents on Ray (task.agent with ray.enabled): the endpoint serves on the driver's event loop and
each agent call is sampled by its replica's actor through `generate_turns`; the completions
example trains on exactly the tokens the actors sampled, and the run passes the checker."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from relayrl.analysis import timeline  # noqa: E402
from relayrl.backends.local.collate import TorchCollator  # noqa: E402
from relayrl.backends.ray.actors import RaySampler  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.config.schema import load_config  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from relayrl.recipes import shipped_recipe  # noqa: E402
from relayrl.types import MicroBatch, Trajectory, TurnRequest, TurnResult  # noqa: E402
from support.agentutil import Sampled, assert_trained_as_sampled, sampled_of  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402
from support.simutil import run_checked  # noqa: E402

cluster = pytest.fixture(scope="module")(local_cluster)

QUICK = [
    "run.steps=2",
    "rollout.num_generations=4",
    "rollout.groups_per_step=4",
    "rollout.prompts_per_request=2",
    "rollout.num_samplers=2",
    "eval.enabled=false",
    "orchestrator.release_memory=false",
    "orchestrator.checkpoint_every=0",
    "run.save_model=false",
    "ray.enabled=true",
    "ray.address=auto",
]


@pytest.mark.slow
def test_the_completions_example_trains_on_ray_on_exactly_the_tokens_the_actors_sampled(
    cluster: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampled: list[Sampled] = []
    trained: list[Trajectory] = []
    generate_turns, collate = RaySampler.generate_turns, TorchCollator.collate

    async def recording_turns(self: RaySampler, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        results = await generate_turns(self, requests)  # what the actor returned, as the driver got it
        sampled.extend(sampled_of(requests, results))
        return results

    def recording_collate(self: TorchCollator, mb: MicroBatch) -> object:
        trained.extend(mb.trajectories)
        return collate(self, mb)

    monkeypatch.setattr(RaySampler, "generate_turns", recording_turns)
    monkeypatch.setattr(TorchCollator, "collate", recording_collate)
    cfg = load_config(shipped_recipe("agent"), QUICK)
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=240)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    assert summary["ledger"]["trajectories_failed"] == 0
    two_calls = assert_trained_as_sampled(sampled, trained)
    assert two_calls > len(trained) // 2  # the answer call continues the draft's sequence
    assert all(t.agent_reward is not None for t in trained)
    all_spans = timeline.spans(result.tracer.events)
    on_actors = {s.lane for s in all_spans if s.lane.startswith("actor:sampler/") and s.name == "generate_turns"}
    assert on_actors == {"actor:sampler/0", "actor:sampler/1"}  # every replica's actor sampled agent calls
    assert any(s.name == "generate" and s.args.get("agents") for s in all_spans)
    assert {t.replica for t in trained} == {0, 1}
