"""Held-out accuracy is the task's own correctness check; the mean reward is reported apart."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from rich.console import Console

from relayrl.backends import registry
from relayrl.backends.sim import build as sim_build
from relayrl.config.schema import Config
from relayrl.eval.heldout import HeldoutEvaluator
from relayrl.orchestrator.build import build_program
from relayrl.rewards.registry import resolve_rewards
from relayrl.rewards.scoring import Scorer, ScorerSettings
from relayrl.rundir.files import append_eval, eval_row
from relayrl.tasks.build import correctness_check
from relayrl.tasks.correctness import answer_match, parsed_answer
from relayrl.telemetry.progress import ProgressPrinter
from relayrl.threads import OrchestratorThreads
from relayrl.types import EvalResult, Prompt, Trajectory, Weights
from support.simutil import run_checked, sim_config

# five prompts; the policy answers "7" to each, right only for the first
PROMPTS = [Prompt(f"p{i}", f"{i}+7=", str(i + 7)) for i in range(5)]


class SevenEngine:
    async def load_weights(self, weights: Weights) -> None:
        return None

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return [[7] for _ in prompts_tokens]

    async def close(self) -> None:
        return None


def partial_credit(t: Trajectory) -> float:
    """1.0 for the right answer, 0.5 for any other (a format reward, say)."""
    return 1.0 if t.completion_text.strip() == t.prompt.answer else 0.5


def _evaluator(**kwargs: object) -> HeldoutEvaluator:
    return HeldoutEvaluator(SevenEngine(), PROMPTS, lambda text: [ord(c) for c in text], lambda tokens: "7", 4, **kwargs)  # type: ignore[arg-type]


def test_accuracy_is_the_tasks_check_not_a_positive_partial_credit_reward() -> None:
    result = asyncio.run(_evaluator(reward_fns=(partial_credit,)).evaluate(Weights(version=2, payload=None)))
    assert result.version == 2
    assert result.accuracy == 0.2  # 1 of 5 right (a positive reward for every answer said 1.0)
    assert result.reward_mean == (1.0 + 4 * 0.5) / 5


def test_in_a_run_the_scorers_reward_and_the_tasks_check_judge_apart() -> None:
    threads = OrchestratorThreads()
    settings = ScorerSettings(workers=1)
    rewards = Scorer(resolve_rewards([partial_credit]), settings, threads)
    correctness = Scorer([correctness_check("jsonl")], settings, threads)
    try:
        result = asyncio.run(_evaluator(scorer=rewards, correctness=correctness).evaluate(None))
    finally:
        threads.shutdown()
        rewards.close()
        correctness.close()
    assert (result.accuracy, result.reward_mean) == (0.2, 0.6)
    assert correctness.pool is None  # the check starts no worker process


def test_the_parsed_answer_is_the_last_answer_tag_or_the_whole_completion() -> None:
    assert parsed_answer(" 12\n") == "12"
    assert parsed_answer("think <answer>3</answer> then <answer> 12 </answer>.") == "12"
    prompt = Prompt("q", "5+7=", " 12 ")
    traj = Trajectory(0, 0, prompt, [], [], [], "<answer>12</answer>", 0, 0)
    assert answer_match(traj) == 1.0
    traj.completion_text = "5 + 7 = 12"
    assert answer_match(traj) == 0.0


def test_the_mean_reward_is_recorded_next_to_the_accuracy(tmp_path: Path) -> None:
    result = EvalResult(3, 0.2, 5, 0.1, reward_mean=0.6)
    append_eval(tmp_path, result)
    row = json.loads((tmp_path / "evals.jsonl").read_text())
    assert row["accuracy"] == 0.2 and row["reward_mean"] == 0.6
    assert EvalResult(**eval_row(result)) == result  # type: ignore[arg-type]  # a checkpoint's evals round-trip
    older = {k: v for k, v in eval_row(result).items() if k != "reward_mean"}  # written before it existed
    assert EvalResult(**older).reward_mean is None  # type: ignore[arg-type]


def test_the_console_says_both_figures() -> None:
    out = io.StringIO()
    ProgressPrinter(10, Console(file=out, width=200), live=False).on_eval(EvalResult(3, 0.2, 5, 0.1, reward_mean=0.6))
    assert "held-out accuracy 0.200, mean reward 0.600 (policy version 3, 5 prompts)" in out.getvalue()


def test_reasoning_gym_is_correct_only_at_the_datasets_full_credit() -> None:
    from relayrl.tasks.reasoning_gym import ReasoningGymConfig, ReasoningGymTask, reasoning_gym_reward

    check = correctness_check("reasoning_gym")
    prompt = ReasoningGymTask(ReasoningGymConfig("basic_arithmetic", size=2, heldout_size=0)).train_prompts[0]
    traj = Trajectory(0, 0, prompt, [], [], [], f"<answer>{prompt.answer}</answer>", 0, 0)
    assert check.fn(traj) == 1.0
    traj.completion_text = f"the answer is {prompt.answer}"
    assert 0.0 < reasoning_gym_reward(traj) < 1.0 and check.fn(traj) == 0.0  # partial credit is a reward, not a right answer


class _SevenEngine(SevenEngine):
    async def load_weights(self, weights: Weights) -> None:
        return None


def _greedy_sim(cfg: Config, abort: threading.Event) -> registry.Compute:
    """The sim's compute kind plus a greedy engine that answers "7" to every held-out prompt."""
    compute = sim_build.compute(cfg, abort)
    compute.greedy_engine = _SevenEngine
    compute.decode = lambda tokens: "7"
    return compute


def test_a_run_with_a_partial_credit_reward_reports_accuracy_and_mean_reward_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.KINDS, "sim", f"{__name__}:_greedy_sim")
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1, 9)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps({"prompt": p.text, "answer": p.answer}) + "\n" for p in PROMPTS))
    task = ["task.kind=jsonl", f"task.path={tmp_path / 'train.jsonl'}", f"task.heldout_path={tmp_path / 'heldout.jsonl'}", "run.steps=2"]
    cfg = sim_config(*task)
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run", reward_fns=[partial_credit]))
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert [(e["version"], e["accuracy"], e["reward_mean"]) for e in evals] == [(0, 0.2, 0.6), (2, 0.2, 0.6)]
    s = result.summary
    assert (s["accuracy_before"], s["accuracy_after"], s["heldout_reward_mean_before"], s["heldout_reward_mean_after"]) == (
        0.2,
        0.2,
        0.6,
        0.6,
    )
    # task.reward_clip clips the rewards (1.0 -> 0.5), never the task's own check
    clipped = run_checked(
        build_program(sim_config(*task, "task.reward_clip=0.5"), run_dir=tmp_path / "clipped", reward_fns=[partial_credit])
    )
    assert (clipped.summary["accuracy_before"], clipped.summary["heldout_reward_mean_before"]) == (0.2, 0.5)
