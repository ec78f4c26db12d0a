"""A run's state: where it starts and what it carries across a resume.

A run starts fresh (`RunState.fresh`: no step done, the prompt stream from its start, an empty
ledger, no evaluations) or restored from a checkpoint (`RunState.restored`: after the checkpoint's step,
its prompt cursor and in-flight prompts, its ledger, evaluations, elapsed time and step 1's
reward mean). Both have the same shape, so the program, the checkpointer, the evaluation
schedule and the summary read one object and never ask whether the run resumed.

Invariant: the state is the one owner of what a checkpoint records and the summary reports
beyond the step logs: the evaluation schedule appends to `evals`, the checkpointer and the
summary read it; `reward_mean_first` is set once, from step 1's logged metrics (or the
checkpoint's); `elapsed()` counts the time before this process (a resume's) plus this process's
time since `start_clock()`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from relayrl.orchestrator.ledger import Ledger
from relayrl.rundir.checkpoint import PromptSource, ResumePoint
from relayrl.telemetry.callbacks import Callback
from relayrl.types import EvalResult, Prompt, StepResult


@dataclass(slots=True, eq=False)
class RunState(Callback):
    start_step: int  # steps committed before this process (= the policy version it starts from); it trains start_step + 1, ...
    prompts: PromptSource  # the prompt cursor: replayed in-flight prompts first, then the stream
    ledger: Ledger
    evals: list[EvalResult]  # every held-out evaluation of the run so far (a resumed run's included)
    elapsed_before_s: float  # wall time of the run before this process (0 when fresh)
    reward_mean_first: float | None  # step 1's reward_mean, once logged (the summary's gain baseline)
    point: ResumePoint | None = None  # the checkpoint restored; None for a fresh run
    _started: float = field(default_factory=time.perf_counter)

    @classmethod
    def fresh(cls, stream: Iterator[Prompt]) -> RunState:
        return cls(0, PromptSource(stream), Ledger(), [], 0.0, None)

    @classmethod
    def restored(cls, stream: Iterator[Prompt], point: ResumePoint) -> RunState:
        return cls(
            start_step=point.step,
            prompts=PromptSource(stream, point.in_flight, point.prompts_drawn),
            ledger=Ledger.resumed(point.ledger),
            evals=[EvalResult(**e) for e in point.evals],  # type: ignore[arg-type]
            elapsed_before_s=point.elapsed_s,
            reward_mean_first=point.reward_mean_first,
            point=point,
        )

    @property
    def resumed(self) -> bool:
        return self.point is not None

    def start_clock(self) -> None:
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        return self.elapsed_before_s + time.perf_counter() - self._started

    def on_step_end(self, step: int, result: StepResult) -> None:
        first = result.metrics.get("reward_mean") if step == 1 else None  # steps are numbered from 1
        if isinstance(first, (int, float)) and self.reward_mean_first is None:
            self.reward_mean_first = float(first)
