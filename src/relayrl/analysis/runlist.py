"""Listing runs: the run directories under a folder and one row of key figures each.

Invariant: listing only reads (trace and trajectory log are skipped when summary.json has the
figures) and never fails on one run's bad files — a run whose trace is not a trace is listed with
what its other files say; a directory is a run directory exactly when it holds one of `RUN_FILES`.
`runs_text` writes whole values (never cut to a terminal's width), so a piped listing keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from relayrl.analysis.rundata import format_value, key_figures, load_run

RUN_FILES = ("metrics.jsonl", "summary.json", "trace.json")


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def run_figures(run_dir: Path) -> dict[str, object]:
    """One run's row for a runs table: name, path, status, steps, wall_time_s, samples_per_s,
    trainer_busy_fraction, accuracy_before, accuracy_after, reward_last (None where unknown)."""
    data = load_run(run_dir, trace=False, trajectories=False)
    if data.summary is None:  # no summary, or an unreadable one: compute from the trace (if it reads)
        data = load_run(run_dir, trajectories=False)
    values = {f.key: f.value for f in key_figures(data)}
    row: dict[str, object] = {"name": run_dir.name, "path": str(run_dir)}
    for key in (
        "status",
        "steps",
        "wall_time_s",
        "samples_per_s",
        "trainer_busy_fraction",
        "accuracy_before",
        "accuracy_after",
        "reward_last",
    ):
        row[key] = values.get(key)
    return row


def list_runs(root: Path) -> list[dict[str, object]]:
    """Key figures of every run directory directly under `root` (a directory holding
    metrics.jsonl, summary.json or trace.json), sorted by name; `root` itself when it is a run
    directory; [] when `root` does not exist."""
    root = Path(root)
    if not root.is_dir():
        return []
    if is_run_dir(root):
        return [run_figures(root)]
    return [run_figures(d) for d in sorted(root.iterdir(), key=lambda p: p.name) if is_run_dir(d)]


# `relayrl runs` columns: run_figures key -> header
RUN_COLUMNS: dict[str, str] = {
    "name": "run",
    "status": "status",
    "steps": "steps",
    "wall_time_s": "wall s",
    "samples_per_s": "samples/s",
    "trainer_busy_fraction": "busy",
    "accuracy_before": "acc before",
    "accuracy_after": "acc after",
    "reward_last": "reward",
}
TEXT_COLUMNS = frozenset({"name", "status"})  # left-aligned; the figures are right-aligned


def runs_cells(runs: Sequence[Mapping[str, object]], columns: Mapping[str, str] = RUN_COLUMNS) -> list[list[str]]:
    """Header and one row per run, each value as the report writes it (`format_value`)."""
    return [list(columns.values()), *([format_value(run.get(key)) for key in columns] for run in runs)]


def runs_text(runs: Sequence[Mapping[str, object]], columns: Mapping[str, str] = RUN_COLUMNS) -> str:
    """A plain table for a pipe or file: columns padded to their widest value, never cut."""
    cells = runs_cells(runs, columns)
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    keys = list(columns)
    lines = []
    for row in cells:
        parts = [v.ljust(w) if keys[i] in TEXT_COLUMNS else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines) + "\n"
