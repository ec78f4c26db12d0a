"""The program: wires the stages and supervises them under one TaskGroup.

    dispatch → sampler(s) → collect → score → advantages → train loop → commit → weight sync
                                                              └→ deferred bookkeeping

It only supervises. What it delegates: building the run, fresh or restored, and validating it
(orchestrator/build.py: `start_run`, `resume_run`), assembling its parts (orchestrator/parts.py),
what the run carries across a resume (orchestrator/state.py's `RunState`), restoring a resume
point and writing checkpoints (orchestrator/checkpointing.py), when the held-out evaluation runs
(eval/schedule.py), the run directory's config.toml, evals.jsonl and summary.json and the summary
itself (rundir/files.py), the per-step logs (telemetry/stepbook.py), the trained model a
completed run writes with run.save_model (models/export.py: after summary.json, under the run
directory's lock, not counted in the run's wall time).

Invariant: the first error in any stage, deferred job or worker call cancels every other task
and reaches the caller as itself (not wrapped); cancellation of the run leaves no task or
worker thread running; `summary.json`, `metrics.jsonl` and `trace.json` are written whatever
the outcome.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relayrl.algorithms.advantages import needs_step, stage_kind
from relayrl.backends.bundle import Backend
from relayrl.errors import UserError
from relayrl.models.export import MODEL_DIR, MODEL_STATE, ModelSaveFailed, write_model
from relayrl.orchestrator.checkpointing import restore
from relayrl.orchestrator.deferred import DeferredJobs
from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.parts import RunParts
from relayrl.orchestrator.publisher import WeightPublisher
from relayrl.orchestrator.replicas import ReplicaPool
from relayrl.orchestrator.stages.advantage import Shaping, advantage_stage
from relayrl.orchestrator.stages.dispatch import dispatch_stage
from relayrl.orchestrator.stages.sample import MultiTurn, Rollout, SingleTurn, sampler_stage
from relayrl.orchestrator.stages.score import score_stage
from relayrl.orchestrator.stages.sync import SyncTimes, VersionSignal, sync_stage
from relayrl.orchestrator.stages.train_loop import CommitFigures, GroupTaker, PackingSpec, StepHooks, TrainLoop
from relayrl.orchestrator.taskgroups import first_error
from relayrl.orchestrator.watchdog import StallWatchdog
from relayrl.orchestrator.window import DispatchWindow
from relayrl.rundir import files as runfiles
from relayrl.rundir.checkpoint import STATE_FILE, checkpoint_dir
from relayrl.rundir.lock import RunDirLock
from relayrl.telemetry.looplag import LoopLagMonitor
from relayrl.telemetry.memory import freeze_long_lived
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import switch_interval
from relayrl.types import (
    Group,
    SampleRequest,
    StepRecord,
    StepResult,
)


@dataclass(slots=True)
class RunResult:
    """What a run returns. Nothing in it grows with the number of steps when the run has a run
    directory: `results` keeps the first and last step in memory and reads the others back from
    metrics.jsonl; `records` is the last step's record only; `tracer.events` reads trace.json back.
    An in-memory run (run_dir None) keeps every result and trace event instead."""

    run_dir: Path | None
    results: Sequence[StepResult]
    records: Sequence[StepRecord]
    summary: dict[str, object]
    tracer: Tracer
    ledger: Ledger
    model_dir: Path | None = None  # the Hugging Face model directory the completed run wrote (run.save_model)


class Program:
    """Supervises one run: drives its stages under one TaskGroup, then writes summary.json and
    releases the run directory. Its parts are assembled by orchestrator/parts.py."""

    def __init__(self, parts: RunParts, *, lock: RunDirLock | None = None) -> None:
        """`parts` were assembled from a validated config, the backend and the run's state
        (orchestrator/build.py); `lock` is the run directory's, released when the run ends."""
        self.lock = lock
        self.cfg = parts.cfg
        self.backend = parts.backend
        self.state = parts.state
        self.start_step = parts.state.start_step
        self.prompts = parts.state.prompts
        self.ledger = parts.state.ledger
        self.run_dir = parts.run_dir
        self.threads = parts.threads
        self.callbacks = parts.callbacks
        self.trainer = parts.trainer
        self.scorer = parts.scorer
        self.tracer = parts.tracer
        self.episodes = parts.episodes
        self.agents = parts.agents
        self.bookkeeper = parts.bookkeeper
        self.eval_schedule = parts.eval_schedule
        self.checkpointer = parts.checkpointer
        self._logged = parts.logged
        self.replicas = ReplicaPool.of(parts.backend.samplers, parts.cfg.rollout.sampler_failover)
        self.loop: TrainLoop | None = None
        self._model_state: Path | None = None  # the last step's trainer state, for run.save_model

    def _dispatch_bound(self, backend: Backend) -> int | None:
        """The most prompt tokens a group may have to be sampled: the model's context after
        rollout.max_new_tokens; for multi-turn episodes, room for at least one action token
        within the episode's token limit."""
        if self.episodes is not None:
            return self.episodes.settings.max_total_tokens - 1
        return backend.max_prompt_tokens

    async def run(self) -> RunResult:
        cfg = self.cfg
        self.state.start_clock()
        status, error = "failed", ""
        try:
            if cfg.orchestrator.release_memory:
                freeze_long_lived()
            with switch_interval(cfg.orchestrator.switch_interval_ms / 1e3):
                await self._supervise()
            status = "completed"
        except asyncio.CancelledError:
            status, error = "cancelled", "cancelled"
            raise
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                self.threads.shutdown()
            finally:
                self.scorer.close()  # after the scoring thread stopped: no reward process outlives the run
            saving = status == "completed" and self._model_state is not None
            closing = self._finish(status, error, release=not saving)
        if saving:  # after the run's figures: the model's export is not part of its wall time
            try:
                if not closing:
                    self._result.model_dir = await self._save_model()
            finally:
                if self.lock is not None:
                    self.lock.release()
        if closing:  # the run completed but its files could not be closed (e.g. disk full)
            raise closing[0]
        return self._result

    async def _final_state(self) -> Path | None:
        """With run.save_model (local backend, a run directory): the directory holding the last
        step's trainer state — its checkpoint, or (without checkpoints) a hidden one the trainer
        writes now, after the last step (the trainer has nothing left to do)."""
        cfg, run_dir = self.cfg, self.run_dir
        if run_dir is None or not cfg.run.save_model or cfg.run.backend != "local":
            return None
        final = checkpoint_dir(run_dir, cfg.run.steps)
        if (final / STATE_FILE).is_file():
            return final
        staging = run_dir / MODEL_STATE

        def prepare() -> None:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()

        await self.threads.run("bookkeeping", prepare)
        await self.trainer.save_state(staging)
        return staging

    async def _save_model(self) -> Path:
        """Write RUN_DIR/model/ from the last step's trainer state, in a worker thread; a failure
        is a `ModelSaveFailed` (the run itself completed)."""
        assert self.run_dir is not None and self._model_state is not None
        run_dir, state, cfg = self.run_dir, self._model_state, self.cfg
        out = run_dir / MODEL_DIR
        try:
            exported = await asyncio.to_thread(write_model, cfg, state, out, step=cfg.run.steps, run_dir=run_dir)
        except (UserError, OSError) as exc:
            raise ModelSaveFailed(out, exc, checkpointed=state.name != MODEL_STATE) from exc
        finally:
            if state.name == MODEL_STATE:
                await asyncio.to_thread(shutil.rmtree, state, True)
        return exported.directory

    def _finish(self, status: str, error: str, *, release: bool = True) -> list[OSError]:
        """Close the run's files, write summary.json (atomically) and release the run directory
        (unless not `release`: the caller releases it after writing the model).
        Every step is tried even when one fails (a full disk must not leave the lock held or the
        trace open); the failures are returned, so they never hide the run's own error."""
        failures: list[OSError] = []
        try:
            self.bookkeeper.close()
        except OSError as exc:
            failures.append(exc)
        try:
            self.tracer.close(status)
        except OSError as exc:
            failures.append(exc)
        summary = self._summary(status, error, self.state.elapsed())
        self._result = RunResult(
            self.run_dir, self.bookkeeper.results, self.loop.records if self.loop else [], summary, self.tracer, self.ledger
        )
        try:
            if self.run_dir is not None:
                runfiles.write_summary(self.run_dir, summary)
        except OSError as exc:
            failures.append(exc)
        finally:
            if self.lock is not None and release:
                self.lock.release()
        return failures

    async def _supervise(self) -> None:
        cfg, backend = self.cfg, self.backend
        size = cfg.orchestrator.queue_size
        requests: asyncio.Queue[list[SampleRequest]] = asyncio.Queue(size)
        collected: asyncio.Queue[list[Group]] = asyncio.Queue(size)
        scored: asyncio.Queue[list[Group]] = asyncio.Queue(size)
        ready: asyncio.Queue[Group] = asyncio.Queue()  # bounded by the dispatch window
        start = self.start_step
        self.replicas = ReplicaPool.of(backend.samplers, cfg.rollout.sampler_failover, version=start)
        # every way weights reach the samplers (sync rounds, restarts, the resume) goes through it
        publisher = WeightPublisher(
            self.trainer, self.replicas, self.tracer, load_timeout_s=cfg.rollout.weight_load_timeout_s, broadcast=backend.broadcast
        )
        window = DispatchWindow(cfg.rollout.groups_per_step, cfg.rollout.max_staleness, cfg.run.steps, start)
        committed = VersionSignal(start)
        sync_times = SyncTimes()
        lag = LoopLagMonitor(cfg.orchestrator.loop_lag_interval_ms / 1e3)
        watchdog = StallWatchdog(cfg.orchestrator.stall_timeout_s, self.run_dir, cfg.orchestrator.stop_grace_s)
        try:
            if self.agents is not None:
                await self.agents.start()
            if self.state.point is not None:
                weights = await restore(self.state.point, trainer=self.trainer, publisher=publisher)
                await self.eval_schedule.owed_on_resume(self.state.point.step, weights)
            else:
                await self.eval_schedule.at_start()
            async with asyncio.TaskGroup() as tg:
                background = [
                    tg.create_task(lag.run(), name="loop-lag"),
                    tg.create_task(watchdog.run(), name="stall-watchdog"),
                    tg.create_task(
                        dispatch_stage(
                            self.prompts,
                            backend.tokenize,
                            window,
                            self.ledger,
                            requests,
                            num_generations=cfg.rollout.num_generations,
                            prompts_per_request=cfg.rollout.prompts_per_request,
                            max_prompt_tokens=self._dispatch_bound(backend),
                        ),
                        name="dispatch",
                    ),
                    *[
                        tg.create_task(
                            sampler_stage(
                                s,
                                requests,
                                collected,
                                self.tracer,
                                self.replicas,
                                self._rollout(),
                                publisher=publisher,
                                width=cfg.rollout.agent_batches_per_replica if self.agents is not None else 1,
                            ),
                            name=f"sampler/{s.replica}",
                        )
                        for s in self.replicas.slots
                    ],
                    tg.create_task(score_stage(collected, scored, self.scorer, self.ledger, strict=cfg.task.strict_rewards), name="score"),
                    tg.create_task(
                        advantage_stage(
                            scored,
                            ready,
                            self.ledger,
                            window,
                            kind=stage_kind(cfg.algorithm.advantage, cfg.algorithm.scale_rewards),
                            dynamic_sampling=cfg.algorithm.dynamic_sampling,
                            row_tokens=cfg.train.row_tokens,
                            shaping=Shaping(
                                max_policy_tokens=cfg.generation_budget,
                                overlong_buffer=cfg.algorithm.overlong_buffer,
                                overlong_penalty=cfg.algorithm.overlong_penalty,
                                mask_truncated=cfg.algorithm.mask_truncated,
                                turn_discount=cfg.algorithm.turn_discount,
                            ),
                        ),
                        name="advantages",
                    ),
                    tg.create_task(
                        sync_stage(
                            publisher=publisher, committed=committed, window=window, tracer=self.tracer, times=sync_times, synced=start
                        ),
                        name="weight-sync",
                    ),
                ]

                jobs = DeferredJobs(tg)
                self.checkpointer.attach(jobs, seal=self.bookkeeper.seal_trajectories)

                def commit_figures() -> CommitFigures:  # the train loop writes them into the step's record
                    return CommitFigures(
                        weight_sync_time=sync_times.drain(),
                        loop_lag_max_ms=lag.take_max_ms(),
                        sampler_gpu_mem_peak_gb=backend.sampler_gpu_peak(),
                    )

                def on_commit(record: StepRecord) -> None:
                    committed.set(record.policy_version)
                    watchdog.progress()
                    self._logged.committed(record.step, self.ledger.as_dict())
                    self.eval_schedule.on_commit(record.step, jobs)
                    self.checkpointer.on_commit(record)  # takes the state at this commit, if due

                def on_step_begin(step: int) -> None:
                    for cb in self.callbacks:
                        cb.on_step_begin(step)

                self.loop = TrainLoop(
                    start_step=start,
                    steps=cfg.run.steps,
                    trainer=self.trainer,
                    collator=backend.collator,
                    taker=GroupTaker(
                        ready,
                        self.ledger,
                        window,
                        self.tracer,
                        groups_per_step=cfg.rollout.groups_per_step,
                        max_staleness=cfg.rollout.max_staleness,
                    ),
                    jobs=jobs,
                    task_group=tg,
                    threads=self.threads,
                    tracer=self.tracer,
                    ledger=self.ledger,
                    overlap=cfg.orchestrator.overlap_bookkeeping,
                    packing=PackingSpec(
                        row_tokens=cfg.train.row_tokens,
                        rows_per_microbatch=cfg.train.rows_per_microbatch,
                        share_prompt=cfg.train.share_prompt,
                        minibatches=cfg.train.minibatches_per_step,
                        mask_truncated=cfg.algorithm.mask_truncated,
                    ),
                    step_advantage=cfg.algorithm.advantage if needs_step(cfg.algorithm.advantage, cfg.algorithm.scale_rewards) else None,
                    token_whiten=cfg.algorithm.whiten == "token",
                    hooks=StepHooks(
                        on_step_begin=on_step_begin,
                        commit_figures=commit_figures,
                        on_commit=on_commit,
                        bookkeep=self.bookkeeper,
                        after_bookkeeping=self.checkpointer.after_bookkeeping,  # after the step's logs
                    ),
                )
                await tg.create_task(self.loop.run(), name="train-loop")
                await self.eval_schedule.at_end()
                self._model_state = await self._final_state()  # before the trainer closes
                for task in background:
                    task.cancel()
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        finally:
            try:
                if self.agents is not None:
                    await self.agents.stop()
            finally:
                await self.backend.close()

    def _rollout(self) -> Rollout:
        """Single completions, multi-turn episodes when the task has an environment, or agents'
        episodes through the endpoint (task.agent)."""
        if self.agents is not None:
            return self.agents
        if self.episodes is None:
            return SingleTurn(self.tracer, timeout_s=self.cfg.rollout.generate_timeout_s)
        return MultiTurn(self.episodes, timeout_s=self.cfg.rollout.generate_timeout_s)

    def _summary(self, status: str, error: str, wall: float) -> dict[str, object]:
        # a run stopped between a commit and its logs: the ledger of the steps it logged
        ledger = self._logged.ledger if self._logged.unlogged else self.ledger.as_dict()
        return runfiles.build_summary(
            status=status,
            error=error,
            wall=wall,
            tracer=self.tracer,
            results=self.bookkeeper.results,
            start_step=self.start_step,
            resumed=self.state.resumed,
            ledger=ledger,
            steps_unlogged=self._logged.unlogged,
            evals=self.state.evals,
            reward_mean_first=self.state.reward_mean_first,
            samplers_retired=self.replicas.retired,
            samplers_restarted=self.replicas.restarted,
        )
