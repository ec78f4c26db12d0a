"""The built-in environment `draft_answer`: "draft, then answer", the multi-turn twin of the example
agent examples/agents/completions_agent.py (`relayrl bench agent` runs both on the same task).

Job: the first action is a draft, answered with a newline and the question again ("23+9=31" is
followed by "\n23+9="); the second is the final answer and ends the episode. The reward: 1 for a
right final answer plus 0.5 for a right draft, each compared as the example agent compares
(the action's text, stripped, equal to the prompt's answer); a right final answer is `solved`.

Invariants:
- no per-episode state but its turn count: one instance serves any number of episodes at once;
- every observation uses only characters of the prompt (so the shipped tiny model's vocabulary
  holds them) and a newline.
- `max_turns` (rollout.max_turns) below 2 is refused: an episode is two actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.envs.base import EnvStep
from relayrl.types import Prompt

__all__ = ["DRAFT_REWARD", "DraftAnswer", "DraftEpisode"]

#: the reward part of a right draft (a right final answer earns 1)
DRAFT_REWARD = 0.5


@dataclass(slots=True)
class DraftEpisode:
    prompt: Prompt
    turns: int = field(default=0)

    def step(self, action: str) -> EnvStep:
        self.turns += 1
        right = action.strip() == self.prompt.answer.strip()
        if self.turns == 1:
            return EnvStep(f"\n{self.prompt.text}", reward=DRAFT_REWARD if right else 0.0)
        return EnvStep(None, reward=1.0 if right else 0.0, solved=right)


class DraftAnswer:
    """Draft, then answer (see the module docstring); no options."""

    __slots__ = ("max_turns",)

    def __init__(self, *, max_turns: int) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 2:
            raise ValueError(f"draft_answer takes two actions per episode: rollout.max_turns must be >= 2, got {max_turns!r}")
        self.max_turns = max_turns

    def start(self, prompt: Prompt) -> DraftEpisode:
        return DraftEpisode(prompt)
