"""Every dispatched group samples afresh: its randomness is keyed by the prompt's index in the
run's prompt stream, not by the prompt, so a prompt dispatched again (a later epoch, a group
filtered and replaced, two groups of one prompt in flight) never replays an earlier group, and
dynamic sampling on a tiny data set cannot livelock on one tied group."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.telemetry.trajlog import read_trajectories
from support.simutil import run_checked

LOCAL = [
    "run.backend=local",
    "task.kind=jsonl",
    "eval.enabled=false",
    "orchestrator.release_memory=false",
    "train.torch_threads=1",
    "rollout.sampler_threads=1",
]


def _dataset(tmp_path: Path, rows: list[dict[str, str]]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("seed", range(5))
def test_a_one_prompt_dataset_under_dynamic_sampling_commits_its_steps(tmp_path: Path, seed: int) -> None:
    """The reviewer's livelock: one prompt the model solves about half the time, 2 samples a group,
    dynamic sampling. Keyed by (seed, prompt, version), a tied group was replaced by the same tied
    group forever (seed 4: 1,095 groups filtered in 20 s, step 1 never committed)."""
    data = _dataset(tmp_path, [{"prompt": "20+7=", "answer": "27"}])
    sets = [*LOCAL, f"task.path={data}", f"run.seed={seed}", "run.steps=3", "rollout.num_generations=2"]
    sets += ["rollout.groups_per_step=1", "rollout.prompts_per_request=1", "algorithm.dynamic_sampling=true"]
    started = time.perf_counter()
    result = run_checked(build_program(load_config(None, sets), run_dir=tmp_path / "run"), timeout=90)
    print(f"seed {seed}: 3 steps committed in {time.perf_counter() - started:.1f} s, {result.ledger.groups_dispatched} groups dispatched")
    assert [r.step for r in result.results] == [1, 2, 3]
    rows = read_trajectories(tmp_path / "run").to_pylist()
    trained = [r for r in rows if r["status"] == "ok"]
    assert len(trained) == 3 * 2
    for step in range(1, 4):
        texts = [r["completion"] for r in trained if r["step"] == step]
        assert len(set(texts)) == 2  # a kept group does not tie


def test_no_two_groups_of_a_run_repeat_each_other(tmp_path: Path) -> None:
    """A 4-prompt data set, 4 groups a step, max_staleness 1: step 1 dispatches the same 4 prompts
    again while the samplers may still hold version 0. Keyed by the prompt alone, step 1 was an
    exact replay of step 0 (same G completions, bit for bit)."""
    data = _dataset(tmp_path, [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((12, 30), (41, 7), (25, 25), (60, 13))])
    sets = [*LOCAL, f"task.path={data}", "run.steps=4", "rollout.num_generations=8", "rollout.groups_per_step=4"]
    sets += ["rollout.prompts_per_request=4", "rollout.max_staleness=1", "train.learning_rate=1e-9"]
    run_checked(build_program(load_config(None, sets), run_dir=tmp_path / "run"), timeout=90)
    rows = read_trajectories(tmp_path / "run").to_pylist()
    groups: dict[int, tuple[str, int, tuple[tuple[int, ...], ...]]] = {}
    for r in rows:
        prompt, version, samples = groups.get(r["group_id"], (r["prompt_id"], r["policy_version"], ()))
        groups[r["group_id"]] = (prompt, version, (*samples, tuple(r["completion_tokens"])))
    by_prompt: dict[str, list[tuple[int, tuple[tuple[int, ...], ...]]]] = {}
    for prompt, version, samples in groups.values():
        by_prompt.setdefault(prompt, []).append((version, tuple(sorted(samples))))
    assert all(len(v) >= 2 for v in by_prompt.values())  # every prompt was dispatched more than once
    same_version = 0
    for dispatches in by_prompt.values():
        for i, (va, a) in enumerate(dispatches):
            for vb, b in dispatches[i + 1 :]:
                same_version += va == vb
                assert a != b, "two groups of one prompt sampled the same completions"
    assert same_version > 0  # the case at issue: one prompt dispatched twice under one version
