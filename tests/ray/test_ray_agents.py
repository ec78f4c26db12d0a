"""Agents on Ray (task.agent with ray.enabled): the endpoint serves on the driver's event loop and
each agent call is sampled by its replica's actor through `generate_turns`; the completions
example trains on exactly the tokens the actors sampled, and the run passes the checker; an actor
whose process dies once its agents are done keeps their samples (only its caches died)."""

from __future__ import annotations

import json
import os
import signal
import warnings
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
from relayrl.orchestrator.replicas import SamplerRestartedWarning, SamplerSlot  # noqa: E402
from relayrl.orchestrator.stages.agents import AgentRollout  # noqa: E402
from relayrl.recipes import shipped_recipe  # noqa: E402
from relayrl.types import Group, MicroBatch, SampleRequest, Trajectory, TurnRequest, TurnResult  # noqa: E402
from support.agentutil import Sampled, assert_trained_as_sampled, sampled_of  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402
from support.simutil import run_checked, settled_groups  # noqa: E402

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


@pytest.mark.slow
def test_a_sampler_actor_that_dies_after_its_agents_are_done_keeps_their_samples(
    cluster: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica 0's actor process is killed once its first batch of agents is done, just before it is
    told to forget their caches: the batch's groups stand (its rollout returns them, they are not
    sampled again), the replica's next call restarts it, and the run completes."""
    killed: list[int] = []
    returned: list[tuple[int, bool]] = []  # (replica, whether a batch of that replica returned) per rollout
    end_episodes, call = RaySampler.end_episodes, AgentRollout.__call__

    async def killing_end(self: RaySampler, episodes: Sequence[str]) -> None:
        if self.replica == 0 and not killed:
            pid = await self.actor.pid.remote()
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        await end_episodes(self, episodes)

    async def recording_call(self: AgentRollout, slot: SamplerSlot, requests: list[SampleRequest]) -> list[Group]:
        try:
            groups = await call(self, slot, requests)
        except Exception:
            returned.append((slot.replica, False))
            raise
        returned.append((slot.replica, True))
        return groups

    monkeypatch.setattr(RaySampler, "end_episodes", killing_end)
    monkeypatch.setattr(AgentRollout, "__call__", recording_call)
    cfg = load_config(shipped_recipe("agent"), QUICK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SamplerRestartedWarning)
        result = run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=240)
    assert killed
    assert returned[[r for r, _ in returned].index(0)] == (0, True)  # replica 0's first batch: its groups stand
    ledger = result.ledger.as_dict()
    assert settled_groups(ledger) == ledger["groups_dispatched"] and ledger["trajectories_failed"] == 0
