"""Agent rollouts: each sample is one call of the user's agent, which talks to the policy through
the endpoint (agents/endpoint.py).

Job: `AgentRollout` is the sampler stage's rollout for `task.agent` runs. For a batch of requests
taken by one replica (so under the staleness window's credits, as every rollout), it opens one
endpoint episode per sample, calls `agent(ctx)` for each, all at once, each bounded by
`rollout.agent_timeout_s`, and routes every call of those episodes to that replica: its
`TurnBatcher` gathers the calls that arrive while the replica is busy into one `generate_turns`
call (each bounded by `rollout.generate_timeout_s`, traced on the replica's lane with the version
that sampled it, and `versions` when a load landed during it). A replica rolls out up to
`rollout.agent_batches_per_replica` batches at once (the sampler stage's `width`): they share its
one batcher (started with the first batch in flight, ended with the last), so one batch's HTTP
rounds and agent code run while another's calls are sampled, and calls of both go in one
sampling call when both are waiting. Once the replica is free and a call is waiting, it waits
for the rest of that call's batch's live episodes to call too (a batch whose episodes are all
elsewhere is not waited for), at most `GATHER_S` (a call's HTTP round trip lands its requests
one by one on the loop: without the wait the first of them went alone into a call of its own
and the rest into the next ones).
When every agent is done, the replica forgets the episodes' caches and each episode's
transcript becomes its training samples (agents/transcript.py): one trajectory per leaf
(its `policy_version` the oldest token's, its `versions` the runs when several versions sampled it),
all of the episode's reward: the agent's return value, or, when it returned None, the reward
functions' score of the trajectory's last completion (`completion_text`).

Invariants:
- an agent that raises (anything, SystemExit, GeneratorExit and a CancelledError of its own
  included, but KeyboardInterrupt), runs past `rollout.agent_timeout_s` (cancelled), returns
  something that is neither None nor a number within ±MAX_ABS_REWARD (1e6, as reward functions:
  rewards/registry.py; NaN, an infinity, 2**70 fail as `non_finite`; a coroutine is closed), or made no call,
  fails its sample: one trajectory `failed` with an `error` "agent: REASON: DETAIL (agent NAME,
  prompt ID, sample I)" (DETAIL one line of at most ~300 characters, with the episode's key and
  the run's secret redacted), not scored, counted by the
  score stage (`reward_failures["agent"]`), out of its group's baseline; the run goes on. Under
  `task.strict_agents` it fails the run (`AgentError`, one line), the task's error: no replica is
  retired for it. An agent that raises KeyboardInterrupt fails the run so (asyncio would let it
  break the event loop);
- each agent call runs in its own task (agents/calls.py, agents/tasks.py), on this event loop or,
  with `rollout.agent_processes`, in an agent process (agents/processes.py): when its episode
  ends (it returned, failed, timed out, or the rollout is cancelled) that task and every task it
  started are cancelled and waited for at most `CANCEL_GRACE_S`; one that ignores cancelling is
  left running (its sample failed as a timeout) rather than hang the rollout; an agent process
  that dies fails the samples it was running (`raised`) and is started again;
- a sampling call that raises or exceeds its bound fails the replica as a `generate` would (the
  sampler stage retires or restarts it and re-queues the requests of every batch in flight on
  it); the agents of every such batch are cancelled;
- the episodes are closed before their transcripts are read: nothing is recorded afterwards;
- once every agent is done, forgetting the caches cannot lose the episodes: a replica whose worker
  died meanwhile (`Sampler.restartable`, a Ray actor's process) had answered every call, so its
  samples stand, and its next sampling call fails and restarts it.
"""

from __future__ import annotations

import asyncio
import itertools
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relayrl.agents.calls import call_agent
from relayrl.agents.context import AgentContext, AgentFn
from relayrl.agents.transcript import Node
from relayrl.errors import RunFailed, first_error
from relayrl.orchestrator.deadlines import bounded
from relayrl.orchestrator.replicas import SamplerSlot, forget_episodes
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Group, SampleRequest, Trajectory, TrajectoryStatus, TurnRequest, TurnResult, versions_used

