"""The program: wires the stages, supervises them under one TaskGroup, writes the run directory.

    dispatch → sampler(s) → collect → score → advantages → train loop → commit → weight sync
                                                              └→ deferred bookkeeping

Invariant: the first error in any stage, deferred job or worker call cancels every other task
and reaches the caller as itself (not wrapped); cancellation of the run leaves no task or
worker thread running; `summary.json`, `metrics.jsonl` and `trace.json` are written whatever
the outcome.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from relayrl.backends.bundle import Backend
from relayrl.backends.protocols import Weights
from relayrl.bookkeeping import RUN_END, DeferredJobs, commit
from relayrl.callbacks import Callback
from relayrl.checkpoint import (
    CheckpointError,
    PromptSource,
    ResumePoint,
    checkpoint_dir,
    commit_checkpoint,
    staging_dir,
    state_dict,
)
from relayrl.config import Config, config_to_toml
from relayrl.evaluation import EvalResult
from relayrl.ledger import Ledger
from relayrl.replicas import ReplicaPool
from relayrl.rundir import RunDirLock, writing
from relayrl.stages.advantage import advantage_stage
from relayrl.stages.collect import collect_stage
from relayrl.stages.dispatch import dispatch_stage
from relayrl.stages.sample import sampler_stage
from relayrl.stages.score import score_stage
from relayrl.stages.sync import SyncTimes, VersionSignal, sync_stage
from relayrl.stages.train_loop import GroupTaker, TrainLoop
from relayrl.tasks.rewards import RewardFunction
from relayrl.telemetry import timeline
from relayrl.telemetry.looplag import LoopLagMonitor
from relayrl.telemetry.memory import freeze_long_lived
from relayrl.telemetry.sinks import build_sinks, metrics_row
from relayrl.telemetry.stepbook import StepBookkeeper
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import Workers
from relayrl.window import DispatchWindow
from relayrl.types import (
    GenerateResult,
    Group,
    Prompt,
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


def _append_line(path: Path, row: dict[str, object]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(tmp):
            tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _eval_row(result: EvalResult) -> dict[str, object]:
    return {"version": result.version, "accuracy": result.accuracy, "num_prompts": result.num_prompts, "seconds": result.seconds}


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    errors: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = list(exc.exceptions)
        else:
            errors.append(exc)
    for exc in errors:
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return errors[0] if errors else group


class _LoggedSteps(Callback):
    """What the run knows of its logged steps (a step is logged once its metrics and trajectories
    are written: its `on_step_end`). Keeps the metrics.jsonl rows since the last checkpoint (at
    most `keep`; none without checkpoints), from which a resume repairs a torn metrics.jsonl, and
    the ledger as it was at the commit of the last logged step: a run that stops between a
    commit and that step's logs reports the ledger of the steps it logged, never one that counts
    a step its records lack."""

    def __init__(self, keep: int, ledger: dict[str, object]) -> None:
        self._keep = keep
        self._rows: deque[dict[str, object]] = deque(maxlen=max(keep, 1))
        self._ledger_at: dict[int, dict[str, object]] = {}  # committed, not yet logged (at most two)
        self.ledger = ledger

    def committed(self, step: int, ledger: dict[str, object]) -> None:
        self._ledger_at[step] = ledger

    @property
    def unlogged(self) -> int:
        """Committed steps whose logs were not written."""
        return len(self._ledger_at)

    def on_step_end(self, step: int, result: StepResult) -> None:
        self.ledger = self._ledger_at.pop(step, self.ledger)
        if self._keep:
            self._rows.append(metrics_row(step, result.metrics))

    def take(self, through: int) -> list[dict[str, object]]:
        """The rows of steps ≤ `through`, handed over and forgotten."""
        taken: list[dict[str, object]] = []
        while self._rows and int(self._rows[0]["step"]) <= through:  # type: ignore[call-overload]
            taken.append(self._rows.popleft())
        return taken


class Program:
    def __init__(
        self,
        cfg: Config,
        backend: Backend,
        prompts: Iterator[Prompt],
        reward_fns: Sequence[RewardFunction],
        *,
        run_dir: Path | None,
        workers: Workers,
        callbacks: Sequence[Callback] = (),
        resume: ResumePoint | None = None,
        lock: RunDirLock | None = None,
    ) -> None:
        self.cfg = cfg
        self.lock = lock  # the run directory's lock (run.build_program took it); released when the run ends
        self.backend = backend
        self.resume = resume
        self.start_step = resume.next_step if resume else 0
        self.prompts = PromptSource(prompts, resume.in_flight, resume.prompts_drawn) if resume else PromptSource(prompts)
        self.reward_fns = list(reward_fns)
        self.run_dir = run_dir
        self.workers = workers
        self.callbacks = list(callbacks)
        self.ledger = Ledger.resumed(resume.ledger) if resume else Ledger()
        self._logged = _LoggedSteps(cfg.orchestrator.checkpoint_every if run_dir is not None else 0, self.ledger.as_dict())
        self.replicas = ReplicaPool.of(backend.samplers, cfg.rollout.sampler_failover)
        run_info: dict[str, object] = {
            "overlap_bookkeeping": cfg.orchestrator.overlap_bookkeeping,
            "max_staleness": cfg.rollout.max_staleness,
            "groups_per_step": cfg.rollout.groups_per_step,
            "steps": cfg.run.steps,
            "backend": cfg.run.backend,
            "loop_thread": threading.current_thread().name,
            "first_step": self.start_step,
        }
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(run_dir / "config.toml", config_to_toml(cfg))
        self.tracer = Tracer(run_dir / "trace.json" if run_dir else None, run_info)
        self.bookkeeper = StepBookkeeper(
            tracer=self.tracer,
            run_dir=run_dir,
            callbacks=[self._logged, *self.callbacks],
            host_costs=backend.host_costs,
            abort=workers.abort,
            log_trajectories=cfg.orchestrator.log_trajectories,
            release=cfg.orchestrator.release_memory,
            trim=cfg.orchestrator.malloc_trim,
            sinks=build_sinks(run_dir, cfg.telemetry.sinks, cfg.run.name, cfg.model_dump(), project=cfg.telemetry.project)
            if run_dir is not None
            else None,
        )
        self.loop: TrainLoop | None = None
        self.evals: list[EvalResult] = (
            [EvalResult(**e) for e in resume.evals] if resume else []  # type: ignore[arg-type]
        )
        self._started = time.perf_counter()

    def _elapsed(self) -> float:
        return (self.resume.elapsed_s if self.resume else 0.0) + time.perf_counter() - self._started

    async def run(self) -> RunResult:
        cfg = self.cfg
        self._started = time.perf_counter()
        status, error = "failed", ""
        try:
            if cfg.orchestrator.release_memory:
                freeze_long_lived()
            await self._supervise()
            status = "completed"
        except asyncio.CancelledError:
            status, error = "cancelled", "cancelled"
            raise
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.workers.shutdown()
            closing = self._finish(status, error)
        if closing:  # the run completed but its files could not be closed (e.g. disk full)
            raise closing[0]
        return self._result

    def _finish(self, status: str, error: str) -> list[OSError]:
        """Close the run's files, write summary.json (atomically) and release the run directory.
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
        summary = self._summary(status, error, self._elapsed())
        self._result = RunResult(self.run_dir, self.bookkeeper.results, self.loop.records if self.loop else [], summary, self.tracer, self.ledger)
        try:
            if self.run_dir is not None:
                _write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        except OSError as exc:
            failures.append(exc)
        finally:
            if self.lock is not None:
                self.lock.release()
        return failures

    async def _supervise(self) -> None:
        cfg, backend = self.cfg, self.backend
        size = cfg.orchestrator.queue_size
        requests: asyncio.Queue[list[SampleRequest]] = asyncio.Queue(size)
        generated: asyncio.Queue[list[GenerateResult]] = asyncio.Queue(size)
        collected: asyncio.Queue[list[Group]] = asyncio.Queue(size)
        scored: asyncio.Queue[list[Group]] = asyncio.Queue(size)
        ready: asyncio.Queue[Group] = asyncio.Queue()  # bounded by the dispatch window
        start = self.start_step
        self.replicas = ReplicaPool.of(backend.samplers, cfg.rollout.sampler_failover)
        window = DispatchWindow(cfg.rollout.groups_per_step, cfg.rollout.max_staleness, cfg.run.steps, start)
        committed = VersionSignal(start)
        sync_times = SyncTimes()
        lag = LoopLagMonitor(cfg.orchestrator.loop_lag_interval_ms / 1e3)
        try:
            if self.resume is not None:
                await self._restore(self.resume)
            elif backend.evaluator is not None:
                await self._evaluate(None)  # the starting policy, before any update
            async with asyncio.TaskGroup() as tg:
                background = [
                    tg.create_task(lag.run(), name="loop-lag"),
                    tg.create_task(
                        dispatch_stage(self.prompts, backend.tokenize, window, self.ledger, requests,
                                       cfg.rollout.num_generations, cfg.rollout.prompts_per_request),
                        name="dispatch",
                    ),
                    *[
                        tg.create_task(sampler_stage(s, requests, generated, self.tracer, self.replicas), name=f"sampler/{s.replica}")
                        for s in backend.samplers
                    ],
                    tg.create_task(collect_stage(generated, collected), name="collect"),
                    tg.create_task(score_stage(collected, scored, self.reward_fns, self.workers, self.ledger), name="score"),
                    tg.create_task(
                        advantage_stage(scored, ready, cfg.algorithm.advantage, cfg.algorithm.dynamic_sampling, self.ledger, window),
                        name="advantages",
                    ),
                    tg.create_task(
                        sync_stage(backend.trainer, self.replicas, committed, window, self.tracer, sync_times, start),
                        name="weight-sync",
                    ),
                ]

                jobs = DeferredJobs(tg)
                every = cfg.eval.every_steps
                checkpoints: dict[int, dict[str, object]] = {}
                ckpt_every = cfg.orchestrator.checkpoint_every if self.run_dir is not None else 0

                def on_commit(record: StepRecord) -> None:
                    committed.set(record.policy_version)
                    self._logged.committed(record.step, self.ledger.as_dict())
                    record.weight_sync_time = sync_times.drain()
                    record.loop_lag_max_ms = lag.take_max_ms()
                    step, done = record.step, record.step + 1
                    if backend.evaluator is not None and every and done % every == 0 and done < cfg.run.steps:
                        jobs.schedule(f"eval:{step}", self._evaluate_latest, start_after=commit(step), finish_before=RUN_END)
                    if ckpt_every and (done % ckpt_every == 0 or done == cfg.run.steps):
                        checkpoints[step] = self._checkpoint_state(done)  # the state at this commit

                async def after_bookkeeping(record: StepRecord) -> None:
                    # written once the step's metrics and trajectories are: a checkpoint never
                    # claims a step whose logs a kill could still lose
                    state = checkpoints.pop(record.step, None)
                    if state is not None:
                        await self._checkpoint(record.step, state)

                def on_step_begin(step: int) -> None:
                    for cb in self.callbacks:
                        cb.on_step_begin(step)

                self.loop = TrainLoop(
                    start_step=start,
                    steps=cfg.run.steps,
                    trainer=backend.trainer,
                    collator=backend.collator,
                    taker=GroupTaker(ready, cfg.rollout.groups_per_step, cfg.rollout.max_staleness, self.ledger, window, self.tracer),
                    jobs=jobs,
                    task_group=tg,
                    workers=self.workers,
                    tracer=self.tracer,
                    ledger=self.ledger,
                    overlap=cfg.orchestrator.overlap_bookkeeping,
                    row_tokens=cfg.train.row_tokens,
                    rows_per_microbatch=cfg.train.rows_per_microbatch,
                    share_prompt=cfg.train.share_prompt,
                    on_step_begin=on_step_begin,
                    on_commit=on_commit,
                    bookkeep=self.bookkeeper,
                    after_bookkeeping=after_bookkeeping,
                )
                await tg.create_task(self.loop.run(), name="train-loop")
                if backend.evaluator is not None:
                    await self._evaluate_latest()
                for task in background:
                    task.cancel()
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            await self.backend.close()

    async def _restore(self, point: ResumePoint) -> None:
        """Before a resumed run starts: the trainer's state, and its weights on every sampler."""
        try:
            version = await self.backend.trainer.load_state(point.directory)
        except Exception as exc:
            raise CheckpointError(f"{point.directory}: cannot restore the trainer state ({type(exc).__name__}: {exc})") from exc
        if version != point.next_step:
            raise CheckpointError(f"{point.directory}: trainer state is version {version}, the checkpoint says {point.next_step}")
        weights = await self.backend.trainer.export_weights()
        for sampler in self.backend.samplers:
            await sampler.load_weights(weights)
        every = self.cfg.eval.every_steps
        due = every and point.next_step % every == 0 and all(e.version != point.next_step for e in self.evals)
        if self.backend.evaluator is not None and due:  # the periodic eval a kill interrupted
            await self._evaluate(weights)

    def _checkpoint_state(self, next_step: int) -> dict[str, object]:
        return state_dict(
            next_step=next_step, backend=self.cfg.run.backend, source=self.prompts, in_flight=self.ledger.in_flight(), ledger=self.ledger.checkpoint(),
            evals=[_eval_row(e) for e in self.evals], elapsed_s=self._elapsed(),
        )

    def _reward_mean_first(self) -> float | None:
        if self.resume is not None and self.resume.reward_mean_first is not None:
            return self.resume.reward_mean_first
        results = self.bookkeeper.results
        first = results[0].metrics.get("reward_mean") if results and results[0].step == 0 else None
        return float(first) if isinstance(first, (int, float)) else None

    async def _checkpoint(self, step: int, state: dict[str, object]) -> None:
        assert self.run_dir is not None
        start = self.tracer.now()
        # step 0's result exists by now, and so do the rows of every step up to this one
        state = {**state, "reward_mean_first": self._reward_mean_first(), "metrics_rows": self._logged.take(step)}
        final = checkpoint_dir(self.run_dir, step)
        staging = staging_dir(final)
        keep = self.cfg.orchestrator.keep_checkpoints

        def prepare() -> None:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)

        await self.workers.run("bookkeeping", prepare)
        await self.backend.trainer.save_state(staging)
        await self.workers.run("bookkeeping", lambda: commit_checkpoint(staging, final, state, keep))
        self.tracer.complete("orchestrator", "checkpoint", start, self.tracer.now(), step=step)

    async def _evaluate_latest(self) -> None:
        await self._evaluate(await self.backend.trainer.export_weights())

    async def _evaluate(self, weights: Weights | None) -> None:
        assert self.backend.evaluator is not None
        start = self.tracer.now()
        result = await self.backend.evaluator.evaluate(weights)
        self.tracer.complete("eval", "eval", start, self.tracer.now(), version=result.version, accuracy=result.accuracy)
        self.evals.append(result)
        row = _eval_row(result)
        if self.run_dir is not None:
            path = self.run_dir / "evals.jsonl"
            await self.workers.run("bookkeeping", lambda: _append_line(path, row))
        for cb in self.callbacks:
            cb.on_eval(result)

    def _summary(self, status: str, error: str, wall: float) -> dict[str, object]:
        # The tracer keeps no flushed events (its memory must not grow with the steps): with a
        # run directory this reads trace.json back, once, at the end of the run. A trace that
        # cannot be read leaves these figures empty rather than hide the run's own outcome.
        try:
            all_spans = timeline.spans(self.tracer.events)
        except (OSError, ValueError):
            all_spans = []
        gaps = timeline.boundary_gaps(all_spans)
        results = self.bookkeeper.results
        # a run stopped between a commit and its logs: the ledger of the steps it logged
        ledger = self._logged.ledger if self._logged.unlogged else self.ledger.as_dict()
        trained = int(ledger["trajectories_trained"])  # type: ignore[call-overload]
        return {
            "status": status,
            "error": error,
            "steps_completed": self.start_step + len(results),  # committed and logged
            "steps_unlogged": self._logged.unlogged,  # committed, then stopped before their logs were written
            "resumed_from_step": self.start_step if self.resume else None,
            "wall_time_s": wall,
            "samples_per_s": trained / wall if wall > 0 else 0.0,
            "trainer_busy_fraction": timeline.trainer_busy_fraction(all_spans),
            "boundary_gap_median_s": timeline.median(gaps),
            "accuracy_before": self.evals[0].accuracy if self.evals else None,
            "accuracy_after": self.evals[-1].accuracy if len(self.evals) > 1 else None,
            "evals": [{"version": e.version, "accuracy": e.accuracy} for e in self.evals],
            "reward_mean_first": self._reward_mean_first(),
            "reward_mean_last": results[-1].metrics.get("reward_mean") if results else None,
            "ledger": ledger,
            "samplers_retired": self.replicas.retired,
        }
