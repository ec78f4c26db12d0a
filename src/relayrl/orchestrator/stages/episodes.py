"""Multi-turn episodes: the policy and an environment (envs/base.py) take turns.

Job: turn a batch of `SampleRequest`s (groups of G samples) into groups of multi-turn
trajectories on one sampler replica. Every sample is one episode: the environment starts it from
the prompt; then, turn after turn, the replica samples every live episode's next action in one
`generate_turns` call (it keeps each episode's KV cache between calls and reads only the new
tokens), the environment steps every episode on that action (all at once: async steps awaited on
the event loop, sync ones in an environment call thread, each bounded by
`rollout.env_step_timeout_s`: envs/calls.py), and the observation it answers with is appended as
context (formatted and tokenized in the `env` thread, off the loop, as plain text unless the
environment sets `special_tokens_in_observations = True`). An episode ends when the environment
returns no observation, after `rollout.max_turns` actions, or when its next turn would not fit
in `rollout.max_total_tokens`.

Invariants:
- a trajectory's completion is its actions and observations in order; `loss_mask` is 1 exactly
  on action tokens (the policy's, with the sampler's log-probs) and 0 on observation tokens
  (context only, log-prob 0.0); each `Turn` records where its action lies, the version and
  replica that sampled it (the oldest that sampled a token of it: with rollout.interruptible a
  load can land inside a turn), and its reward part; the trajectory's `policy_version` is its
  oldest turn's, i.e. its oldest token's (staleness counts it), and when its tokens come from more
  than one version its `versions` lists (first completion token index, version) runs over the
  completion (an observation's tokens, context only, fall in the run of the action before them);
  `env_reward` is the sum of the parts;
- prompt + completion never exceeds `max_total_tokens`; a prompt that leaves no room for one
  action token is never sampled (dispatch filters it as too_long; the runner refuses it with
  `EpisodePromptTooLong`, a task error like the environment's, never a replica's fault); an
  observation is sized in characters before it is tokenized: one that cannot fit even at
  `max_token_chars` characters a token ends its episode ("length") untokenized;
- each turn's sampling call is traced on the replica's lane (`generate`, with `turn`) and each
  batch of environment steps on the `env` lane (`env_step`);
- an environment call that raises (anything, SystemExit included), returns a non-finite reward
  or runs past `rollout.env_step_timeout_s` fails its episode: the trajectory is `failed` with an
  `error` "environment: REASON: DETAIL (environment NAME, where)", is not scored and is counted
  by the score stage (`reward_failures["environment"]`), out of its group's baseline; an
  episode whose `start` failed still samples its first action (every trajectory has a turn and
  a version) and is never stepped. Under `rollout.strict_environment` such a call fails the run
  instead. A wrong type returned (start() without a `step`, a step that is no `EnvStep`, an
  observation that is not a str, a reward that is not a number), or more stuck sync calls than
  envs/calls.py tolerates, fail the run: `EnvironmentStepError` (a RunFailed: one line naming the
  environment, the prompt and the turn), the task's error, so no replica is retired for it;
- the replica is told to forget the episodes' caches once they are over.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from relayrl.backends.protocols import TextEncoder
from relayrl.envs.base import Environment, EnvStep, Episode
from relayrl.envs.calls import Call, CallFailed, EnvCalls, TooManyStuckCalls
from relayrl.errors import RunFailed
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import OrchestratorThreads
from relayrl.types import (
    Completion,
    Group,
    SampleRequest,
    Trajectory,
    TrajectoryStatus,
    Turn,
    TurnRequest,
    TurnResult,
    extend_version_runs,
    versions_used,
)

__all__ = [
    "ENV_FAILURE",
    "EnvironmentFailedWarning",
    "EnvironmentStepError",
    "EpisodePromptTooLong",
    "EpisodeRunner",
    "EpisodeSettings",
    "TurnFn",
    "env_failure_reason",
]

# samples one turn of each episode: (requests) -> results in the same order
TurnFn = Callable[[list[TurnRequest]], Awaitable[list[TurnResult]]]

#: where the ledger counts the episodes an environment failed (as `reward_failures`' functions
#: are counted), and the head of their trajectories' `error`: "environment: REASON: DETAIL (...)"
ENV_FAILURE = "environment"


def env_failure_reason(t: Trajectory) -> str | None:
    """Why `t`'s environment failed its episode (timeout, raised, non_finite), None if it did not."""
    if t.status is not TrajectoryStatus.FAILED or t.error is None or not t.error.startswith(ENV_FAILURE + ": "):
        return None
    return t.error[len(ENV_FAILURE) + 2 :].split(":", 1)[0]