if TYPE_CHECKING:  # the endpoint's module imports FastAPI and uvicorn: only a task.agent run loads it
    from relayrl.agents.endpoint import AgentEndpoint
    from relayrl.agents.processes import AgentProcesses

__all__ = [
    "AGENT_FAILURE",
    "BLOCKED_WARN_S",
    "GATHER_S",
    "AgentBlockedWarning",
    "AgentError",
    "AgentFailedWarning",
    "AgentRollout",
    "AgentSettings",
    "TurnBatcher",
    "agent_failure_reason",
]

#: where the ledger counts the samples an agent failed, and the head of their trajectories' `error`
AGENT_FAILURE = "agent"


def agent_failure_reason(t: Trajectory) -> str | None:
    """Why `t`'s agent failed its sample (timeout, raised, non_finite, no_calls), None if it did not."""
    if t.status is not TrajectoryStatus.FAILED or t.error is None or not t.error.startswith(AGENT_FAILURE + ": "):
        return None
    return t.error[len(AGENT_FAILURE) + 2 :].split(":", 1)[0]


class AgentError(RunFailed):
    """An agent failed under `task.strict_agents`: one line naming the agent, the prompt and the sample."""


#: an agent step (code between two awaits) holding the event loop this long is warned about
BLOCKED_WARN_S = 1.0


#: how long a free replica waits, once an agent call is waiting, for the batch's other live episodes
#: to call too before it samples what it has (they are all waiting: at once)
GATHER_S = 0.05


class AgentBlockedWarning(RuntimeWarning):
    """The first agent of a run that held the event loop (BLOCKED_WARN_S or more without awaiting)."""


class AgentFailedWarning(RuntimeWarning):
    """The first agent of a run that failed its sample (said once; the rest are counted)."""


@dataclass(slots=True, frozen=True, kw_only=True)
class AgentSettings:
    name: str  # task.agent
    model: str  # ctx.model
    timeout_s: float = 0.0  # rollout.agent_timeout_s (0: none)
    strict: bool = False  # task.strict_agents
    generate_timeout_s: float = 0.0  # rollout.generate_timeout_s, on each batched sampling call
    gather_s: float = GATHER_S  # a free replica's wait for the other live episodes' calls


