"""Multi-turn episodes: the policy and an environment (envs/base.py) take turns.

Job: turn a batch of `SampleRequest`s (groups of G samples) into groups of multi-turn
trajectories on one sampler replica. Every sample is one episode: the environment starts it from
the prompt; then, turn after turn, the replica samples every live episode's next action in one
`generate_turns` call (it keeps each episode's KV cache between calls and reads only the new
tokens), the environment steps every episode on that action (all at once: async steps awaited on
the event loop, sync ones run in the `env` worker thread), and the observation it answers with is
appended as context. An episode ends when the environment returns no observation, after
`rollout.max_turns` actions, or when its next turn would not fit in `rollout.max_total_tokens`.

Invariants:
- a trajectory's completion is its actions and observations in order; `loss_mask` is 1 exactly
  on action tokens (the policy's, with the sampler's log-probs) and 0 on observation tokens
  (context only, log-prob 0.0); each `Turn` records where its action lies, the version and
  replica that sampled it, and its reward part; the trajectory's `policy_version` is its oldest
  turn's (staleness counts the oldest turn); `env_reward` is the sum of the parts;
- prompt + completion never exceeds `max_total_tokens`; a prompt that leaves no room for one
  action token is never sampled (dispatch filters it as too_long; the runner refuses it with
  `EpisodePromptTooLong`, a task error like the environment's, never a replica's fault);
- each turn's sampling call is traced on the replica's lane (`generate`, with `turn`) and each
  batch of environment steps on the `env` lane (`env_step`);
- an environment that raises fails the run (`EnvironmentStepError`, naming the environment, the
  prompt and the turn): it is the task's error, not the sampler's, so no replica is retired for it;
- the replica is told to forget the episodes' caches once they are over.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from relayrl.envs.base import Environment, EnvStep, Episode
from relayrl.orchestrator.taskgroups import first_error
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import OrchestratorThreads
from relayrl.types import Completion, Group, Prompt, SampleRequest, Trajectory, Turn, TurnRequest, TurnResult

__all__ = ["EnvironmentStepError", "EpisodePromptTooLong", "EpisodeRunner", "EpisodeSettings", "TurnFn"]

# samples one turn of each episode: (requests) -> results in the same order
TurnFn = Callable[[list[TurnRequest]], Awaitable[list[TurnResult]]]


class EnvironmentStepError(RuntimeError):
    """The environment raised while starting or stepping an episode."""


class EpisodePromptTooLong(ValueError):
    """A prompt leaves no room for an action within `max_total_tokens` (dispatch filters such
    prompts: reaching the runner is a wiring error, named rather than sent to a sampler)."""


@dataclass(slots=True, frozen=True, kw_only=True)
class EpisodeSettings:
    max_turns: int
    max_total_tokens: int  # prompt + actions + observations
    max_new_tokens: int  # per turn
    observation_template: str = "{observation}"


@dataclass(slots=True)
class _Live:
    """One episode while it runs."""

    request: SampleRequest
    index: int
    key: str
    episode: Episode
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    env_time: float = 0.0
    finish_reason: str = "stop"
    done: bool = False

    @property
    def context(self) -> list[int]:
        return self.request.prompt_tokens + self.completion


class EpisodeRunner:
    """Runs episodes of `env` (one per sample) on a turn function, tracing onto `tracer`.

    `encode` turns an observation (after `observation_template`) into token ids, without special
    tokens."""

    def __init__(
        self,
        env: Environment,
        env_name: str,
        encode: Callable[[str], list[int]],
        settings: EpisodeSettings,
        threads: OrchestratorThreads,
        tracer: Tracer,
    ) -> None:
        self._env = env
        self._name = env_name
        self._encode = encode
        self._settings = settings
        self._threads = threads
        self._tracer = tracer

    @property
    def settings(self) -> EpisodeSettings:
        return self._settings

    async def run(
        self,
        requests: Sequence[SampleRequest],
        turn: TurnFn,
        *,
        lane: str | None = None,
        end: Callable[[list[str]], Awaitable[None]] | None = None,
        env_lane: str = "env",
    ) -> list[Group]:
        """Every request's G episodes, sampled by `turn` (traced on `lane` when given; the
        environment's steps on `env_lane`); `end` (if any) is told the episode names once they
        are over."""
        s = self._settings
        for r in requests:
            if len(r.prompt_tokens) >= s.max_total_tokens:
                raise EpisodePromptTooLong(
                    f"prompt {r.prompt.prompt_id!r} has {len(r.prompt_tokens)} tokens: no room for an action within "
                    f"rollout.max_total_tokens = {s.max_total_tokens} (such prompts are filtered at dispatch as too_long)"
                )
        starts = [(r, i) for r in requests for i in range(r.num_samples)]
        episodes = await self._start_all([r.prompt for r, _ in starts])
        live = [_Live(r, i, f"{r.group_id}/{i}", e) for (r, i), e in zip(starts, episodes, strict=True)]
        for number in range(1, s.max_turns + 1):
            active = [e for e in live if not e.done]
            if not active:
                break
            asks = [
                TurnRequest(
                    episode=e.key,
                    context=e.context,
                    rng_key=f"{e.request.seed_key}\x00{e.index}\x00{number}",
                    max_new_tokens=min(s.max_new_tokens, s.max_total_tokens - len(e.context)),
                    prompt=e.request.prompt,
                )
                for e in active
            ]
            start = self._tracer.now()
            results = await turn(asks)
            if len(results) != len(asks):
                raise RuntimeError(f"generate_turns returned {len(results)} results for {len(asks)} requests")
            if lane is not None:
                version = min(r.policy_version for r in results)
                cached = sum(r.cached_tokens for r in results)
                self._tracer.complete(lane, "generate", start, self._tracer.now(), n=len(asks), version=version, turn=number, cached=cached)
            for e, result in zip(active, results, strict=True):
                self._add_action(e, result)
            start = self._tracer.now()
            steps = await self._step_all(active, number)
            self._tracer.complete(env_lane, "env_step", start, self._tracer.now(), n=len(active), turn=number)
            for e, step in zip(active, steps, strict=True):
                self._add_observation(e, step, last=number == s.max_turns)
        if end is not None:
            await end([e.key for e in live])
        return self._groups(requests, live)

    # -- environment calls ----------------------------------------------------------------
    async def _calls(self, calls: Sequence[tuple[Callable[[object], object], object, str]]) -> list[tuple[object, float]]:
        """`method(arg)` for each `(method, arg, where)`, with the seconds each took: coroutine
        functions awaited on the loop, all at once; plain ones in one call of the env worker
        thread. The first error, as an `EnvironmentStepError` naming its `where`, cancels the rest."""
        out: list[tuple[object, float]] = [(None, 0.0)] * len(calls)
        plain = [i for i, (method, _, _) in enumerate(calls) if not inspect.iscoroutinefunction(method)]

        def run_plain() -> None:
            for i in plain:
                method, arg, where = calls[i]
                began = time.perf_counter()
                try:
                    out[i] = (method(arg), time.perf_counter() - began)
                except Exception as exc:
                    raise self._error(exc, where) from exc

        async def run_async(i: int) -> None:
            method, arg, where = calls[i]
            began = time.perf_counter()
            try:
                out[i] = (await cast(Awaitable[object], method(arg)), time.perf_counter() - began)
            except Exception as exc:
                raise self._error(exc, where) from exc

        try:
            async with asyncio.TaskGroup() as tg:
                for i in sorted(set(range(len(calls))) - set(plain)):
                    tg.create_task(run_async(i))
                if plain:
                    await self._threads.run("env", run_plain)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return out

    def _error(self, exc: Exception, where: str) -> EnvironmentStepError:
        return EnvironmentStepError(f"environment {self._name!r} raised in {where}: {type(exc).__name__}: {exc}")

    async def _start_all(self, prompts: Sequence[Prompt]) -> list[Episode]:
        start = cast(Callable[[object], object], self._env.start)
        done = await self._calls([(start, p, f"start (prompt {p.prompt_id!r})") for p in prompts])
        return [cast(Episode, value) for value, _ in done]

    async def _step_all(self, active: Sequence[_Live], number: int) -> list[EnvStep]:
        where = [f"prompt {e.request.prompt.prompt_id!r}, sample {e.index}, turn {number}" for e in active]
        calls = [(cast(Callable[[object], object], e.episode.step), e.turns[-1].action, f"step ({w})") for e, w in zip(active, where)]
        steps: list[EnvStep] = []
        for e, w, (value, seconds) in zip(active, where, await self._calls(calls), strict=True):
            if not isinstance(value, EnvStep):
                raise EnvironmentStepError(f"environment {self._name!r}: step returned {type(value).__name__}, not an EnvStep ({w})")
            e.env_time += seconds
            steps.append(value)
        return steps

    # -- recording ------------------------------------------------------------------------
    def _add_action(self, e: _Live, result: TurnResult) -> None:
        c: Completion = result.completion
        begin = len(e.completion)
        e.completion.extend(c.tokens)
        e.logprobs.extend(c.logprobs)
        e.mask.extend([1] * len(c.tokens))
        e.text.append(c.text)
        e.finish_reason = c.finish_reason
        e.turns.append(Turn(begin, len(e.completion), result.policy_version, result.replica, c.text))

    def _add_observation(self, e: _Live, step: EnvStep, last: bool) -> None:
        current = e.turns[-1]
        current.reward = float(step.reward)
        current.tool_call = step.tool_call
        current.solved = step.solved
        if step.observation is None or last:
            e.done = True
            return
        text = self._settings.observation_template.format(observation=step.observation)
        tokens = self._encode(text)
        # the next turn needs room for at least one token after the observation
        if len(e.context) + len(tokens) + 1 > self._settings.max_total_tokens:
            e.done = True
            e.finish_reason = "length"
            return
        current.observation = text
        e.completion.extend(tokens)
        e.logprobs.extend([0.0] * len(tokens))
        e.mask.extend([0] * len(tokens))
        e.text.append(text)

    def _groups(self, requests: Sequence[SampleRequest], live: list[_Live]) -> list[Group]:
        by_group: dict[int, list[Trajectory]] = {r.group_id: [] for r in requests}
        for e in live:
            by_group[e.request.group_id].append(
                Trajectory(
                    group_id=e.request.group_id,
                    sample_index=e.index,
                    prompt=e.request.prompt,
                    prompt_tokens=e.request.prompt_tokens,
                    completion_tokens=e.completion,
                    sampler_logprobs=e.logprobs,
                    completion_text="".join(e.text),
                    policy_version=min(t.policy_version for t in e.turns),
                    replica=e.turns[0].replica,
                    finish_reason=e.finish_reason,
                    turns=e.turns,
                    loss_mask=e.mask,
                    env_reward=sum(t.reward for t in e.turns),
                    env_time=e.env_time,
                )
            )
        return [Group(group_id, trajectories) for group_id, trajectories in by_group.items()]