class EnvironmentFailedWarning(RuntimeWarning):
    """The first environment call of a run that failed its episode (said once; the rest are counted)."""


class EnvironmentStepError(RunFailed, RuntimeError):
    """The environment fails the run: a method returned the wrong type (a programming error), a
    call failed under `rollout.strict_environment`, or too many calls are stuck past
    `rollout.env_step_timeout_s`. One line naming the environment, the prompt and the turn."""


class EpisodePromptTooLong(ValueError):
    """A prompt leaves no room for an action within `max_total_tokens` (dispatch filters such
    prompts: reaching the runner is a wiring error, named rather than sent to a sampler)."""


@dataclass(slots=True, frozen=True, kw_only=True)
class EpisodeSettings:
    max_turns: int
    max_total_tokens: int  # prompt + actions + observations
    max_new_tokens: int  # per turn
    observation_template: str = "{observation}"
    step_timeout_s: float = 0.0  # rollout.env_step_timeout_s: each start / step call (0: no bound)
    strict: bool = False  # rollout.strict_environment: a failed call fails the run, not its episode


@dataclass(slots=True)
class _Live:
    """One episode while it runs (`episode` None: its start failed, see `failure`)."""

    request: SampleRequest
    index: int
    key: str
    episode: Episode | None
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)  # (first completion token index, version) runs
    env_time: float = 0.0
    finish_reason: str = "stop"
    done: bool = False
    failure: str | None = None  # why the environment failed it: the trajectory's error (see env_failure_reason)

    @property
    def context(self) -> list[int]:
        return self.request.prompt_tokens + self.completion

    def where(self, turn: int) -> str:
        return f"prompt {self.request.prompt.prompt_id!r}, sample {self.index}, turn {turn}"


