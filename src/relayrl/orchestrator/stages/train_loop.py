"""The train loop: groups → packed micro-batches → train_step … optim_step, and the step boundary.

Steps are numbered from 1: step N trains from policy version N − 1 and its commit makes version
N (the number every file, message and trace event uses). Per step N: take `groups_per_step`
groups (filtering too-stale ones), finish the advantages that need the whole step (batch std
scaling, REINFORCE++), plan the packing (one plan per minibatch with `minibatches_per_step` > 1:
the trainer makes its several updates inside the step's one optim_step), pack each micro-batch in the packing thread
while the previous one trains, then commit. The end-of-step work of N (metrics fetch, reduction,
logging, callbacks, memory release) is deferred:

- fetch(N):        starts at commit(N),           finishes before optim_step(N+1)   (rules 1, 2)
- bookkeeping(N):  starts at first_train(N+1)     finishes before optim_step(N+1)   (rules 3, 4)
                   and after fetch(N) landed, runs in the bookkeeping thread
- N+1's groups are taken and its first micro-batch packed as soon as they are there, from the
  moment N's final micro-batch is issued: while it trains if the groups arrive in time (rule 9)
- queue ahead: when the trainer can queue (`Trainer.queue_ahead`: the Ray trainer) and
  N+1's preparation has started, optim_step(N) goes out as `optim_step_ahead`, which asks for
  mb0(N+1) once the update is sent (N's micro-batches have all ended by then) and, when it is
  packed, sends it right behind: the trainer starts it the moment the update ends. At
  step N+1 the loop does not send it again: it issues the queued call (its trainer-lane span,
  `ahead: true`, starts there, after commit(N); `boundary_gap_sec` is measured to that point) and
  reaches first_train(N+1) at once, so the points stay in their order.

With `overlap_bookkeeping = false` the seed's inline behaviour is kept as the baseline: fetch and
bookkeeping run right after the commit, on the event loop, and N+1 is packed only after them
(so nothing is queued ahead).

Invariant: optim_step(N+1) is never issued before fetch(N) and bookkeeping(N) finished; the run
does not return before every deferred job finished; every task this loop starts belongs to the
run's TaskGroup. The loop is a step record's one writer until its bookkeeping (which may only
release the record's big lists once logged): its own figures, what the run measured outside it
(`StepHooks.commit_figures`, written at the commit, before `on_commit` reads the record) and,
after the commit, the trainer's metrics its fetch brings. A step's record lives until its
bookkeeping is done; the loop itself keeps only the last one (`records`), so its memory does not
grow with the number of steps. A micro-batch is sent to the trainer once: queued behind
optim_step(N), or issued at its turn, never both.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from relayrl.algorithms.advantages import AdvantageKind
from relayrl.backends.protocols import Collator, Trainer
from relayrl.orchestrator.deferred import RUN_END, DeferredJobs, before_optim, commit, first_train
from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.stages.advantage import finish_step_advantages, scored, trainable, truncated
from relayrl.orchestrator.window import DispatchWindow
from relayrl.packing import build_microbatch, plan
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import OrchestratorThreads
from relayrl.types import FilterReason, Group, MicroBatch, PackPlan, StepRecord, TrainBatch, Trajectory, TrajectoryStatus


class GroupTaker:
    """Takes each step's groups from the train queue; drops those too stale for that step."""

    def __init__(
        self,
        queue: asyncio.Queue[Group],
        ledger: Ledger,
        window: DispatchWindow,
        tracer: Tracer,
        *,
        groups_per_step: int,
        max_staleness: int,
    ) -> None:
        self._queue = queue
        self._gps = groups_per_step
        self._max_staleness = max_staleness
        self._ledger = ledger
        self._window = window
        self._tracer = tracer
        self._held: list[Group] = []  # admitted for the step being taken, not yet handed over

    def _admit(self, group: Group, step: int) -> None:
        if step - 1 - group.min_version > self._max_staleness:  # step N trains from version N - 1
            self._ledger.filtered(group, FilterReason.STALE, self._window)
        else:
            self._held.append(group)

    def _hand_over(self) -> list[Group]:
        groups, self._held = self._held[: self._gps], self._held[self._gps :]
        return groups

    async def take(self, step: int) -> tuple[list[Group], float]:
        """Step's groups, waiting for them; returns the groups and the time spent waiting."""
        while len(self._held) < self._gps and not self._queue.empty():
            self._admit(self._queue.get_nowait(), step)
        if len(self._held) >= self._gps:
            return self._hand_over(), 0.0
        start = self._tracer.now()
        while len(self._held) < self._gps:
            self._admit(await self._queue.get(), step)
        end = self._tracer.now()
        self._tracer.complete("orchestrator", "wait_data", start, end, step=step)
        return self._hand_over(), end - start


