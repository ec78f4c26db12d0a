"""Held-out evaluation: greedy accuracy and mean reward of a given policy version (multi-turn
tasks: greedy episodes with the environment).

Two figures, kept apart. `accuracy` is the task's own correctness check (tasks/correctness.py:
the parsed answer equals the prompt's answer; reasoning-gym: the dataset's scorer gives full
credit; multi-turn: an action solved the episode within the turn limit), whatever reward functions
the run trains on, so a partial-credit reward cannot make a wrong answer count as right.
`reward_mean` is the mean of the completions' rewards under the run's reward functions, computed
as for training rollouts (weighted, clipped; a failed call makes the reward 0, and is not counted
in the ledger).

In a run both go through scorers (given at construction): the run's for the rewards (user
functions in their worker processes, async ones on the loop, each bounded by its timeout) and one
holding the correctness check, whose failed call makes the completion wrong. Without them the
functions are called here.

The evaluator is the orchestrator's (orchestrator/parts.py builds it from the backend's greedy
engine, the run's scorers and, for multi-turn tasks, its episode runner); the engine never knows
who drives it.

Invariant: an evaluation reports the version whose weights it measured (the engine loads those
weights first; the evaluator remembers the version it last loaded, and does not ask the engine),
on the same fixed prompts every time, so its figures are comparable across a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from relayrl.rewards.registry import RewardFunction, exact_match
from relayrl.tasks.correctness import answer_match, is_correct
from relayrl.types import Completion, EvalResult, Prompt, SampleRequest, Trajectory, TrajectoryStatus, TurnRequest, TurnResult, Weights

if TYPE_CHECKING:
    from relayrl.backends.protocols import GreedyEngine
    from relayrl.orchestrator.stages.episodes import EpisodeRunner, TurnFn
    from relayrl.rewards.scoring import Scorer


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
        *,
        scorer: Scorer | None = None,
        episodes: EpisodeRunner | None = None,
        correctness: Scorer | RewardFunction = answer_match,
    ) -> None:
        """`version`: the policy version the engine holds when built. `scorer`: reward completions
        with the run's scorer (and its reward functions) instead of calling `reward_fns` here
        (their sum). `correctness`: the task's correctness check (tasks/correctness.py), a scorer
        holding it or the function itself (called here). `episodes`: evaluate greedy multi-turn
        episodes of that runner's environment (a prompt counts as correct when an action solved
        it within the turn limit)."""
        if not prompts:
            raise ValueError("held-out evaluation needs at least one prompt (task.heldout_size)")
        self._engine = engine
        self._prompts = list(prompts)
        self._tokens = [tokenize(p.text) for p in prompts]
        self._decode = decode
        self._max_new_tokens = max_new_tokens
        self._reward_fns = list(reward_fns)
        self._version = version  # what the engine holds: the version last loaded into it
        self._scorer = scorer
        self._episodes = episodes
        self._correctness = correctness

    async def evaluate(self, weights: Weights | None) -> EvalResult:
        """Accuracy and mean reward of `weights` (None: of the weights the engine holds now)."""
        start = time.perf_counter()
        if weights is not None:
            await self._engine.load_weights(weights)
            self._version = weights.version
        version = self._version
        if self._episodes is not None:
            return await self._evaluate_episodes(self._episodes, version, start)
        outputs = await self._engine.greedy(self._tokens, self._max_new_tokens)
        trajs = [self._trajectory(p, toks, out, version) for p, toks, out in zip(self._prompts, self._tokens, outputs, strict=True)]
        correct = await self._correct(trajs)
        rewards = await self._rewards(trajs)
        n = len(self._prompts)
        return EvalResult(version, sum(correct) / n, n, time.perf_counter() - start, reward_mean=sum(rewards) / n)

    async def _evaluate_episodes(self, runner: EpisodeRunner, version: int, start: float) -> EvalResult:
        requests = [SampleRequest(-1 - i, p, toks, 1) for i, (p, toks) in enumerate(zip(self._prompts, self._tokens, strict=True))]
        groups = await runner.run(requests, self._greedy_turn(version), env_lane="eval.env")
        episodes = [g.trajectories[0] for g in groups]
        # an episode its environment failed gets reward 0, as a failed reward call does (never scored)
        scored = [e for e in episodes if e.status is not TrajectoryStatus.FAILED]
        rewards = await self._rewards(scored)
        n = len(episodes)
        return EvalResult(
            version,
            sum(any(t.solved for t in e.turns) for e in episodes) / n,
            n,
            time.perf_counter() - start,
            first_turn_accuracy=sum(e.turns[0].solved for e in episodes) / n,
            mean_turns=sum(len(e.turns) for e in episodes) / n,
            reward_mean=sum(rewards) / n,
        )

    async def _correct(self, trajs: list[Trajectory]) -> list[bool]:
        """Whether each completion passes the task's correctness check (a failed check: no)."""
        check = self._correctness
        if not callable(check):
            return [is_correct(row[0]) for row in await check.outcomes(trajs)]
        out = []
        for t in trajs:
            try:
                out.append(is_correct(float(check(t))))
            except Exception:  # a raising check counts the completion as wrong
                out.append(False)
        return out

    async def _rewards(self, trajs: list[Trajectory]) -> list[float]:
        """Each completion's reward as training would get it (a failed call: 0)."""
        if self._scorer is not None:
            await self._scorer.score(trajs)  # sets each one's reward (0.0 when a call failed); the ledger never sees them
            return [t.reward for t in trajs]
        out = []
        for t in trajs:
            try:
                out.append(sum(float(fn(t)) for fn in self._reward_fns))
            except Exception:  # a raising reward function gives the completion no reward
                out.append(0.0)
        return out

    def _greedy_turn(self, version: int) -> TurnFn:
        """One greedy turn per episode on the engine (re-reading each context: evaluation keeps
        no caches); each action is cut at its own token limit."""

        async def turn(requests: list[TurnRequest]) -> list[TurnResult]:
            longest = max(r.max_new_tokens for r in requests)
            outputs = await self._engine.greedy([r.context for r in requests], longest)
            results = []
            for r, out in zip(requests, outputs, strict=True):
                tokens = out[: r.max_new_tokens]
                finish = "length" if len(tokens) == r.max_new_tokens else "stop"
                results.append(TurnResult(r.episode, Completion(tokens, [0.0] * len(tokens), self._decode(tokens), finish), version, -1))
            return results

        return turn

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

    async def close(self) -> None:
        await self._engine.close()