class EpisodeRunner:
    """Runs episodes of `env` (one per sample) on a turn function, tracing onto `tracer`.

    `encode` turns an observation (after `observation_template`) into token ids, as plain text
    unless the environment sets `special_tokens_in_observations = True`; it runs in the `env`
    thread of `threads`, one call at a time."""

    def __init__(
        self,
        env: Environment,
        env_name: str,
        encode: TextEncoder,
        settings: EpisodeSettings,
        threads: OrchestratorThreads,
        tracer: Tracer,
    ) -> None:
        self._env = env
        self._name = env_name
        self._encode = encode
        self._special = getattr(env, "special_tokens_in_observations", False) is True
        self._settings = settings
        self._threads = threads
        self._tracer = tracer
        self._calls = EnvCalls(settings.step_timeout_s)
        self._warned = False  # the first failed call is said on the console, once
        # characters the template adds around an observation (its `{observation}` field excluded)
        self._template_chars = len(settings.observation_template.format(observation=""))
        self._fields = len(settings.observation_template.format(observation="x")) - self._template_chars  # `{observation}`s

    @property
    def settings(self) -> EpisodeSettings:
        return self._settings

    @property
    def calls(self) -> EnvCalls:
        """The environment's calls (their abandoned threads)."""
        return self._calls

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
        live = [_Live(r, i, f"{r.group_id}/{i}", None) for r in requests for i in range(r.num_samples)]
        await self._start_all(live)
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
                used = versions_used(results)
                extra: dict[str, object] = {"versions": used} if len(used) > 1 else {}  # rollout.interruptible: a load landed meanwhile
                self._tracer.complete(
                    lane, "generate", start, self._tracer.now(), n=len(asks), version=version, turn=number, cached=cached, **extra
                )
            for e, result in zip(active, results, strict=True):
                self._add_action(e, result)
            stepping = []
            for e in active:
                if e.episode is None:  # its start failed: its first action gives it a turn and a version, no step
                    e.done = True
                else:
                    stepping.append(e)
            if not stepping:
                continue
            start = self._tracer.now()
            steps = await self._step_all(stepping, number)
            self._tracer.complete(env_lane, "env_step", start, self._tracer.now(), n=len(stepping), turn=number)
            await self._add_observations(stepping, steps, last=number == s.max_turns)
        if end is not None:
            await end([e.key for e in live])
        return self._groups(requests, live)

    # -- environment calls ----------------------------------------------------------------
    def _type_error(self, where: str, what: str) -> EnvironmentStepError:
        return EnvironmentStepError(f"environment {self._name!r}: {where}: {what}")

    def _fail(self, e: _Live, reason: str, detail: str, where: str) -> None:
        """End `e` as failed by its environment (counted, out of its group's baseline), or fail
        the run under `strict`."""
        if self._settings.strict:
            strict = "rollout.strict_environment = true"
            raise EnvironmentStepError(f"environment {self._name!r} failed in {where}: {reason}: {detail} ({strict})")
        e.failure = f"{ENV_FAILURE}: {reason}: {detail} (environment {self._name!r}, {where})"
        e.done = True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"environment {self._name!r} failed in {where}: {reason}: {detail}; the episode is failed and counted "
                "(summary.json reward_failures['environment']), the run goes on; further failures are only counted "
                "(rollout.strict_environment = true fails the run instead)",
                EnvironmentFailedWarning,
                stacklevel=2,
            )

    async def _run_calls(self, calls: Sequence[Call]) -> list[tuple[object, float]]:
        try:
            return await self._calls.run(calls)
        except TooManyStuckCalls as exc:
            raise EnvironmentStepError(
                f"environment {self._name!r}: {exc.where} ran past rollout.env_step_timeout_s = {self._calls.timeout_s:g} s and "
                f"{exc.running} of its calls are still running in abandoned threads (at most {self._calls.max_abandoned}): "
                "a sync method cannot be interrupted; fix the call that hangs, or make it `async def` (cancelled at the deadline)"
            ) from None

    async def _start_all(self, live: Sequence[_Live]) -> None:
        start = cast(Callable[[object], object], self._env.start)
        where = [f"start (prompt {e.request.prompt.prompt_id!r}, sample {e.index})" for e in live]
        done = await self._run_calls([(start, e.request.prompt, w) for e, w in zip(live, where)])
        for e, w, (value, seconds) in zip(live, where, done, strict=True):
            e.env_time += seconds
            if isinstance(value, CallFailed):
                self._fail(e, value.reason, value.detail, w)
                e.done = False  # its first action is still sampled (see run)
                continue
            if not callable(getattr(value, "step", None)):
                raise self._type_error(w, f"start() returned {_kind(value)}, not an episode (an object with a step(action) method)")
            e.episode = cast(Episode, value)

    async def _step_all(self, active: Sequence[_Live], number: int) -> list[EnvStep | None]:
        """Each episode's step on its last action (None: the episode failed, see `_fail`)."""
        calls: list[Call] = []
        for e in active:
            assert e.episode is not None
            calls.append((cast(Callable[[object], object], e.episode.step), e.turns[-1].action, f"step ({e.where(number)})"))
        steps: list[EnvStep | None] = []
        for e, (value, seconds) in zip(active, await self._run_calls(calls), strict=True):
            e.env_time += seconds
            where = f"step ({e.where(number)})"
            if isinstance(value, CallFailed):
                self._fail(e, value.reason, value.detail, where)
                steps.append(None)
                continue
            step = self._checked(value, where)
            if step is None:
                self._fail(e, "non_finite", f"reward {cast(EnvStep, value).reward!r}", where)
            steps.append(step)
        return steps

    def _checked(self, value: object, where: str) -> EnvStep | None:
        """`value` if it is a valid EnvStep (its reward as a float); None if its reward is a
        number but not a finite one (the episode fails, as a reward function's NaN does); a
        wrong type fails the run."""
        if not isinstance(value, EnvStep):
            raise self._type_error(where, f"step() returned {_kind(value)}, not an EnvStep")
        if value.observation is not None and not isinstance(value.observation, str):
            raise self._type_error(where, f"EnvStep.observation is {_kind(value.observation)}, not a str or None")
        reward = value.reward
        if isinstance(reward, (str, bytes)) or not isinstance(reward, numbers.Real):
            raise self._type_error(where, f"EnvStep.reward is {_kind(reward)}, not a number")
        as_float = float(reward)
        if not math.isfinite(as_float):
            return None
        return value if reward.__class__ is float else replace(value, reward=as_float)

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
        extend_version_runs(e.versions, c.versions, result.policy_version, begin)

    async def _add_observations(self, stepping: Sequence[_Live], steps: Sequence[EnvStep | None], last: bool) -> None:
        """Record each step's reward part and append its observation as context (unless the
        episode is over). Sizes are checked first: an observation whose characters cannot fit
        in the room left even at `max_token_chars` characters a token ends its episode
        ("length") without being formatted or tokenized; the others are formatted and tokenized
        in the `env` thread, off the loop, then checked exactly."""
        todo: list[tuple[_Live, str]] = []
        per_token = max(1, self._encode.max_token_chars)
        for e, step in zip(stepping, steps, strict=True):
            if step is None:  # failed: over already
                continue
            current = e.turns[-1]
            current.reward = step.reward
            current.tool_call = bool(step.tool_call)
            current.solved = bool(step.solved)
            if step.observation is None or last:
                e.done = True
                continue
            chars = self._template_chars + self._fields * len(step.observation)
            if -(-chars // per_token) > self._room(e):
                e.done = True
                e.finish_reason = "length"
                continue
            todo.append((e, step.observation))
        if not todo:
            return
        encoded = await self._threads.run("env", functools.partial(self._format_and_encode, [obs for _, obs in todo]))
        for (e, _), (text, tokens) in zip(todo, encoded, strict=True):
            if len(tokens) > self._room(e):
                e.done = True
                e.finish_reason = "length"
                continue
            e.turns[-1].observation = text
            e.completion.extend(tokens)
            e.logprobs.extend([0.0] * len(tokens))
            e.mask.extend([0] * len(tokens))
            e.text.append(text)

    def _room(self, e: _Live) -> int:
        """Observation tokens `e` has room for: the next turn needs at least one token after it."""
        return self._settings.max_total_tokens - len(e.context) - 1

    def _format_and_encode(self, observations: list[str]) -> list[tuple[str, list[int]]]:
        """Each observation in the template and its tokens (in the `env` thread)."""
        template, encode, special = self._settings.observation_template, self._encode, self._special
        out = []
        for observation in observations:
            text = template.format(observation=observation)
            out.append((text, encode(text, special_tokens=special)))
        return out

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
                    versions=e.versions if len(e.versions) > 1 else None,
                    loss_mask=e.mask,
                    env_reward=sum(t.reward for t in e.turns),
                    env_time=e.env_time,
                    status=TrajectoryStatus.OK if e.failure is None else TrajectoryStatus.FAILED,
                    error=e.failure,
                )
            )
        return [Group(group_id, trajectories) for group_id, trajectories in by_group.items()]


def _kind(value: object) -> str:
    """What a wrong return value is, for an error message: None, or its type's name."""
    return "None" if value is None else f"a {type(value).__name__}"