@dataclass(slots=True, frozen=True, kw_only=True)
class PackingSpec:
    """How a step's trajectories are packed into micro-batches (packing.plan)."""

    row_tokens: int
    rows_per_microbatch: int
    share_prompt: bool
    minibatches: int = 1  # train.minibatches_per_step: a micro-batch never mixes two
    mask_truncated: bool = False  # algorithm.mask_truncated: truncated trajectories are not packed


@dataclass(slots=True, frozen=True, kw_only=True)
class CommitFigures:
    """What the run measured for a step outside the train loop, taken at its commit: the time
    its weight syncs took since the last commit, and the event loop's worst lag."""

    weight_sync_time: float
    loop_lag_max_ms: float
    sampler_gpu_mem_peak_gb: float | None = None  # the largest sampler replica's, where measured


@dataclass(slots=True, frozen=True, kw_only=True)
class StepHooks:
    """What the run does at a step's boundaries, in this order: `on_step_begin(step)` once its
    groups are taken; right after optim_step returned (cheap, on the event loop),
    `commit_figures()` the figures the loop writes into the step's record, then
    `on_commit(record)` (schedules what is due; reads the record, never writes it);
    `bookkeep(record)` the step's end-of-step work (synchronous, GIL-bound: in the bookkeeping
    thread when overlapped; it may release the record's big lists once logged);
    `after_bookkeeping(record)` once the step's logs are written (e.g. a checkpoint, which must
    not precede them)."""

    on_step_begin: Callable[[int], None]
    commit_figures: Callable[[], CommitFigures]
    on_commit: Callable[[StepRecord], None]
    bookkeep: Callable[[StepRecord], None]
    after_bookkeeping: Callable[[StepRecord], Awaitable[None]] | None = None


@dataclass(slots=True)
class _Prepared:
    """A step whose groups are taken and whose first micro-batch is being packed."""

    step: int
    groups: list[Group]
    trajectories: list[Trajectory]
    plan: PackPlan
    first_pack: asyncio.Task[tuple[MicroBatch, float]]
    waited: float  # trainer-exposed wait for the groups
    ready_at: float  # when the groups were all there


