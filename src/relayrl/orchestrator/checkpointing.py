"""Checkpointing during a run: when a checkpoint is due, the state it holds, writing it; and
restoring a resume point before a resumed run starts. (The checkpoint's format, the resume point
and the rewind of the run directory are rundir/checkpoint.py's.)

A checkpoint is due at the commit of every `orchestrator.checkpoint_every`-th step, of the
last step, of the first step to commit once `orchestrator.checkpoint_every_s` seconds have passed
since the run started or the last checkpoint due by time, and — when a stop is asked for (a signal,
see cli/signals.py: `stop`) — of the last step that committed, without waiting for the step in
flight; never without a run directory, nor with `checkpoint_every = 0`. Steps are numbered from 1,
so step N's checkpoint is `checkpoints/step-N/`, holding version N. Its state is taken at that
commit (`on_commit`) and written only once that step's metrics and trajectories are
(`after_bookkeeping`), together with the metrics.jsonl rows logged since the previous checkpoint
(`LoggedSteps`).

A stop's checkpoint of a step whose logs were already written (the trainer is in the next step's
train steps) is written at once, as a deferred job that the next `optim_step` waits for: the
trainer's committed state is what it saves (`Trainer.save_state` is safe between a commit and the
next optim_step), and the trajectory log is sealed first. Only when the next optim_step is
already running does the stop wait for that step's commit and checkpoint it instead.

Invariant: a checkpoint never claims a step whose logs a kill could still lose, and it holds the
state of the moment its step committed (prompts drawn, in-flight prompts, settled ledger,
evaluations so far); a restored run starts from trainer state of exactly the checkpoint's
version, with those weights on every sampler in service (published by the weight publisher, so
bounded and failed over like any sync round: a replica that cannot load them is retired).
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from relayrl.backends.protocols import Trainer, Weights
from relayrl.orchestrator.deferred import DeferredJobs, before_optim, commit
from relayrl.orchestrator.publisher import WeightPublisher
from relayrl.orchestrator.state import RunState
from relayrl.rundir.checkpoint import (
    CheckpointError,
    ResumePoint,
    checkpoint_dir,
    checkpoint_state,
    commit_checkpoint,
    complete_checkpoints,
    staging_dir,
)
from relayrl.rundir.files import eval_row
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.sinks import metrics_row
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import OrchestratorThreads
from relayrl.types import StepRecord, StepResult


class LoggedSteps(Callback):
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


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    every: int  # orchestrator.checkpoint_every (0: never, not even after the last step)
    steps: int  # run.steps: the last step's commit always checkpoints
    keep: int  # orchestrator.keep_checkpoints
    every_s: float = 0.0  # orchestrator.checkpoint_every_s (0: no time-based checkpoints)


class Checkpointer:
    """Takes a checkpoint's state at a due commit and writes it after that step's logs. What it
    records beyond the trainer's state (prompt cursor, ledger, evaluations, elapsed time, step 1's
    reward mean) it reads off the run's `RunState`."""

    def __init__(
        self,
        *,
        run_dir: Path | None,
        policy: CheckpointPolicy,
        backend_name: str,
        trainer: Trainer,
        threads: OrchestratorThreads,
        tracer: Tracer,
        logged: LoggedSteps,
        state: RunState,
    ) -> None:
        self._run_dir = run_dir
        self._every = policy.every if run_dir is not None else 0
        self._every_s = policy.every_s
        self._steps = policy.steps
        self._keep = policy.keep
        self._backend_name = backend_name
        self._trainer = trainer
        self._threads = threads
        self._tracer = tracer
        self._logged = logged
        self._state = state
        # on the run's clock (RunState.elapsed: from the run's start, not counting model loading):
        # its start, or the commit of its last time-based checkpoint
        self._timed_from = state.elapsed_before_s
        self._timed: set[int] = set()  # steps due by orchestrator.checkpoint_every_s
        self._pending: dict[int, Callable[[], dict[str, object]]] = {}  # due, state taken, not yet written
        self._last: tuple[int, Callable[[], dict[str, object]]] | None = None  # the last commit: its step and state
        self._logs_written = 0  # the last step whose logs were written (its after_bookkeeping ran)
        self._claimed: set[int] = set()  # steps whose checkpoint is being written or was written
        self._written = 0  # the newest step whose checkpoint is complete
        self._on_stop: Callable[[], None] | None = None  # a stop was asked for: called once its checkpoint is written
        self._stop_step: int | None = None  # the step a stop checkpoints
        self._jobs: DeferredJobs | None = None
        self._seal: Callable[[], None] | None = None

    def attach(self, jobs: DeferredJobs, seal: Callable[[], None]) -> None:
        """The run's deferred jobs (a stop's checkpoint of an already logged step is one) and the
        bookkeeper's `seal_trajectories`, which completes the trajectory file before it."""
        self._jobs = jobs
        self._seal = seal

    def due(self, step: int) -> bool:
        """Whether the commit of `step` (numbered from 1: `step` steps done) takes a checkpoint.
        Stable for a step once it committed (the bookkeeping thread asks again)."""
        return bool(self._every) and (step % self._every == 0 or step == self._steps or step == self._stop_step or step in self._timed)

    def stop(self, written: Callable[[], None]) -> bool:
        """A stop: checkpoint the last step that committed (at once when its logs are written,
        else right after them; the next step to commit when its optim_step is already running),
        then call `written` (on the loop) once that checkpoint is complete. False (and nothing
        asked) when this run writes no checkpoints or none of its steps committed yet (start-up:
        workers starting, a first step of unknown length — a stop then cancels at once)."""
        if not self._every or self._last is None or self._on_stop is not None:
            return False
        self._on_stop = written
        step, state = self._last
        if self._written >= step:  # already on disk
            asyncio.get_running_loop().call_soon(written)
        elif step in self._claimed or step in self._pending or self._logs_written < step:
            self._stop_step = step  # written after its logs (after_bookkeeping), then `written`
            if step not in self._claimed:
                self._pending.setdefault(step, state)
        elif self._jobs is not None and (self._jobs.reached is None or self._jobs.reached < before_optim(step + 1)):
            self._stop_step = step
            self._claimed.add(step)
            self._jobs.schedule(
                f"stop-checkpoint:{step}",
                lambda: self._write_logged(step, state),
                start_after=commit(step),
                finish_before=before_optim(step + 1),  # the next update waits for it
            )
        # else: optim_step(step + 1) is running: its commit is checkpointed (on_commit)
        return True

    async def _write_logged(self, step: int, state: Callable[[], dict[str, object]]) -> None:
        if self._seal is not None:
            await self._threads.run("bookkeeping", self._seal)
        await self.write(step, state())
        if self._on_stop is not None:
            self._on_stop()

    def on_commit(self, record: StepRecord) -> None:
        step = record.step
        if not self._every:
            return
        if self._on_stop is not None and self._stop_step is None:
            self._stop_step = step
        now = self._state.elapsed()
        if self._every_s and now - self._timed_from >= self._every_s:
            self._timed.add(step)
            self._timed_from = now
        state = self._capture(step)  # the state at this commit
        self._last = (step, state)
        if self.due(step):
            self._pending[step] = state

    async def after_bookkeeping(self, record: StepRecord) -> None:
        # written once the step's metrics and trajectories are: a checkpoint never
        # claims a step whose logs a kill could still lose
        step = record.step
        self._logs_written = step
        state = self._pending.pop(step, None)
        if state is not None:
            self._claimed.add(step)
            if step == self._stop_step and self._seal is not None:  # due since its logs were written, maybe
                await self._threads.run("bookkeeping", self._seal)
            await self.write(step, state())
        if step == self._stop_step and self._on_stop is not None:
            self._on_stop()

    def _capture(self, step: int) -> Callable[[], dict[str, object]]:
        """The state at this moment, as a function that builds it: what changes after the commit
        is copied now (cheap: references and counters), the per-prompt dicts are built only for a
        checkpoint that is written."""
        state = self._state
        drawn, in_flight = state.prompts.drawn, [*state.ledger.in_flight(), *state.prompts.pending()]
        ledger, evals, elapsed = state.ledger.checkpoint(), list(state.evals), state.elapsed()
        backend = self._backend_name
        return lambda: checkpoint_state(
            step=step,
            backend=backend,
            prompts_drawn=drawn,
            in_flight=in_flight,
            ledger=ledger,
            evals=[eval_row(e) for e in evals],
            elapsed_s=elapsed,
        )

    async def write(self, step: int, state: dict[str, object]) -> None:
        assert self._run_dir is not None
        start = self._tracer.now()
        # step 1's result exists by now, and so do the rows of every step up to this one
        state = {**state, "reward_mean_first": self._state.reward_mean_first, "metrics_rows": self._logged.take(step)}
        final = checkpoint_dir(self._run_dir, step)
        staging = staging_dir(final)
        keep = self._keep

        def prepare() -> None:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)

        await self._threads.run("bookkeeping", prepare)
        try:
            await self._trainer.save_state(staging)
            await self._threads.run("bookkeeping", lambda: commit_checkpoint(staging, final, state, keep))
        except Exception as exc:  # no temporary is left; the previous checkpoint is untouched (renamed over only once complete)
            written = await self._threads.run("bookkeeping", lambda: _discard(staging))
            full = _disk_full(exc, staging)
            if full is not None:
                raise CheckpointWriteError(step, final, written, full) from exc
            raise
        except BaseException:  # cancelled (a stop past its bound): what is there goes now (what the
            await asyncio.to_thread(shutil.rmtree, staging, True)  # writer thread adds later, at the resume: rewind_run_dir)
            raise
        self._written = max(self._written, step)
        self._tracer.complete("orchestrator", "checkpoint", start, self._tracer.now(), step=step)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written for lack of disk space: names the disk, its free space and
    the space needed (the previous checkpoint's size, or at least what was written of this one)."""

    def __init__(self, step: int, final: Path, written: int, free: int) -> None:
        disk = _mount_of(final.parent)
        previous = [p for p in complete_checkpoints(final.parent) if p != final]
        size = _tree_bytes(previous[-1]) if previous else 0
        need = f"~{_mb(size)} (the size of {previous[-1].name})" if size > written else f"more than {_mb(written)}"
        kept = f"the previous checkpoint {previous[-1].name} is intact" if previous else "no earlier checkpoint exists"
        super().__init__(
            errno.ENOSPC,
            f"step {step}'s checkpoint cannot be written to {final.parent}: no space left on the disk at {disk} "
            f"({_mb(free)} free; the checkpoint needs {need}); nothing of it was left behind and {kept}: free space there "
            "(or lower orchestrator.keep_checkpoints) and resume",
        )

    def __str__(self) -> str:
        return str(self.strerror)


def _discard(staging: Path) -> int:
    """Remove a checkpoint's staging directory; the bytes that had been written to it."""
    written = _tree_bytes(staging)
    shutil.rmtree(staging, ignore_errors=True)
    return written


def _disk_full(exc: BaseException, where: Path) -> int | None:
    """The free bytes at `where` when `exc` (or what caused it) says the disk is full, else None.
    torch.save reports a full disk as a RuntimeError ("file write failed", "enforce fail at
    inline_container.cc"): that counts too when the disk is (nearly) full."""
    cause: BaseException | None = exc
    nospace = False
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            nospace = True
        cause = cause.__cause__ or cause.__context__
    try:
        free = shutil.disk_usage(_mount_of(where)).free
    except OSError:
        free = 0
    if nospace or (isinstance(exc, RuntimeError) and "write" in str(exc) and free < 64 * 2**20):
        return free
    return None


def _mount_of(path: Path) -> Path:
    """The mount point of the disk holding `path` (or its nearest existing parent)."""
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def _tree_bytes(path: Path) -> int:
    total = 0
    for f in path.rglob("*") if path.is_dir() else ():
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return total


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


async def restore(point: ResumePoint, *, trainer: Trainer, publisher: WeightPublisher) -> Weights:
    """Before a resumed run starts: the trainer's state (`trainer`'s `load_state`, bounded by
    `train.call_timeout_s`: the program's `BoundedTrainer`), then its weights published to every
    sampler through `publisher` (each load bounded by `rollout.weight_load_timeout_s`, a replica
    whose load fails failed over as in any sync round). Returns the weights."""
    try:
        version = await trainer.load_state(point.directory)
    except Exception as exc:
        raise CheckpointError(f"{point.directory}: cannot restore the trainer state ({type(exc).__name__}: {exc})") from exc
    if version != point.step:
        raise CheckpointError(f"{point.directory}: trainer state is version {version}, the checkpoint says {point.step}")
    return await publisher.publish_newest(loadable=True)  # (the owed evaluation loads them)
