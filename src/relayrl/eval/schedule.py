"""When the held-out evaluation runs during a run, and where its results go.

The schedule: the starting policy, before a fresh run's first step (`at_start`); after every
`eval.every_steps`-th commit except the last step's, as a deferred job that starts after that
commit and finishes before the run ends (`on_commit`); the final policy, once the train loop
returned (`at_end`). A resumed run first owes the periodic evaluation a kill interrupted: that of
its starting version when it is a multiple of `every_steps` and no result of it was recorded
(`owed_on_resume`). Without an evaluator nothing is scheduled.

Invariant: each result is appended to `results` (which a checkpoint and the summary read) and to
evals.jsonl before any callback's `on_eval` sees it; no evaluation outlives the run (each is
awaited by the run or is a deferred job of its TaskGroup).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from relayrl.backends.protocols import Evaluator, Trainer, Weights
from relayrl.orchestrator.deferred import RUN_END, DeferredJobs, commit
from relayrl.rundir.files import append_eval
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import OrchestratorThreads
from relayrl.types import EvalResult


class EvalSchedule:
    def __init__(
        self,
        *,
        evaluator: Evaluator | None,
        trainer: Trainer,
        every: int,
        steps: int,
        run_dir: Path | None,
        threads: OrchestratorThreads,
        tracer: Tracer,
        callbacks: Sequence[Callback],
        results: list[EvalResult],
    ) -> None:
        self._evaluator = evaluator
        self._trainer = trainer
        self._every = every
        self._steps = steps
        self._run_dir = run_dir
        self._threads = threads
        self._tracer = tracer
        self._callbacks = callbacks
        self.results = results  # every evaluation of the run so far (a resumed run's included)

    async def at_start(self) -> None:
        if self._evaluator is not None:
            await self.evaluate(None)  # the starting policy, before any update

    async def owed_on_resume(self, version: int, weights: Weights) -> None:
        """`weights` (of `version`, just restored) when the periodic eval of `version` was not recorded."""
        every = self._every
        due = every and version % every == 0 and all(e.version != version for e in self.results)
        if self._evaluator is not None and due:  # the periodic eval a kill interrupted
            await self.evaluate(weights)

    def on_commit(self, step: int, jobs: DeferredJobs) -> None:
        every = self._every  # steps are numbered from 1: `step` steps are done
        if self._evaluator is not None and every and step % every == 0 and step < self._steps:
            jobs.schedule(f"eval:{step}", self.evaluate_latest, start_after=commit(step), finish_before=RUN_END)

    async def at_end(self) -> None:
        if self._evaluator is not None:
            await self.evaluate_latest()

    async def evaluate_latest(self) -> None:
        await self.evaluate(await self._trainer.export_weights())

    async def evaluate(self, weights: Weights | None) -> None:
        assert self._evaluator is not None
        start = self._tracer.now()
        result = await self._evaluator.evaluate(weights)
        self._tracer.complete(
            "eval", "eval", start, self._tracer.now(), version=result.version, accuracy=result.accuracy, reward_mean=result.reward_mean
        )
        self.results.append(result)
        run_dir = self._run_dir
        if run_dir is not None:
            await self._threads.run("bookkeeping", lambda: append_eval(run_dir, result))
        for cb in self._callbacks:
            cb.on_eval(result)