class TrainLoop:
    def __init__(
        self,
        *,
        start_step: int = 0,  # steps committed before (a resume's checkpoint): the first step trained is start_step + 1
        steps: int,
        trainer: Trainer,
        collator: Collator,
        taker: GroupTaker,
        jobs: DeferredJobs,
        task_group: asyncio.TaskGroup,
        threads: OrchestratorThreads,
        tracer: Tracer,
        ledger: Ledger,
        overlap: bool,
        packing: PackingSpec,
        hooks: StepHooks,
        step_advantage: AdvantageKind | None = None,  # finished over each step's groups when taken (advantage.py)
        token_whiten: bool = False,  # reinforce_pp's whitening over the step's tokens (algorithm.whiten)
    ) -> None:
        self._start_step = start_step
        self._step_advantage = step_advantage
        self._token_whiten = token_whiten
        self._steps = steps
        self._trainer = trainer
        self._collator = collator
        self._taker = taker
        self._jobs = jobs
        self._tg = task_group
        self._threads = threads
        self._tracer = tracer
        self._ledger = ledger
        self._overlap = overlap
        self._packing = packing
        self._on_step_begin = hooks.on_step_begin
        self._commit_figures = hooks.commit_figures  # the run's figures for the record (sync times, lag)
        self._on_commit = hooks.on_commit  # reads the committed record, schedules what is due
        self._bookkeep = hooks.bookkeep  # the step's end-of-step work (synchronous, GIL-bound)
        self._after = hooks.after_bookkeeping  # e.g. a checkpoint, which must not precede the step's logs
        # the last committed step's record (metrics.jsonl has every step's figures)
        self.records: deque[StepRecord] = deque(maxlen=1)

    # -- packing ---------------------------------------------------------------------------
    async def _pack(self, step: int, index: int, trajectories: Sequence[Trajectory], pack_plan: PackPlan) -> tuple[MicroBatch, float]:
        start = self._tracer.now()
        mb = build_microbatch(step, index, trajectories, pack_plan)
        mb.payload = await self._threads.run("pack", lambda: self._collator.collate(mb))
        end = self._tracer.now()
        self._tracer.complete("orchestrator", "pack", start, end, step=step, microbatch=index)
        return mb, end - start

    def _start_pack(
        self, step: int, index: int, trajectories: Sequence[Trajectory], pack_plan: PackPlan
    ) -> asyncio.Task[tuple[MicroBatch, float]]:
        return self._tg.create_task(self._pack(step, index, trajectories, pack_plan), name=f"pack:{step}:{index}")

    def _prepare(self, step: int, groups: list[Group], waited: float) -> _Prepared:
        ready_at = self._tracer.now()
        # a failed reward call trains nothing: its trajectory is logged, never packed (orchestrator/stages/advantage.py);
        # nor, under mask_truncated, does a truncated one
        if self._step_advantage is not None:  # advantages over the whole step (batch std scaling, REINFORCE++)
            finish_step_advantages(groups, kind=self._step_advantage, token_whiten=self._token_whiten)
        spec = self._packing
        if spec.mask_truncated:
            trajectories = trainable([t for g in groups for t in g.trajectories], mask_truncated=True)
        else:
            trajectories = [t for g in groups for t in g.trajectories if t.status is not TrajectoryStatus.FAILED]
        pack_plan = plan(trajectories, spec.row_tokens, spec.rows_per_microbatch, spec.share_prompt, spec.minibatches)
        first = self._start_pack(step, 0, trajectories, pack_plan)
        return _Prepared(step, groups, trajectories, pack_plan, first, waited, ready_at)

    async def _take_and_prepare(self, step: int) -> _Prepared:
        """Wait for `step`'s groups and start packing its first micro-batch. Its `waited` is set
        by the loop, which knows when the trainer went idle (only that part is exposed)."""
        groups, _ = await self._taker.take(step)
        return self._prepare(step, groups, waited=0.0)

    async def _optim_step(self, pending: asyncio.Task[_Prepared] | None) -> tuple[int, MicroBatch | None]:
        """optim_step; with a trainer that can queue ahead, the next step's first micro-batch is
        queued right behind it when packed by the time the update is sent (`pending`: the next
        step's preparation). Returns the version and the micro-batch queued (None: none)."""
        trainer = self._trainer
        if pending is None or not trainer.queue_ahead:
            return await trainer.optim_step(), None
        taken: list[MicroBatch] = []

        def ahead() -> TrainBatch | None:
            if not pending.done() or pending.cancelled() or pending.exception() is not None:
                return None
            first = pending.result().first_pack
            if not first.done() or first.cancelled() or first.exception() is not None:
                return None
            mb = first.result()[0]
            taken.append(mb)
            return mb.train_batch()

        version, queued = await trainer.optim_step_ahead(ahead)
        if queued != bool(taken):
            raise RuntimeError(f"optim_step_ahead answered queued={queued} but {'took' if taken else 'did not take'} the next micro-batch")
        return version, taken[0] if queued else None

    # -- end of step -----------------------------------------------------------------------
    async def _fetch(self, record: StepRecord) -> None:
        start = self._tracer.now()
        metrics = await self._trainer.get_metrics()
        end = self._tracer.now()
        self._tracer.complete("trainer.fetch", "get_metrics", start, end, step=record.step)
        expected = record.policy_version - 1
        if "step" in metrics and int(metrics["step"]) != expected:
            raise RuntimeError(
                f"get_metrics for step {record.step} returned the metrics of the trainer's update "
                f"{int(metrics['step']) + 1}, not {expected + 1}: the metrics slot was overwritten"
            )
        record.trainer_metrics = metrics
        record.metrics_fetch_time = end - start

    async def _deferred_bookkeeping(self, record: StepRecord, fetch: asyncio.Task[None]) -> None:
        await fetch
        await self._threads.run("bookkeeping", lambda: self._bookkeep(record))
        if self._after is not None:
            await self._after(record)

    async def _end_of_step(self, record: StepRecord) -> None:
        step = record.step
        if not self._overlap:
            await self._fetch(record)
            self._bookkeep(record)  # inline, on the event loop: the seed's behaviour
            if self._after is not None:
                await self._after(record)
            return
        fetch = self._jobs.schedule(
            f"fetch:{step}", lambda: self._fetch(record), start_after=commit(step), finish_before=before_optim(step + 1)
        )
        self._jobs.schedule(
            f"bookkeeping:{step}",
            lambda: self._deferred_bookkeeping(record, fetch),
            start_after=first_train(step + 1),
            finish_before=before_optim(step + 1),
        )
        await self._jobs.reach(commit(step))

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        tracer = self._tracer
        pending: asyncio.Task[_Prepared] | None = None
        queued: MicroBatch | None = None  # this step's first micro-batch, queued behind the last optim_step
        last_commit: float | None = None
        step_start = tracer.now()
        for step in range(self._start_step + 1, self._steps + 1):  # steps are numbered from 1
            if pending is None:
                groups, waited = await self._taker.take(step)
                prepared = self._prepare(step, groups, waited)
            else:
                prepared, pending = await pending, None
                prepared.waited = max(0.0, prepared.ready_at - step_start)
            record = StepRecord(step=step, groups=prepared.groups, exposed_generation_time=prepared.waited)
            if self._packing.mask_truncated:  # scored trajectories left out of the loss for their truncation
                every = [t for g in prepared.groups for t in g.trajectories]
                record.truncated_masked = sum(t.status is not TrajectoryStatus.FAILED and truncated(t) for t in every)
            self._on_step_begin(step)
            pack_task = prepared.first_pack
            count = len(prepared.plan.microbatches)
            for index in range(count):
                mb, pack_seconds = await pack_task
                record.packing_time += pack_seconds
                if index + 1 < count:
                    pack_task = self._start_pack(step, index + 1, prepared.trajectories, prepared.plan)
                elif self._overlap and step < self._steps:  # rule 9: N+1 as soon as its groups are there
                    pending = self._tg.create_task(self._take_and_prepare(step + 1), name=f"prepare:{step + 1}")
                start = tracer.now()
                ahead = index == 0 and queued is not None  # sent behind optim_step(step - 1): issued here, not sent again
                if ahead and queued is not mb:
                    raise RuntimeError(f"step {step}: the micro-batch queued behind optim_step(step {step - 1}) is not its first")
                queued = None
                train: asyncio.Task[None] | None = None
                if not ahead:
                    train = self._tg.create_task(self._trainer.train_step(mb.train_batch()), name=f"train_step:{step}:{index}")
                if index == 0:
                    if last_commit is not None:
                        record.boundary_gap_sec = start - last_commit
                    if train is not None:
                        # "issued" = the call ran to its first suspension (a remote call: request sent)
                        await asyncio.sleep(0)
                    await self._jobs.reach(first_train(step))
                if train is not None:
                    await train
                end = tracer.now()
                tracer.complete(
                    "trainer",
                    "train_step",
                    start,
                    end,
                    step=step,
                    microbatch=index,
                    final=mb.final,
                    tokens=mb.num_tokens,
                    padded=mb.padding.padded_tokens,
                    min_version=mb.min_version,
                    **({"ahead": True} if ahead else {}),
                )
                record.train_time += end - start
                record.padding.append(mb.padding)
            await self._jobs.reach(before_optim(step))
            start = tracer.now()
            version, queued = await self._optim_step(pending)
            end = tracer.now()
            tracer.complete("trainer", "optim_step", start, end, step=step)
            record.optim_time = end - start
            record.policy_version = version
            record.step_time_sec = end - step_start
            timed = self._trainer.step_train_time(step)  # a remote trainer's own spans (its calls return early)
            if timed is not None:
                record.train_time = timed
            timed = self._trainer.step_optim_time(step)
            if timed is not None:
                record.optim_time = timed
            record.commit_time = end
            step_start = last_commit = end
            for group in prepared.groups:
                self._ledger.trained(group.group_id, sum(scored(group.trajectories)))
            record.filtered = self._ledger.drain_filtered()
            figures = self._commit_figures()
            record.weight_sync_time = figures.weight_sync_time
            record.loop_lag_max_ms = figures.loop_lag_max_ms
            record.sampler_gpu_mem_peak_gb = figures.sampler_gpu_mem_peak_gb
            self._on_commit(record)
            self.records.append(record)
            await self._end_of_step(record)
        await self._jobs.reach(RUN_END)
