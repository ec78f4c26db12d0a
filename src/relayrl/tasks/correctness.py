"""The task's own correctness check: what held-out `accuracy` counts, whatever reward functions
the run trains on.

A completion is correct when its parsed answer is the prompt's answer: the text inside its last
``<answer>…</answer>`` (else the whole completion), stripped, equals the prompt's `answer`,
stripped (`answer_match`: arithmetic, synthetic and JSONL tasks, a user's JSONL task with its own
reward included); for reasoning-gym tasks, when the dataset's own scorer gives the parsed answer
full credit (`score_answer(...) == 1.0`, tasks/reasoning_gym.py `reasoning_gym_correct`);
tasks/build.py `correctness_check` gives a task kind's check. Multi-turn tasks count an
episode correct when an action `solved` it (envs/base.py); the evaluator does that itself.

Invariant: a check is a function of one trajectory returning 1.0 (correct) or 0.0, run by a
`Scorer` like a reward (eval/heldout.py): `answer_match` in the scoring thread (a string
comparison), the dataset's scorer in a reward call thread with the run's deadline
(`task.reward_timeout_s`), so a scorer that hangs makes its completion wrong and never stalls the
run. Neither starts a process, so a correctness scorer has nothing to close.
"""

from __future__ import annotations

import re

from relayrl.rewards.registry import Placement, ResolvedReward
from relayrl.types import Trajectory

#: what a correctness check's outcome must be for its completion to count as correct
CORRECT = 1.0
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def parsed_answer(completion: str) -> str:
    """The answer a completion gives: the text inside its last ``<answer>…</answer>``, else the
    whole completion; stripped either way (also what the `reasoning_gym` reward scores)."""
    tagged = _ANSWER_TAG.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def answer_match(trajectory: Trajectory) -> float:
    """1.0 when the completion's parsed answer equals the prompt's answer (both stripped)."""
    return CORRECT if parsed_answer(trajectory.completion_text) == trajectory.prompt.answer.strip() else 0.0


def answer_check() -> ResolvedReward:
    """`answer_match` as the scorer runs it (arithmetic, synthetic and JSONL tasks)."""
    return ResolvedReward("correct:answer_match", answer_match, 1.0, Placement.INLINE)


def is_correct(outcome: object) -> bool:
    """Whether a check's outcome (a float, or a failure: raised, timed out) says correct."""
    return outcome.__class__ is float and outcome == CORRECT
