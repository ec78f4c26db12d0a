"""The configured task: its training prompt stream and its fixed held-out set.

Invariant: task data problems surface here, before any run directory is written, as one
UserError (a ValueError) naming the config key or the file and row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from relayrl.config.schema import Config, ConfigError
from relayrl.errors import UserError
from relayrl.rewards.registry import Placement, ResolvedReward
from relayrl.tasks.correctness import answer_check
from relayrl.types import Prompt


@dataclass(slots=True)
class TaskData:
    stream: Iterator[Prompt]
    heldout: list[Prompt]
    # the training rows, when the task is a finite set (jsonl), and the key naming where they come from
    rows: tuple[Prompt, ...] | None = None
    source: str = ""


def build_task(cfg: Config) -> TaskData:
    t = cfg.task
    if t.kind == "synthetic":
        from relayrl.tasks.synthetic import synthetic_heldout, synthetic_stream

        return TaskData(synthetic_stream(cfg.run.seed), synthetic_heldout(t.heldout_size, cfg.run.seed))
    if t.kind == "arithmetic":
        from relayrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

        try:
            task = ArithmeticTask(ArithmeticConfig(max_digits=t.digits, operators=tuple(t.operators), seed=cfg.run.seed))
        except UserError as exc:
            raise ConfigError(str(exc).replace("arithmetic.", "task.").replace("max_digits", "digits")) from None
        return TaskData(task.stream(), task.heldout(t.heldout_size))
    if t.kind == "reasoning_gym":
        from relayrl.tasks.reasoning_gym import ReasoningGymConfig, ReasoningGymTask

        assert t.dataset is not None  # the config validator requires it for reasoning_gym
        rg_task = ReasoningGymTask(
            ReasoningGymConfig(
                dataset=t.dataset,
                options=t.dataset_config,
                size=t.dataset_size,
                seed=cfg.run.seed if t.dataset_seed is None else t.dataset_seed,
                heldout_size=t.heldout_size,
                heldout_seed=t.heldout_seed,
            )
        )
        return TaskData(rg_task.stream(), rg_task.heldout())
    from relayrl.tasks.jsonl import JsonlTask, JsonlTaskConfig

    assert t.path is not None  # the config validator requires it for jsonl
    heldout_path = Path(t.heldout_path) if t.heldout_path else None
    jtask = JsonlTask(JsonlTaskConfig(path=Path(t.path), heldout_path=heldout_path, heldout_last=t.heldout_last, seed=cfg.run.seed))
    heldout = jtask.heldout(min(t.heldout_size, len(jtask.heldout_prompts)))
    return TaskData(jtask.stream(), heldout, jtask.train_prompts, f"task.path = {t.path}")


def correctness_check(kind: str) -> ResolvedReward:
    """The task's own correctness check for `task.kind` (tasks/correctness.py), as a scorer runs
    it: the dataset's scorer at full credit for reasoning-gym (in a reward call thread, under the
    run's deadline), else the parsed answer equal to the prompt's answer (in the scoring thread)."""
    if kind == "reasoning_gym":
        from relayrl.tasks.reasoning_gym import reasoning_gym_correct

        return ResolvedReward("correct:reasoning_gym", reasoning_gym_correct, 1.0, Placement.THREAD)
    return answer_check()
