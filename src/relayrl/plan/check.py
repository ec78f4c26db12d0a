"""`relayrl plan --check RUN_A RUN_B`: predict B's configuration from A's trace and measure the
error of each figure against B's own files; the result is written to B as `plan-check.json`,
which B's report (`relayrl report`) shows."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

CHECK_FILE = "plan-check.json"
# the figures a prediction gives, under summary.json's names where it has them
FIGURES = ("samples_per_s", "trainer_busy_fraction", "step_time_s", "staleness_mean", "sync_round_s")

# how each figure's error is given: relative (share of the measured value) or absolute (points
# of a fraction, or staleness versions)
RELATIVE = {"samples_per_s", "step_time_s", "sync_round_s"}


def errors(predicted: Mapping[str, object], measured: Mapping[str, object]) -> dict[str, dict[str, float | str | None]]:
    """Per figure: predicted mean, measured, the error and its kind ("relative" or "absolute")."""
    out: dict[str, dict[str, float | str | None]] = {}
    for name in FIGURES:
        p, m = predicted.get(name), measured.get(name)
        mean = float(p["mean"]) if isinstance(p, dict) else None
        value = float(m) if isinstance(m, int | float) else None
        if name in RELATIVE:
            err = (mean - value) / value if mean is not None and value else None
            kind = "relative"
        else:
            err = mean - value if mean is not None and value is not None else None
            kind = "absolute"
        out[name] = {"predicted": mean, "measured": value, "error": err, "kind": kind}
    return out


def error_text(name: str, e: dict[str, float | str | None]) -> str:
    err = e["error"]
    if not isinstance(err, float):
        return "-"
    if e["kind"] == "relative":
        return f"{err:+.1%}"
    return f"{err * 100:+.1f} points" if name == "trainer_busy_fraction" else f"{err:+.3f}"


def write_check(run_b: Path, source: Path, sets: list[str], scale: dict[str, float], result: dict[str, object]) -> Path:
    from relayrl.rundir.jsonl import write_text_atomic

    path = Path(run_b) / CHECK_FILE
    write_text_atomic(path, json.dumps({"source": str(source), "sets": sets, "scale": scale, **result}, indent=2) + "\n")
    return path


def read_check(run_dir: Path) -> dict[str, object] | None:
    """B's plan-check.json, or None when absent or unreadable (the report then shows nothing)."""
    try:
        raw = json.loads((Path(run_dir) / CHECK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def check_html(check: dict[str, object]) -> str:
    """The report's section: B's measured figures beside the prediction made from the source."""
    from html import escape

    errs = check.get("errors")
    if not isinstance(errs, dict):
        return ""
    rows = []
    for name, e in errs.items():
        if not isinstance(e, dict):
            continue
        p, m = e.get("predicted"), e.get("measured")
        rows.append(
            f"<tr><td>{escape(str(name))}</td><td>{'-' if p is None else f'{p:.4g}'}</td>"
            f"<td>{'-' if m is None else f'{m:.4g}'}</td><td>{escape(error_text(str(name), e))}</td></tr>"
        )
    return (
        "<h2>Planned from another run</h2>"
        f"<p>This run was predicted by <code>relayrl plan --check</code> from {escape(str(check.get('source')))} "
        f"({check.get('seeds')} seeds; plan-check.json).</p>"
        "<table><tr><th>figure</th><th>predicted</th><th>measured</th><th>error</th></tr>" + "".join(rows) + "</table>"
    )
