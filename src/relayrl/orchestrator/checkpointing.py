"""Checkpointing during a run: when a checkpoint is due, the state it holds, writing it; and
restoring a resume point before a resumed run starts. (The checkpoint's format, the resume point
and the rewind of the run directory are rundir/checkpoint.py's.)

A checkpoint is due at the commit of every `orchestrator.checkpoint_every`-th step and of the
last step (never without a run directory). Its state is taken at that commit (`on_commit`) and
written only once that step's metrics and trajectories are (`after_bookkeeping`), together with
the metrics.jsonl rows logged since the previous checkpoint (`LoggedSteps`).

Invariant: a checkpoint never claims a step whose logs a kill could still lose, and it holds the
state of the moment its step committed (prompts drawn, in-flight prompts, settled ledger,
evaluations so far); a restored run starts from trainer state of exactly the checkpoint's
version, with those weights on every sampler.
"""

from __future__ import annotations

import shutil
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from relayrl.backends.bundle import Backend
from relayrl.backends.protocols import Trainer, Weights
from relayrl.orchestrator.ledger import Ledger
from relayrl.rundir.checkpoint import (
    CheckpointError,
    PromptSource,
    ResumePoint,
    checkpoint_dir,
    checkpoint_state,
    commit_checkpoint,
    staging_dir,
)
from relayrl.rundir.files import eval_row
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.sinks import metrics_row
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import Workers
from relayrl.types import EvalResult, StepRecord, StepResult


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


class Checkpointer:
    """Takes a checkpoint's state at a due commit and writes it after that step's logs."""

    def __init__(
        self,
        *,
        run_dir: Path | None,
        every: int,
        steps: int,
        keep: int,
        backend_name: str,
        trainer: Trainer,
        workers: Workers,
        tracer: Tracer,
        logged: LoggedSteps,
        prompts: PromptSource,
        ledger: Ledger,
        evals: Sequence[EvalResult],
        elapsed: Callable[[], float],
        reward_mean_first: Callable[[], float | None],
    ) -> None:
        self._run_dir = run_dir
        self._every = every if run_dir is not None else 0
        self._steps = steps
        self._keep = keep
        self._backend_name = backend_name
        self._trainer = trainer
        self._workers = workers
        self._tracer = tracer
        self._logged = logged
        self._prompts = prompts
        self._ledger = ledger
        self._evals = evals  # the run's list: read at each commit
        self._elapsed = elapsed
        self._reward_mean_first = reward_mean_first
        self._pending: dict[int, dict[str, object]] = {}  # due, state taken, not yet written

    def due(self, done: int) -> bool:
        """Whether the commit that completes `done` steps takes a checkpoint."""
        return bool(self._every) and (done % self._every == 0 or done == self._steps)

    def on_commit(self, record: StepRecord) -> None:
        done = record.step + 1
        if self.due(done):
            self._pending[record.step] = self.state(done)  # the state at this commit

    async def after_bookkeeping(self, record: StepRecord) -> None:
        # written once the step's metrics and trajectories are: a checkpoint never
        # claims a step whose logs a kill could still lose
        state = self._pending.pop(record.step, None)
        if state is not None:
            await self.write(record.step, state)

    def state(self, next_step: int) -> dict[str, object]:
        return checkpoint_state(
            next_step=next_step,
            backend=self._backend_name,
            source=self._prompts,
            in_flight=self._ledger.in_flight(),
            ledger=self._ledger.checkpoint(),
            evals=[eval_row(e) for e in self._evals],
            elapsed_s=self._elapsed(),
        )

    async def write(self, step: int, state: dict[str, object]) -> None:
        assert self._run_dir is not None
        start = self._tracer.now()
        # step 0's result exists by now, and so do the rows of every step up to this one
        state = {**state, "reward_mean_first": self._reward_mean_first(), "metrics_rows": self._logged.take(step)}
        final = checkpoint_dir(self._run_dir, step)
        staging = staging_dir(final)
        keep = self._keep

        def prepare() -> None:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)

        await self._workers.run("bookkeeping", prepare)
        await self._trainer.save_state(staging)
        await self._workers.run("bookkeeping", lambda: commit_checkpoint(staging, final, state, keep))
        self._tracer.complete("orchestrator", "checkpoint", start, self._tracer.now(), step=step)


async def restore(backend: Backend, point: ResumePoint) -> Weights:
    """Before a resumed run starts: the trainer's state, and its weights on every sampler (returned)."""
    try:
        version = await backend.trainer.load_state(point.directory)
    except Exception as exc:
        raise CheckpointError(f"{point.directory}: cannot restore the trainer state ({type(exc).__name__}: {exc})") from exc
    if version != point.next_step:
        raise CheckpointError(f"{point.directory}: trainer state is version {version}, the checkpoint says {point.next_step}")
    weights = await backend.trainer.export_weights()
    for sampler in backend.samplers:
        await sampler.load_weights(weights)
    return weights
