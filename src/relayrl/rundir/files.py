"""The run directory's own files: config.toml, evals.jsonl, config_changes.jsonl, summary.json —
and the summary itself. (The per-step logs — metrics.jsonl, trajectories/, trace.json — are the
bookkeeper's and the tracer's; checkpoints/ is rundir/checkpoint.py's.)

Invariant: config.toml and summary.json are replaced atomically (a reader sees the whole file or
the one before it); evals.jsonl and config_changes.jsonl only grow, by whole lines (rundir/jsonl.py).
The summary never counts a step whose logs were not written: `steps_completed` is the committed
and logged steps, and a run stopped between a commit and that step's logs reports the ledger as
it was at the commit of its last logged step (checkpointing.LoggedSteps).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from relayrl.analysis import timeline
from relayrl.config.schema import Config, config_to_toml
from relayrl.rundir.jsonl import append_rows, write_text_atomic
from relayrl.telemetry.tracer import Tracer
from relayrl.types import EvalResult, StepResult

CONFIG = "config.toml"
EVALS = "evals.jsonl"
SUMMARY = "summary.json"
CONFIG_CHANGES = "config_changes.jsonl"  # one row per key a resume changed: from_step, key, old, new
REWARD_WORKERS_LOG = "reward_workers.log"  # the reward workers' stdout and stderr, capped (rewards/output.py)


def write_config(run_dir: Path, cfg: Config) -> None:
    write_text_atomic(run_dir / CONFIG, config_to_toml(cfg))


def eval_row(result: EvalResult) -> dict[str, object]:
    """An evaluation as evals.jsonl (and a checkpoint's `evals`) records it."""
    row: dict[str, object] = {
        "version": result.version,
        "accuracy": result.accuracy,
        "num_prompts": result.num_prompts,
        "seconds": result.seconds,
    }
    if result.reward_mean is not None:
        row["reward_mean"] = result.reward_mean
    if result.first_turn_accuracy is not None:
        row["first_turn_accuracy"] = result.first_turn_accuracy
        row["mean_turns"] = result.mean_turns
    return row


def _multiturn_evals(evals: Sequence[EvalResult]) -> dict[str, object]:
    """Multi-turn tasks: first-turn accuracy and mean turns per episode, before and after."""
    if not evals or evals[0].first_turn_accuracy is None:
        return {}
    last = evals[-1] if len(evals) > 1 else None
    return {
        "first_turn_accuracy_before": evals[0].first_turn_accuracy,
        "first_turn_accuracy_after": last.first_turn_accuracy if last else None,
        "mean_turns_before": evals[0].mean_turns,
        "mean_turns_after": last.mean_turns if last else None,
    }


def append_eval(run_dir: Path, result: EvalResult) -> None:
    append_rows(run_dir / EVALS, [eval_row(result)])


def append_config_changes(run_dir: Path, rows: Sequence[dict[str, object]]) -> None:
    append_rows(run_dir / CONFIG_CHANGES, rows)


def write_summary(run_dir: Path, summary: dict[str, object]) -> None:
    write_text_atomic(run_dir / SUMMARY, json.dumps(summary, indent=2))


def build_summary(
    *,
    status: str,
    error: str,
    wall: float,
    tracer: Tracer,
    results: Sequence[StepResult],
    start_step: int,
    resumed: bool,
    ledger: dict[str, object],
    steps_unlogged: int,
    evals: Sequence[EvalResult],
    reward_mean_first: float | None,
    samplers_retired: list[dict[str, object]],
    samplers_restarted: list[dict[str, object]],
) -> dict[str, object]:
    """summary.json. `ledger`: the ledger of the logged steps; `steps_unlogged`: steps committed,
    then stopped before their logs were written."""
    # The tracer keeps no flushed events (its memory must not grow with the steps): with a
    # run directory this reads trace.json back, once, at the end of the run. A trace that
    # cannot be read leaves these figures empty rather than hide the run's own outcome.
    try:
        all_spans = timeline.spans(tracer.events)
    except (OSError, ValueError):
        all_spans = []
    gaps = timeline.boundary_gaps(all_spans)
    trained = int(ledger["trajectories_trained"])  # type: ignore[call-overload]
    return {
        "status": status,
        "error": error,
        "steps_completed": start_step + len(results),  # committed and logged
        "steps_unlogged": steps_unlogged,  # committed, then stopped before their logs were written
        "resumed_from_step": start_step if resumed else None,
        "wall_time_s": wall,
        "samples_per_s": trained / wall if wall > 0 else 0.0,
        "trainer_busy_fraction": timeline.trainer_busy_fraction(all_spans),
        "boundary_gap_median_s": timeline.median(gaps),
        "accuracy_before": evals[0].accuracy if evals else None,
        "accuracy_after": evals[-1].accuracy if len(evals) > 1 else None,
        "heldout_reward_mean_before": evals[0].reward_mean if evals else None,
        "heldout_reward_mean_after": evals[-1].reward_mean if len(evals) > 1 else None,
        "evals": [{"version": e.version, "accuracy": e.accuracy, "reward_mean": e.reward_mean} for e in evals],
        **_multiturn_evals(evals),
        "reward_mean_first": reward_mean_first,
        "reward_mean_last": results[-1].metrics.get("reward_mean") if results else None,
        "ledger": ledger,
        "samplers_retired": samplers_retired,
        "samplers_restarted": samplers_restarted,
    }
