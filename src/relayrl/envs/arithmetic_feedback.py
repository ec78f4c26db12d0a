"""The built-in environment `arithmetic_feedback`: integer questions answered over several tries.

Job: score each action by the first integer in its text against the prompt's integer `answer`
(relayrl's arithmetic and synthetic tasks: text "23+9=", answer "32"). A correct answer at turn k
(1-based) earns `discount ** (k - 1)` and ends the episode, solved; a wrong one earns 0 and is
answered "too high", "too low" or "not a number", followed (by default) by the question again, so
a model that answers "x+y=" prompts can try again.

Invariants:
- The environment holds no per-episode state: each episode keeps its own turn count, so one
  instance serves any number of episodes at once; a step is a pure function of (prompt, turn,
  action).
- Every observation uses only characters of the shipped tiny model's character tokenizer
  (scripts/make_tiny_model.py CHARS): letters, digits, a little punctuation, space, newline.
- A prompt whose answer is not an integer is refused at `start`, naming the prompt id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from relayrl.envs.base import EnvStep
from relayrl.types import Prompt

__all__ = ["ArithmeticFeedback", "FeedbackEpisode", "action_integer", "first_integer", "integer_answer"]

_INTEGER = re.compile(r"-?[0-9]+")

TOO_HIGH = "too high"
TOO_LOW = "too low"
NOT_A_NUMBER = "not a number"


def first_integer(text: str) -> int | None:
    """The first integer in `text` (ASCII digits, an optional leading '-'), or None."""
    found = _INTEGER.search(text)
    return None if found is None else int(found.group())


def action_integer(text: str, pick: str) -> int | None:
    """The integer an action answers with: its first (`pick` "first": a model that answers with
    the bare number) or its last ("last": a chatty one, "5 + 10 = 15"); None when it has none."""
    if pick == "first":
        return first_integer(text)
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def check_pick(pick: object) -> str:
    if pick not in ("first", "last"):
        raise ValueError(f"pick must be 'first' or 'last' (which integer of an action is its answer), got {pick!r}")
    return str(pick)


def integer_answer(prompt: Prompt, environment: str) -> int:
    """The prompt's answer as an integer; a ValueError naming the prompt id (and `environment`)
    when it is not one."""
    text = prompt.answer.strip()
    if not _INTEGER.fullmatch(text):
        raise ValueError(f"{environment}: prompt {prompt.prompt_id!r} has answer {prompt.answer!r}, which is not an integer")
    return int(text)


@dataclass(slots=True)
class FeedbackEpisode:
    """One episode: the question, its answer, and how many actions were taken."""

    prompt: Prompt
    answer: int
    discount: float
    restate: bool
    max_turns: int
    pick: str = "first"
    turns: int = field(default=0)

    def step(self, action: str) -> EnvStep:
        self.turns += 1
        guess = action_integer(action, self.pick)
        if guess == self.answer:
            return EnvStep(None, reward=float(self.discount ** (self.turns - 1)), solved=True)
        if self.turns >= self.max_turns:
            return EnvStep(None)  # the last try: nothing more to say
        verdict = NOT_A_NUMBER if guess is None else TOO_HIGH if guess > self.answer else TOO_LOW
        return EnvStep(f"{verdict}\n{self.prompt.text}" if self.restate else verdict)


class ArithmeticFeedback:
    """Integer questions with "too high" / "too low" feedback (see the module docstring).

    Options (`task.environment_config`): `discount` (0..1, default 0.5): a correct answer at turn
    k earns `discount ** (k - 1)`; `restate` (default true): a wrong answer's observation repeats
    the question after the verdict, on its own line; `pick` ("first", default, or "last"): which
    integer of an action is its answer (the last for chatty models). `max_turns` comes from `rollout.max_turns`:
    after the last try the episode ends without an observation."""

    __slots__ = ("discount", "restate", "max_turns", "pick")

    def __init__(self, *, max_turns: int, discount: float = 0.5, restate: bool = True, pick: str = "first") -> None:
        if isinstance(discount, bool) or not isinstance(discount, int | float) or not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be a number in [0, 1], got {discount!r}")
        if not isinstance(restate, bool):
            raise ValueError(f"restate must be true or false, got {restate!r}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        self.discount = float(discount)
        self.restate = restate
        self.max_turns = max_turns
        self.pick = check_pick(pick)

    def start(self, prompt: Prompt) -> FeedbackEpisode:
        return FeedbackEpisode(
            prompt, integer_answer(prompt, "arithmetic_feedback"), self.discount, self.restate, self.max_turns, self.pick
        )
