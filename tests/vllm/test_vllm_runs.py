"""Runs of the default recipe with `rollout.engine = "vllm"` (the local trainer, one vLLM sampler
replica in this process): the sampler's log-probs agree with the trainer's at staleness 0, and a
run stopped after a step and resumed trains exactly what the uninterrupted run trains."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.recipes import default_recipe
from support.simutil import StopAt, Stopped, run_checked

pytestmark = pytest.mark.slow

SETS = [
    "rollout.engine=vllm",
    "rollout.temperature=0.7",
    "rollout.top_p=1.0",
    "rollout.max_staleness=0",
    "run.steps=4",
    "rollout.groups_per_step=8",
    "rollout.prompts_per_request=8",
    "eval.enabled=false",
    "orchestrator.checkpoint_every=1",
    "train.torch_threads=1",
    "train.learning_rate=1e-3",
    "train.warmup_steps=0",
]


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("vllm") / "whole"
    run_checked(build_program(load_config(default_recipe(), SETS), run_dir=run_dir), timeout=600)
    return _rows(run_dir)


def test_at_staleness_0_the_engines_logprobs_are_the_trainers(whole: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    for row in whole:
        assert row["train/logprob_diff_max"] < 1e-3, (row["step"], row["train/logprob_diff_max"])


def test_a_vllm_run_stopped_and_resumed_matches_the_uninterrupted_run(tmp_path: Path, whole: list[dict[str, Any]]) -> None:
    run_dir = tmp_path / "crash2"
    with pytest.raises(Stopped, match="stopped at step 2"):
        asyncio.run(build_program(load_config(default_recipe(), SETS), [StopAt(2)], run_dir=run_dir).run())
    run_checked(build_program(load_config(default_recipe(), SETS), run_dir=run_dir, resume=True), timeout=600)
    resumed = _rows(run_dir)
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    for a, b in zip(whole, resumed, strict=True):
        for key in ("reward_mean", "reward_std", "tokens", "train/completion_tokens", "num_trajectories"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-5), a["step"]
