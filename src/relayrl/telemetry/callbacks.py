"""User callbacks around each step.

Steps are numbered from 1 (step N's commit makes policy version N), as in metrics.jsonl.

Invariant: `on_step_begin(N)` runs on the event loop when step N starts (keep it cheap);
`on_step_end(N, result)` runs in the bookkeeping thread (overlapped mode) in step order, after
N's result is stored; `on_eval(result)` runs on the event loop after each held-out evaluation.
An exception from any of them fails the run.
"""

from __future__ import annotations

from relayrl.types import EvalResult, StepResult


class Callback:
    def on_step_begin(self, step: int) -> None:
        return None

    def on_step_end(self, step: int, result: StepResult) -> None:
        return None

    def on_eval(self, result: EvalResult) -> None:
        return None