class TurnBatcher:
    """One replica's agent calls: those that arrive while it samples go in its next call (an
    episode chain at most once per call: the sampler keys its cache by it). Before a call it waits
    at most `gather_s` for every live episode (`expect`, until `finished`) to have a call waiting."""

    def __init__(self, slot: SamplerSlot, tracer: Tracer, timeout_s: float = 0.0, gather_s: float = GATHER_S) -> None:
        self._slot = slot
        self._tracer = tracer
        self._timeout_s = timeout_s
        self._gather_s = gather_s
        self._pending: list[tuple[TurnRequest, asyncio.Future[TurnResult], str]] = []
        self._running: list[tuple[TurnRequest, asyncio.Future[TurnResult], str]] = []
        self._live: dict[str, int] = {}  # episodes whose agent may still call -> their cohort
        self._wake = asyncio.Event()

    def expect(self, owner: str, cohort: int = 0) -> None:
        """Episode `owner`'s agent runs, in `cohort` (its request batch): its calls are worth
        waiting for once another episode of its cohort has called."""
        self._live[owner] = cohort

    def finished(self, owner: str) -> None:
        """Episode `owner`'s agent is done: it makes no more calls."""
        self._live.pop(owner, None)
        self._wake.set()

    def sampler_of(self, owner: str) -> Callable[[list[TurnRequest]], Awaitable[list[TurnResult]]]:
        """The `sample` function of episode `owner` (agents/endpoint.py's SampleFn)."""

        async def sample(asks: list[TurnRequest]) -> list[TurnResult]:
            return await self.sample(asks, owner)

        return sample

    async def sample(self, asks: list[TurnRequest], owner: str = "") -> list[TurnResult]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[TurnResult]] = [loop.create_future() for _ in asks]
        self._pending.extend((ask, future, owner) for ask, future in zip(asks, futures, strict=True))
        self._wake.set()
        return list(await asyncio.gather(*futures))

    async def run(self) -> None:
        """Sample what is pending, call after call, until cancelled; a call that fails fails its
        callers and raises (the replica's failure). Calls still waiting when it ends fail."""
        try:
            await self._serve()
        finally:
            for _, future, _ in self._pending + self._running:
                if not future.done():
                    future.set_exception(RuntimeError("the agents' rollout on this replica ended"))
                    future.exception()  # retrieved: its caller is an episode already over
            self._pending, self._running = [], []

    def _all_waiting(self) -> bool:
        """Every live episode of each cohort that has a call pending has one pending (a cohort
        whose episodes are all elsewhere, in their HTTP rounds or agent code, is not waited for)."""
        waiting = {owner for _, future, owner in self._pending if not future.done()}
        cohorts = {self._live[o] for o in waiting if o in self._live}
        return all(owner in waiting for owner, cohort in self._live.items() if cohort in cohorts)

    async def _gather(self) -> None:
        """Wait (at most gather_s) until every live episode of a cohort that called has a call pending."""
        if self._gather_s <= 0:
            return
        try:
            async with asyncio.timeout(self._gather_s):
                while not self._all_waiting():
                    self._wake.clear()
                    await self._wake.wait()
        except TimeoutError:
            pass

    async def _serve(self) -> None:
        slot, lane = self._slot, f"sampler/{self._slot.replica}"
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._gather()
                batch: list[tuple[TurnRequest, asyncio.Future[TurnResult], str]] = []
                later: list[tuple[TurnRequest, asyncio.Future[TurnResult], str]] = []
                seen: set[str] = set()
                for ask, future, owner in self._pending:
                    if future.done():  # its caller went away
                        continue
                    (later if ask.episode in seen else batch).append((ask, future, owner))
                    seen.add(ask.episode)
                self._pending = later
                if not batch:
                    continue
                self._running = batch
                start = self._tracer.now()
                what = f"sampler replica {slot.replica}: generate_turns (agents)"
                try:
                    results = await bounded(
                        slot.worker.generate_turns([a for a, _, _ in batch]), self._timeout_s, what, "rollout.generate_timeout_s"
                    )
                    if len(results) != len(batch):
                        raise RuntimeError(f"generate_turns returned {len(results)} results for {len(batch)} requests")
                except Exception as exc:
                    for _, future, _ in batch:
                        if not future.done():
                            future.set_exception(RuntimeError(f"{what} failed: {type(exc).__name__}: {exc}"))
                            future.exception()  # retrieved: the caller may be gone
                    raise
                version = min(r.policy_version for r in results)
                used = versions_used(results)
                extra: dict[str, object] = {"versions": used} if len(used) > 1 else {}  # rollout.interruptible: a load landed meanwhile
                self._tracer.complete(lane, "generate", start, self._tracer.now(), n=len(batch), version=version, agents=True, **extra)
                for (_, future, _), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
                self._running = []


@dataclass(slots=True)
class _ReplicaTurns:
    """One replica's batcher, shared by the request batches it rolls out at once, and its pump."""

    batcher: TurnBatcher
    pump: asyncio.Task[None]
    users: int = 0  # batches in flight


def _pump_error(pump: asyncio.Task[None]) -> BaseException:
    """Why a replica's pump ended (it ends only by failing, or cancelled with its last batch)."""
    exc = None if pump.cancelled() else pump.exception()
    return exc if exc is not None else RuntimeError("the replica's agent calls stopped being served")


@dataclass(slots=True)
class _Outcome:
    request: SampleRequest
    index: int
    leaves: list[Node]
    reward: float | None
    failure: tuple[str, str] | None  # (reason, detail)


