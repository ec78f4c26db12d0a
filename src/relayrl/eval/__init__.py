"""Held-out evaluation: greedy accuracy of a policy version on the task's fixed held-out set, and
when during a run it is measured. The evaluator is the orchestrator's, built from a backend's
greedy engine; results are `types.EvalResult`."""
