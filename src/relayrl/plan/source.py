"""A measured run directory as the planner reads it: its config, trace spans, trajectories and
summary (`SourceRun`), and the figures a prediction is compared with (`measured_figures`).

Invariant: reading never writes; a missing or foreign run directory, or one without the files a
plan needs, raises `UserError` naming the directory and the file (one line, exit 2).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.analysis import timeline
from relayrl.analysis.runlist import is_run_dir
from relayrl.analysis.timeline import Span
from relayrl.config.schema import Config, load_config
from relayrl.errors import UserError
from relayrl.rundir import jsonl
from relayrl.telemetry import trajlog
from relayrl.telemetry.tracer import load_trace

TRAJECTORY_COLUMNS = ("step", "prompt", "reward", "status", "staleness", "prompt_tokens", "completion_tokens")


@dataclass(slots=True)
class SourceRun:
    """What the planner reads from one run directory."""

    run_dir: Path
    cfg: Config
    spans: list[Span]
    summary: dict[str, object]
    metrics: list[dict[str, object]]
    trajectories: list[dict[str, object]] = field(default_factory=list)


def _need(run_dir: Path, name: str) -> Path:
    path = run_dir / name
    if not path.is_file():
        raise UserError(f"{run_dir}: no {name} (a plan needs a finished run's {name})")
    return path


def read_source(run_dir: Path, with_trajectories: bool = True) -> SourceRun:
    """Read `run_dir`; UserError (one line) when it is missing, not a run directory, or lacks
    config.toml, trace.json or summary.json."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}")
    if not is_run_dir(run_dir) or not (run_dir / "config.toml").is_file():
        raise UserError(f"{run_dir}: not a relayrl run directory (no config.toml, trace.json or metrics.jsonl)")
    cfg = load_config(_need(run_dir, "config.toml"), [])
    spans = timeline.spans(load_trace(_need(run_dir, "trace.json")))
    try:
        summary = json.loads(_need(run_dir, "summary.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{run_dir / 'summary.json'}: not JSON ({exc})") from None
    if not isinstance(summary, dict):
        raise UserError(f"{run_dir / 'summary.json'}: not a JSON object")
    metrics = jsonl.read_rows(run_dir / "metrics.jsonl", strict=False)[0] if (run_dir / "metrics.jsonl").exists() else []
    rows: list[dict[str, object]] = []
    if with_trajectories and trajlog.log_files(run_dir):
        table = trajlog.read_trajectories(run_dir)
        rows = table.select([c for c in TRAJECTORY_COLUMNS if c in table.column_names]).to_pylist()
    if not any(s.name == "train_step" for s in spans):
        raise UserError(f"{run_dir / 'trace.json'}: no train_step span (the run trained no step)")
    return SourceRun(run_dir, cfg, spans, summary, metrics, rows)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def staleness_shares(rows: list[dict[str, object]]) -> dict[str, float]:
    """Share of the trained (status ok) trajectories at each staleness, keys as strings."""
    values = [int(v) for r in rows if r.get("status") == "ok" and isinstance(v := r.get("staleness"), int)]
    if not values:
        return {}
    return {str(k): values.count(k) / len(values) for k in sorted(set(values))}


def measured_figures(run: SourceRun) -> dict[str, float | dict[str, float] | None]:
    """The figures a prediction is compared with, under summary.json's names where it has them:
    `samples_per_s`, `trainer_busy_fraction`, `step_time_s` (median of metrics.jsonl's
    step_time_sec), `staleness_mean` and `staleness` (shares), `sync_round_s` (median weight_sync
    span)."""
    steps = [v for r in run.metrics if (v := _number(r.get("step_time_sec"))) is not None]
    shares = staleness_shares(run.trajectories)
    rounds = [s.dur for s in run.spans if s.name == "weight_sync"]
    return {
        "samples_per_s": _number(run.summary.get("samples_per_s")),
        "trainer_busy_fraction": _number(run.summary.get("trainer_busy_fraction")),
        "step_time_s": statistics.median(steps) if steps else None,
        "staleness_mean": sum(int(k) * v for k, v in shares.items()) if shares else None,
        "staleness": shares,
        "sync_round_s": statistics.median(rounds) if rounds else None,
    }