class AgentRollout:
    """The rollout of `task.agent` runs (see the module); the program calls `start` before the
    first rollout and `stop` at the end. With `processes` (rollout.agent_processes) the agents run
    there (agents/processes.py), else on this event loop."""

    def __init__(
        self, agent: AgentFn, endpoint: AgentEndpoint, settings: AgentSettings, tracer: Tracer, processes: AgentProcesses | None = None
    ) -> None:
        self.endpoint = endpoint
        self._agent = agent
        self._settings = settings
        self._tracer = tracer
        self._processes = processes
        self._warned = False
        self._warned_blocked = False
        self._turns: dict[int, _ReplicaTurns] = {}  # replica -> its batcher, while it rolls out batches
        self._cohorts = itertools.count()

    async def start(self) -> None:
        """The endpoint listens, and the agent processes run."""
        await self.endpoint.start()
        if self._processes is not None:
            await self._processes.start()

    async def stop(self) -> None:
        """The agent processes end, then the endpoint."""
        try:
            if self._processes is not None:
                await self._processes.stop()
        finally:
            await self.endpoint.stop()

    async def __call__(self, slot: SamplerSlot, requests: list[SampleRequest]) -> list[Group]:
        turns = self._turns.get(slot.replica)
        if turns is None:  # the first batch in flight on this replica: its batcher starts
            batcher = TurnBatcher(slot, self._tracer, self._settings.generate_timeout_s, self._settings.gather_s)
            turns = _ReplicaTurns(batcher, asyncio.create_task(batcher.run(), name=f"agents/{slot.replica}/turns"))
            self._turns[slot.replica] = turns
        turns.users += 1
        cohort = next(self._cohorts)
        owners = [f"{r.group_id}/{i}" for r in requests for i in range(r.num_samples)]
        for owner in owners:
            turns.batcher.expect(owner, cohort)  # before any agent runs: the first call waits for the others
        keys: list[str] = []
        episodes = asyncio.create_task(self._episodes(turns.batcher, requests, keys), name=f"agents/{slot.replica}/batch{cohort}")
        try:
            await asyncio.wait([episodes, turns.pump], return_when=asyncio.FIRST_COMPLETED)
            if not episodes.done():  # the replica's sampling failed: its error is the batch's
                episodes.cancel()
                await asyncio.wait([episodes])
                raise _pump_error(turns.pump)
            outcomes = episodes.result()
        finally:
            if not episodes.done():  # cancelled
                episodes.cancel()
                await asyncio.wait([episodes])
            for owner in owners:  # an episode cancelled before it started never closed itself
                turns.batcher.finished(owner)
            turns.users -= 1
            if turns.users == 0:  # the last batch in flight on this replica: its batcher ends
                del self._turns[slot.replica]
                turns.pump.cancel()
                await asyncio.wait([turns.pump])
                if not turns.pump.cancelled():
                    turns.pump.exception()  # retrieved: raised by every batch it failed
        await forget_episodes(slot.worker, keys)
        version = slot.version
        by_group: dict[int, list[Trajectory]] = {r.group_id: [] for r in requests}
        for o in outcomes:
            by_group[o.request.group_id].extend(self._trajectories(o, slot.replica, version))
        return [Group(group_id, trajectories) for group_id, trajectories in by_group.items()]

    async def _episodes(self, batcher: TurnBatcher, requests: list[SampleRequest], keys: list[str]) -> list[_Outcome]:
        """Every sample's episode of `requests`, at once."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._episode(batcher, r, i, keys), name=f"agent/{r.group_id}/{i}")
                    for r in requests
                    for i in range(r.num_samples)
                ]
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return [t.result() for t in tasks]

    async def _episode(self, batcher: TurnBatcher, request: SampleRequest, index: int, keys: list[str]) -> _Outcome:
        s = self._settings
        owner = f"{request.group_id}/{index}"
        episode = self.endpoint.open(owner, request.prompt, batcher.sampler_of(owner), f"{request.seed_key}\x00{index}", s.timeout_s)
        ctx = AgentContext(episode.base_url, episode.api_key, s.model, request.prompt, index)

        def closing() -> None:  # nothing of the episode is recorded after this
            batcher.finished(owner)
            self.endpoint.close(episode)
            keys.extend(episode.sampler_key(c) for c in episode.transcript.chains)

        if self._processes is None:
            name = f"agent/{request.group_id}/{index}/call"
            outcome = await call_agent(self._agent, ctx, s.timeout_s, name, closing, (self.endpoint.token,))
        else:
            try:
                outcome = await self._processes.call(ctx, s.timeout_s)
            finally:
                closing()
        if outcome.interrupted:  # asyncio would let it break the loop: the run stops, in one line
            raise AgentError(f"{self._where(request, index)}: raised KeyboardInterrupt: the run stops")
        self._blocked(request, index, outcome.longest_step_s)
        failure = outcome.failure  # (its detail redacted where it was made: an agent process never holds the run's secret)
        leaves = episode.transcript.leaves
        if failure is None and not leaves:
            failure = ("no_calls", "the agent made no call through ctx.base_url")
        if failure is not None:
            self._fail(request, index, *failure)
        return _Outcome(request, index, leaves, outcome.reward, failure)

    def _blocked(self, request: SampleRequest, index: int, seconds: float) -> None:
        """The agent's longest step held the event loop `seconds`: said once a run past BLOCKED_WARN_S."""
        if seconds < BLOCKED_WARN_S or self._warned_blocked:
            return
        self._warned_blocked = True
        stopped = "every other agent of its process" if self._processes is not None else "the endpoint, every other agent and the run"
        warnings.warn(
            f"{self._where(request, index)} held the event loop for {seconds:.1f} s without awaiting (time.sleep, blocking "
            f"I/O or CPU work in async code): {stopped} stop meanwhile, and other agents' "
            "rollout.agent_timeout_s fire late; use await asyncio.sleep / asyncio.to_thread (said once)",
            AgentBlockedWarning,
            stacklevel=2,
        )

    def _where(self, request: SampleRequest, index: int) -> str:
        return f"agent {self._settings.name!r}, prompt {request.prompt.prompt_id!r}, sample {index}"

    def _fail(self, request: SampleRequest, index: int, reason: str, detail: str) -> None:
        if self._settings.strict:
            raise AgentError(f"{self._where(request, index)}: {reason}: {detail} (task.strict_agents = true)")
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self._where(request, index)} failed: {reason}: {detail}; the sample is failed and counted "
                "(summary.json reward_failures['agent']), the run goes on; further failures are only counted "
                "(task.strict_agents = true fails the run instead)",
                AgentFailedWarning,
                stacklevel=2,
            )

    def _trajectories(self, o: _Outcome, replica: int, version: int) -> list[Trajectory]:
        r = o.request
        if o.failure is not None:
            versions = [t.policy_version for leaf in o.leaves for t in leaf.turns]
            return [
                Trajectory(
                    group_id=r.group_id,
                    sample_index=o.index,
                    prompt=r.prompt,
                    prompt_tokens=r.prompt_tokens,
                    completion_tokens=[],
                    sampler_logprobs=[],
                    completion_text="",
                    policy_version=min(versions, default=version),
                    replica=replica,
                    status=TrajectoryStatus.FAILED,
                    error=f"{AGENT_FAILURE}: {o.failure[0]}: {o.failure[1]} ({self._where(r, o.index)})",
                    loss_mask=[],
                )
            ]
        out = []
        for leaf in o.leaves:
            prompt = leaf.tokens[: leaf.prompt_len]
            out.append(
                Trajectory(
                    group_id=r.group_id,
                    sample_index=o.index,
                    prompt=r.prompt,
                    prompt_tokens=r.prompt_tokens if prompt == r.prompt_tokens else prompt,  # a group's shared prompt: one list
                    completion_tokens=leaf.tokens[leaf.prompt_len :],
                    sampler_logprobs=leaf.logprobs,
                    completion_text=leaf.answer,
                    policy_version=min(t.policy_version for t in leaf.turns),
                    replica=leaf.turns[0].replica,
                    finish_reason=leaf.finish_reason,
                    turns=leaf.turns,
                    versions=leaf.versions if len(leaf.versions) > 1 else None,
                    loss_mask=leaf.mask,
                    agent_reward=o.reward,
                )
            )
        return out
