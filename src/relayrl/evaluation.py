"""Held-out evaluation: greedy exact-match accuracy of a given policy version.

A completion is correct when every configured reward function gives it a positive reward (the
same functions that score training rollouts). In a run the functions are called through the run's
scorer (`attach_scorer`): user functions in their worker processes, async ones on the loop, each
bounded by its timeout; a failed call (timeout, raised, crashed, non-finite) makes the completion
wrong and is not counted in the ledger. Without a scorer the functions are called here.

Invariant: an evaluation reports the version whose weights it measured (the engine loads those
weights first; the evaluator remembers the version it last loaded, and does not ask the engine),
on the same fixed prompts every time, so accuracies are comparable across a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relayrl.tasks.rewards import RewardFunction, exact_match
from relayrl.types import Prompt, Trajectory, Weights

if TYPE_CHECKING:
    from relayrl.backends.protocols import GreedyEngine
    from relayrl.scoring import Scorer


@dataclass(slots=True, frozen=True)
class EvalResult:
    version: int
    accuracy: float
    num_prompts: int
    seconds: float


class HeldoutEvaluator:
    def __init__(
        self,
        engine: GreedyEngine,
        prompts: Sequence[Prompt],
        tokenize: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        max_new_tokens: int,
        reward_fns: Sequence[RewardFunction] = (exact_match,),
        version: int = 0,
    ) -> None:
        """`version`: the policy version the engine holds when built."""
        if not prompts:
            raise ValueError("held-out evaluation needs at least one prompt (task.heldout_size)")
        self._engine = engine
        self._prompts = list(prompts)
        self._tokens = [tokenize(p.text) for p in prompts]
        self._decode = decode
        self._max_new_tokens = max_new_tokens
        self._reward_fns = list(reward_fns)
        self._version = version  # what the engine holds: the version last loaded into it
        self._scorer: Scorer | None = None

    def attach_scorer(self, scorer: Scorer) -> None:
        """Judge completions with the run's scorer (and its reward functions) from now on."""
        self._scorer = scorer

    async def evaluate(self, weights: Weights | None) -> EvalResult:
        """Accuracy of `weights` (None: of the weights the engine holds now)."""
        start = time.perf_counter()
        if weights is not None:
            await self._engine.load_weights(weights)
            self._version = weights.version
        version = self._version
        outputs = await self._engine.greedy(self._tokens, self._max_new_tokens)
        trajs = [self._trajectory(p, toks, out, version) for p, toks, out in zip(self._prompts, self._tokens, outputs, strict=True)]
        if self._scorer is not None:
            correct = sum(all(isinstance(x, float) and x > 0 for x in row) for row in await self._scorer.outcomes(trajs))
        else:
            correct = sum(self._correct(t) for t in trajs)
        return EvalResult(version, correct / len(self._prompts), len(self._prompts), time.perf_counter() - start)

    def _trajectory(self, prompt: Prompt, prompt_tokens: list[int], output: list[int], version: int) -> Trajectory:
        return Trajectory(
            group_id=-1,
            sample_index=0,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            completion_tokens=output,
            sampler_logprobs=[],
            completion_text=self._decode(output),
            policy_version=version,
            replica=-1,
        )

    def _correct(self, traj: Trajectory) -> bool:
        """Correct = every reward function gives a positive reward to the greedy completion."""
        try:
            return all(fn(traj) > 0 for fn in self._reward_fns)
        except Exception:  # a raising reward function scores the completion as wrong
            return False

    async def close(self) -> None:
        await self._engine.close()
