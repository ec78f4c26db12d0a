"""The `Environment` protocol: what a multi-turn task implements.

An environment starts one episode per sampled trajectory from its prompt; the policy then takes
turns: each action (the text of one policy turn) goes to the episode's `step`, which answers with
an `EnvStep`: an observation shown to the policy before its next turn (or None: the episode is
over) and this action's reward part. The trajectory's reward is the sum of its parts.

Both methods may be `async def` (awaited on the event loop: I/O, an HTTP tool, a subprocess; a
wait holds no thread) or plain `def` (run in an environment call thread: CPU-bound steps never
run on the event loop). Each call is bounded by `rollout.env_step_timeout_s` (envs/calls.py). The
episode runner (orchestrator/stages/episodes.py) ends every episode after `rollout.max_turns`
actions, or earlier when the next turn would not fit in `rollout.max_total_tokens`; the step of
the last action is still taken (it scores it) and its observation is dropped.

An observation is tokenized as plain text: a special token's string in it (`<eos>`, a chat
model's `<|im_start|>`) is ordinary text, so a tool's output cannot inject control tokens. An
environment whose observations must carry special tokens opts in with a class attribute
`special_tokens_in_observations = True`.

Invariant: an environment sees only texts (the prompt, the actions); tokens, log-probs and
versions stay with the runner, which records them per turn in the trajectory.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from relayrl.types import Prompt

__all__ = ["EnvStep", "Environment", "Episode"]


@dataclass(slots=True, frozen=True)
class EnvStep:
    """The environment's answer to one action.

    `observation`: the text shown to the policy before its next turn (the task's
    `observation_template` wraps it); None ends the episode. `reward`: this action's reward part.
    `tool_call`: the action was a tool call (counted in the step metrics). `solved`: the task is
    solved (held-out success and first-turn accuracy count it)."""

    observation: str | None
    reward: float = 0.0
    tool_call: bool = False
    solved: bool = False


class Episode(Protocol):
    """One running episode (one trajectory)."""

    def step(self, action: str) -> EnvStep | Awaitable[EnvStep]:
        """Take the policy's action text; return the observation (or None) and a reward part."""
        ...


class Environment(Protocol):
    """Starts episodes. One instance serves a whole run, many episodes at once."""

    def start(self, prompt: Prompt) -> Episode | Awaitable[Episode]:
        """A new episode for `prompt` (the task's prompt; its text is what the policy reads first)."""
        ...
