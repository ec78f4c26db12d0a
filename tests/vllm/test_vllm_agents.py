"""Agents on the vLLM engine (task.agent with rollout.engine = "vllm", one replica in this
process): the completions example trains through the endpoint on exactly the tokens the engine
sampled (`generate_turns`), whose log-probs are the trainer's at staleness 0, and the run passes
the checker."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.backends.local.collate import TorchCollator
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.recipes import shipped_recipe
from relayrl.types import MicroBatch, Trajectory, TurnRequest, TurnResult
from support.agentutil import Sampled, assert_trained_as_sampled, sampled_of
from support.simutil import run_checked

pytestmark = pytest.mark.slow

SETS = [
    "rollout.engine=vllm",
    "rollout.max_staleness=0",
    "run.steps=2",
    "rollout.num_generations=4",
    "rollout.groups_per_step=4",
    "rollout.prompts_per_request=4",
    "eval.enabled=false",
    "orchestrator.checkpoint_every=0",
    "orchestrator.release_memory=false",
    "run.save_model=false",
    "train.torch_threads=1",
]


def test_the_completions_example_trains_on_the_vllm_engine_on_exactly_the_sampled_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relayrl.backends.vllm.sampler import VllmSampler

    sampled: list[Sampled] = []
    trained: list[Trajectory] = []
    generate_turns, collate = VllmSampler.generate_turns, TorchCollator.collate

    async def recording_turns(self: VllmSampler, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        results = await generate_turns(self, requests)
        sampled.extend(sampled_of(requests, results))
        return results

    def recording_collate(self: TorchCollator, mb: MicroBatch) -> object:
        trained.extend(mb.trajectories)
        return collate(self, mb)

    monkeypatch.setattr(VllmSampler, "generate_turns", recording_turns)
    monkeypatch.setattr(TorchCollator, "collate", recording_collate)
    run_dir = tmp_path / "run"
    run_checked(build_program(load_config(shipped_recipe("agent"), SETS), run_dir=run_dir), timeout=600)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger"]["trajectories_failed"] == 0
    two_calls = assert_trained_as_sampled(sampled, trained)
    assert two_calls > len(trained) // 2  # the answer call continues the draft's sequence
    assert any(t.finish_reason == "stop" for t in trained)  # an episode's call ended on EOS: trained as sampled too
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # the engine's log-probs of the trained tokens are the trainer's over the same sequences
        assert row["train/logprob_diff_max"] < 1e-3, (row["step"], row["train/logprob_diff_max"])
