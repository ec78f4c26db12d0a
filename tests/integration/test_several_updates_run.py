"""Runs with several updates per step (`train.ppo_epochs = 2`, `train.minibatches_per_step = 2`)
and with step-level advantages pass `relayrl check-trace`: one optim_step, one commit and one
version per step, whatever happens inside it; the local trainer reports its updates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from support.simutil import make_program, run_checked, sim_config


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("advantage", [("grpo", "batch"), ("reinforce_pp", None)])
def test_a_sim_run_with_several_updates_per_step_passes_the_checker(tmp_path: Path, advantage: tuple[str, str | None]) -> None:
    kind, scale = advantage
    extra = [f"algorithm.scale_rewards={scale}"] if scale else []
    cfg = sim_config("train.ppo_epochs=2", "train.minibatches_per_step=2", f"algorithm.advantage={kind}", *extra)
    program = make_program(cfg, tmp_path)
    result = run_checked(program)
    assert [r.policy_version for r in result.results] == [1, 2, 3, 4]  # one version per step
    rows = _rows(tmp_path / "run")
    assert [r["train/updates"] for r in rows] == [4.0] * 4
    # the advantages were finished over each step (REINFORCE++'s stage leaves 0): the sim's loss
    # is minus the mean |advantage| / 10
    assert all(r["train/loss"] < 0 for r in rows)


@pytest.mark.slow
def test_a_local_run_with_two_epochs_and_two_minibatches_passes_the_checker(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "run.backend=local",
            "task.kind=arithmetic",
            "run.steps=3",
            "rollout.num_generations=4",
            "rollout.groups_per_step=4",
            "task.heldout_size=16",
            "orchestrator.release_memory=false",
            "train.learning_rate=1e-3",
            "train.ppo_epochs=2",
            "train.minibatches_per_step=2",
            "algorithm.tis_cap=2.0",
        ],
    )
    run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=180)
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 < r["train/updates"] <= 4  # a minibatch whose groups all tie has no gradient, but is still applied
        assert "train/clip_frac_low_epoch2" in r and "train/ppo_kl" in r
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
