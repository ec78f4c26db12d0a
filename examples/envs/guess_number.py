"""A complete example of a user environment for relayrl (docs/environments.md).

A number-guessing game: the secret is the prompt's answer, each guess is answered "higher" or
"lower", and a right guess ends the episode with a reward that shrinks by `penalty` for every
extra guess it took. Name it in a recipe, relative to the recipe's directory or the working
directory:

    [task]
    kind = "jsonl"
    path = "guesses.jsonl"    # rows like {"prompt": "Guess my number (1 to 100):", "answer": "37"}
    environment = "examples/envs/guess_number.py:GuessNumber"
    environment_config = { penalty = 0.2 }
    observation_template = "\\n{observation}\\n"

    [rollout]
    max_turns = 5

relayrl calls `GuessNumber(**environment_config)` once per run, then `start(prompt)` once per
sampled trajectory and `step(action)` once per policy turn. The same environment serves many
episodes at once, so everything that changes during an episode lives in the episode object.

Sync or async: `GuessNumber`'s methods are `async def`, so relayrl awaits them on its event loop:
use that for I/O (a game server, an HTTP tool, a subprocess), and never block in them.
`GuessNumberSync` is the same game with plain `def` methods, which relayrl runs in a worker
thread: use that for CPU work. Either kind may mix: a plain `start` with an `async def step`.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from relayrl.envs.base import EnvStep
from relayrl.types import Prompt

NUMBER = re.compile(r"-?\d+")


def judge(secret: int, action: str, guesses: int, penalty: float) -> EnvStep:
    """The game's rule, shared by both versions: `guesses` counts this one."""
    found = NUMBER.search(action)
    if found is None:
        return EnvStep("Say a number.")
    guess = int(found.group())
    if guess == secret:
        # EnvStep(observation=None, ...) ends the episode; `solved` counts towards accuracy
        return EnvStep(None, reward=max(0.0, 1.0 - penalty * (guesses - 1)), solved=True)
    # reward 0 now; the observation is shown to the policy (through task.observation_template)
    return EnvStep(f"{guess} is too {'low' if guess < secret else 'high'}. Guess again:")


@dataclass(slots=True)
class GuessEpisode:
    """One game (async `step`): its secret and the guesses so far."""

    secret: int
    penalty: float
    guesses: int = 0

    async def step(self, action: str) -> EnvStep:
        await asyncio.sleep(0)  # e.g. `reply = await client.post(GAME_URL, json={"guess": action})`
        self.guesses += 1
        return judge(self.secret, action, self.guesses, self.penalty)


class GuessNumber:
    """The async version: relayrl awaits `start` and `step` on its event loop."""

    def __init__(self, penalty: float = 0.25) -> None:
        if not 0.0 <= penalty <= 1.0:
            raise ValueError(f"penalty must lie in [0, 1], got {penalty}")
        self.penalty = penalty

    async def start(self, prompt: Prompt) -> GuessEpisode:
        return GuessEpisode(secret=int(prompt.answer), penalty=self.penalty)


@dataclass(slots=True)
class SyncGuessEpisode:
    """One game (plain `step`)."""

    secret: int
    penalty: float
    guesses: int = 0

    def step(self, action: str) -> EnvStep:
        self.guesses += 1
        return judge(self.secret, action, self.guesses, self.penalty)


class GuessNumberSync:
    """The plain version: relayrl runs `start` and `step` in a worker thread."""

    def __init__(self, penalty: float = 0.25) -> None:
        if not 0.0 <= penalty <= 1.0:
            raise ValueError(f"penalty must lie in [0, 1], got {penalty}")
        self.penalty = penalty

    def start(self, prompt: Prompt) -> SyncGuessEpisode:
        return SyncGuessEpisode(secret=int(prompt.answer), penalty=self.penalty)
