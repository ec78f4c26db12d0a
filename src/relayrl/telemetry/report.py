"""Run report: a run directory's plots and key figures as `report.html` plus PNG files.

Job: `write_report(run_dir)` reads what a run wrote — metrics.jsonl, the trajectory log
(trajectories.parquet or trajectories/*.parquet when pyarrow can read it, else
trajectories.jsonl), trace.json, evals.jsonl, summary.json — and writes `report.html` with its
plots as PNGs under `report/`; `list_runs(root)` gives every run directory's key figures.

Invariant: never writes the run's logs, and tolerates a run still going or one that crashed (no
summary.json, a trace cut off mid-event, a partial last line): a missing file or column skips
that plot with a note in the HTML instead of failing. What is not a run is refused before
anything is written: a directory without any run file, a trace.json that is not a trace
(`tracer.load_trace`, the one trace reader, names the file and event). Every number shown comes from the
run's files — summary.json where it has the figure, else computed from metrics.jsonl, the trace
or evals.jsonl, and the table names which — so the HTML agrees with metrics.jsonl. The HTML opens
offline: no script, no remote resource; each plot is embedded as a data URI and links to its PNG
file next to it.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from relayrl.rundir import is_live
from relayrl.telemetry import timeline
from relayrl.telemetry import trajlog
from relayrl.telemetry.tracer import TraceEvent, load_trace

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Row = dict[str, object]

REPORT_HTML = "report.html"
REPORT_DIR = "report"  # the PNGs, relative to the run directory
RUNNING_WINDOW_S = 300.0  # a run without summary.json whose logs changed this recently is "running"
GANTT_STEPS = 4  # the timeline plot shows the last few steps, enough to see the boundary
TRAINED_STATUSES = frozenset({"ok", "failed"})  # trajectory-log statuses of trained trajectories
TRAJECTORY_COLUMNS = ("step", "staleness", "status", "reward", "policy_version")

# Step-time components, stacked in this order (metrics.jsonl key, label, colour).
STEP_COMPONENTS: tuple[tuple[str, str, str], ...] = (
    ("train_time", "training", "#1f77b4"),
    ("exposed_generation_time", "exposed generation", "#d62728"),
    ("weight_sync_time", "weight sync", "#9467bd"),
    ("boundary_gap_sec", "boundary gap", "#ff7f0e"),
    ("packing_time", "packing", "#bcbd22"),
)
OTHER_COLOUR = "#c7c7c7"

# Timeline colours by span name; names not listed take colours from FALLBACK_COLOURS in order.
SPAN_COLOURS: dict[str, str] = {
    "train_step": "#1f77b4",
    "optim_step": "#0b2e59",
    "get_metrics": "#17becf",
    "pack": "#ff7f0e",
    "wait_data": "#d62728",
    "weight_sync": "#9467bd",
    "checkpoint": "#8c564b",
    "reduce_metrics": "#2ca02c",
    "log_metrics": "#98df8a",
    "log_trajectories": "#bcbd22",
    "on_step_end": "#e377c2",
    "release_memory": "#7b4173",
    "generate": "#9e9e9e",
    "eval": "#ff9896",
}
FALLBACK_COLOURS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#5254a3", "#8ca252", "#bd9e39", "#ad494a")
LANE_ORDER = ("trainer", "trainer.fetch", "orchestrator", "bookkeeping", "eval")


class PlotSkipped(Exception):
    """A plot cannot be drawn from this run's files; the message says why."""


# ----------------------------------------------------------------------------------------- reading


@dataclass(slots=True)
class RunData:
    """What a run directory holds, read tolerantly; `notes` lists what could not be read."""

    run_dir: Path
    metrics: list[Row] = field(default_factory=list)
    evals: list[Row] = field(default_factory=list)
    summary: Row | None = None
    events: list[TraceEvent] | None = None  # None: no trace.json (or not read)
    trajectories: list[Row] | None = None  # None: no trajectory log (or not read)
    trajectory_source: str = ""
    notes: list[str] = field(default_factory=list)


def read_jsonl(path: Path) -> tuple[list[Row], int]:
    """Rows of a JSON-lines file and the number of lines skipped. A last line that does not parse
    (a writer mid-line, or a crash) is dropped silently; other bad lines are skipped and counted."""
    if not path.exists():
        return [], 0
    # rows end at "\n" only: str.splitlines() would also split a JSON string at a raw U+2028 or \x0c
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    rows: list[Row] = []
    bad = 0
    for i, line in enumerate(lines):
        text = line.strip()
        if not text:
            continue
        try:
            value: object = json.loads(text)
        except ValueError:
            if i != len(lines) - 1:
                bad += 1
            continue
        if isinstance(value, dict):
            rows.append(value)
        else:
            bad += 1
    return rows, bad


def read_trajectories(run_dir: Path, columns: Sequence[str] = TRAJECTORY_COLUMNS) -> tuple[list[Row], str] | None:
    """The trajectory log's rows (only `columns`) and where they came from; None without a log.
    Step files are written whole (temp file + rename), so a live or crashed run reads cleanly."""
    files = trajlog.step_files(run_dir)
    if not files:
        return None
    table = trajlog.read_trajectories(run_dir).select(list(columns))
    return table.to_pylist(), f"trajectories/ ({len(files)} step files)"


def load_run(run_dir: Path, *, trace: bool = True, trajectories: bool = True, strict: bool = False) -> RunData:
    """Read a run directory; `trace`/`trajectories` False skips those (larger) files. A trace.json
    that is not a trace (`load_trace` raises: garbage, not a crash's cut-off prefix) raises with
    `strict` (the report), else it is left out with a note (listings)."""
    data = RunData(run_dir=run_dir)
    data.metrics, bad = read_jsonl(run_dir / "metrics.jsonl")
    if bad:
        data.notes.append(f"metrics.jsonl: skipped {bad} unreadable line(s)")
    data.evals, bad = read_jsonl(run_dir / "evals.jsonl")
    if bad:
        data.notes.append(f"evals.jsonl: skipped {bad} unreadable line(s)")
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        try:
            value: object = json.loads(summary_path.read_text(encoding="utf-8"))
            data.summary = value if isinstance(value, dict) else None
        except ValueError:
            data.notes.append("summary.json: unreadable, figures computed from the logs")
    trace_path = run_dir / "trace.json"
    if trace and trace_path.exists():
        try:
            data.events = load_trace(trace_path)
        except FileNotFoundError:  # removed since: as if there were none
            pass
        except ValueError as exc:
            if strict:
                raise
            data.notes.append(f"trace.json: not read ({exc})")
    if trajectories:
        try:
            found = read_trajectories(run_dir)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # pyarrow's errors derive from these
            found = None
            data.notes.append(f"trajectory log: not read ({' '.join(str(exc).split())})")
        if found is not None:
            data.trajectories, data.trajectory_source = found
    return data


# ------------------------------------------------------------------------------------- key figures


def _num(value: object) -> float | None:
    """A finite number as float, else None (missing, null, text, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def format_value(value: object) -> str:
    """How the report writes a value: ints as they are, floats to 4 significant digits."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


@dataclass(slots=True, frozen=True)
class KeyFigure:
    key: str
    label: str
    value: float | int | str | None
    text: str  # as shown
    source: str  # the file it comes from ("" when unknown)


def _run_end_status(events: Iterable[TraceEvent]) -> str | None:
    for e in events:
        if e.get("name") == "run_end" and e.get("ph") == "i":
            args = e.get("args")
            if isinstance(args, dict) and isinstance(args.get("status"), str):
                return str(args["status"])
    return None


def _status(data: RunData) -> tuple[str, str]:
    if data.summary is not None and isinstance(data.summary.get("status"), str):
        return str(data.summary["status"]), "summary.json"
    if data.events:
        status = _run_end_status(data.events)
        if status is not None:
            return status, "trace.json"
    live = is_live(data.run_dir)
    if live is not None:  # the run directory's lock says whether its process is still there
        return ("running", "lock held") if live else ("incomplete", "no summary.json, its process is gone")
    mtimes = [p.stat().st_mtime for p in (data.run_dir / "metrics.jsonl", data.run_dir / "trace.json") if p.exists()]
    if mtimes and time.time() - max(mtimes) < RUNNING_WINDOW_S:  # written before run directories had a lock
        return "running", "file times"
    return "incomplete", "no summary.json"


def _trace_end(events: Sequence[TraceEvent]) -> float | None:
    ends = [float(e["ts"]) / 1e6 + float(e.get("dur") or 0.0) / 1e6 for e in events  # type: ignore[arg-type]
            if e.get("ph") in ("X", "i") and _num(e.get("ts")) is not None]
    return max(ends) if ends else None


def _from_summary(data: RunData, key: str) -> tuple[bool, float | int | None]:
    if data.summary is None or key not in data.summary:
        return False, None
    value = data.summary[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True, None
    return True, value


def key_figures(data: RunData) -> list[KeyFigure]:
    """The report's table: summary.json's figure where it has one, else computed from the logs."""
    figures: list[KeyFigure] = []
    status, status_src = _status(data)
    figures.append(KeyFigure("status", "status", status, status, status_src))

    def add(key: str, label: str, summary_key: str | None, compute: Callable[[], tuple[float | int | None, str]],
            show: Callable[[float | int], str] = format_value) -> None:
        if summary_key is not None:
            found, value = _from_summary(data, summary_key)
            if found:
                figures.append(KeyFigure(key, label, value, "–" if value is None else show(value), "summary.json"))
                return
        value, source = compute()
        figures.append(KeyFigure(key, label, value, "–" if value is None else show(value), source if value is not None else ""))

    rows = data.metrics
    trace_spans = timeline.spans(data.events) if data.events else []

    def steps() -> tuple[float | int | None, str]:
        return (len(rows), "metrics.jsonl") if rows or (data.run_dir / "metrics.jsonl").exists() else (None, "")

    def wall() -> tuple[float | int | None, str]:
        end = _trace_end(data.events) if data.events else None
        if end is not None:
            return end, "trace.json"
        times = [t for t in (_num(r.get("step_time_sec")) for r in rows) if t is not None]
        return (sum(times), "metrics.jsonl (sum of step_time_sec)") if times else (None, "")

    def samples() -> tuple[float | int | None, str]:
        seconds, source = wall()
        # trace.json of a resumed run covers only the steps since the resume
        first = int(timeline.run_info(data.events or []).get("first_step", 0) or 0) if source == "trace.json" else 0  # type: ignore[call-overload]
        trained = [n for n in (_num(r.get("num_trajectories")) for r in rows if (_num(r.get("step")) or 0) >= first) if n is not None]
        if seconds is None or seconds <= 0 or not trained:
            return None, ""
        return sum(trained) / seconds, f"metrics.jsonl / {source}"

    def busy() -> tuple[float | int | None, str]:
        if not any(s.lane == "trainer" for s in trace_spans):
            return None, ""
        return timeline.trainer_busy_fraction(trace_spans), "trace.json"

    def gap() -> tuple[float | int | None, str]:
        gaps = [g for g in (_num(r.get("boundary_gap_sec")) for r in rows) if g is not None]
        return (statistics.median(gaps), "metrics.jsonl") if gaps else (None, "")

    accuracies = [a for a in (_num(r.get("accuracy")) for r in data.evals) if a is not None]

    def acc_before() -> tuple[float | int | None, str]:
        return (accuracies[0], "evals.jsonl") if accuracies else (None, "")

    def acc_after() -> tuple[float | int | None, str]:
        return (accuracies[-1], "evals.jsonl") if len(accuracies) > 1 else (None, "")

    def reward(index: int) -> Callable[[], tuple[float | int | None, str]]:
        def compute() -> tuple[float | int | None, str]:
            return (_num(rows[index].get("reward_mean")), "metrics.jsonl") if rows else (None, "")
        return compute

    def filtered() -> tuple[float | int | None, str]:
        counts = [n for n in (_num(r.get("filtered_groups")) for r in rows) if n is not None]
        return (int(sum(counts)), "metrics.jsonl") if counts else (None, "")

    add("steps", "steps", "steps_completed", steps)
    add("wall_time_s", "wall time", "wall_time_s", wall, lambda v: f"{v:.4g} s")
    add("samples_per_s", "samples/s", "samples_per_s", samples)
    add("trainer_busy_fraction", "trainer busy", "trainer_busy_fraction", busy, lambda v: f"{100 * v:.1f} %")
    add("boundary_gap_median_s", "median boundary gap", "boundary_gap_median_s", gap, lambda v: f"{1e3 * v:.4g} ms")
    add("accuracy_before", "held-out accuracy before", "accuracy_before", acc_before)
    add("accuracy_after", "held-out accuracy after", "accuracy_after", acc_after)
    add("reward_first", "first reward (mean)", "reward_mean_first", reward(0))
    add("reward_last", "last reward (mean)", "reward_mean_last", reward(-1))
    add("filtered_groups", "filtered groups", None, filtered)
    return figures


# ------------------------------------------------------------------------------------------ plots


def _series(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    """(x, y) of the rows where `key` is a number; x is the row's `step` (else its index)."""
    xs: list[float] = []
    ys: list[float] = []
    for i, row in enumerate(rows):
        y = _num(row.get(key))
        if y is None:
            continue
        step = _num(row.get("step"))
        xs.append(step if step is not None else float(i))
        ys.append(y)
    return xs, ys


def _new_figure(width: float, height: float) -> Figure:
    # The object-oriented API renders with Agg without importing pyplot, so the report neither
    # changes the process's matplotlib backend nor keeps figures alive in pyplot's registry.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _style(ax: Axes, title: str, xlabel: str, ylabel: str, integer_x: bool = False) -> None:
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if integer_x:  # steps and versions
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_reward(data: RunData, path: Path) -> str:
    xs, mean = _series(data.metrics, "reward_mean")
    evals = [(v, a) for v, a in ((_num(r.get("version")), _num(r.get("accuracy"))) for r in data.evals) if v is not None and a is not None]
    if not xs and not evals:
        raise PlotSkipped("no reward_mean in metrics.jsonl and no evals.jsonl")
    fig = _new_figure(9, 4)
    ax = fig.add_subplot()
    handles: list[Artist] = []
    if xs:
        (line,) = ax.plot(xs, mean, color="#1f77b4", marker="o", markersize=3, label="reward (mean of the step's trajectories)")
        handles.append(line)
        std_x, std = _series(data.metrics, "reward_std")
        if std_x == xs:
            band = ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                   color="#1f77b4", alpha=0.18, label="± reward std")
            handles.append(band)
    _style(ax, "Reward and held-out accuracy" if evals else "Reward", "step (reward) · policy version (accuracy)", "reward", True)
    if evals:
        acc_ax = ax.twinx() if xs else ax
        (acc_line,) = acc_ax.plot([v for v, _ in evals], [a for _, a in evals], color="#2ca02c", marker="s", markersize=5,
                                  linewidth=2, label="held-out accuracy (evals.jsonl)")
        acc_ax.set_ylabel("held-out accuracy")
        acc_ax.set_ylim(-0.02, 1.02)
        handles.append(acc_line)
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    fig.savefig(path, dpi=100)
    note = "Band: ± one standard deviation of the step's rewards."
    return note if evals else note + " No held-out evaluations in this run (evals.jsonl absent)."


def plot_step_time(data: RunData, path: Path) -> str:
    rows = data.metrics
    present = [(k, label, colour) for k, label, colour in STEP_COMPONENTS if any(_num(r.get(k)) is not None for r in rows)]
    totals = [_num(r.get("step_time_sec")) for r in rows]
    has_total = any(t is not None for t in totals)
    if not present and not has_total:
        raise PlotSkipped("metrics.jsonl has neither step_time_sec nor any step-time component")
    steps = [s if (s := _num(r.get("step"))) is not None else float(i) for i, r in enumerate(rows)]
    fig = _new_figure(9, 4)
    ax = fig.add_subplot()
    bottom = [0.0] * len(rows)
    spacing = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    width = 0.8 * min(spacing) if spacing else 0.8
    for key, label, colour in present:
        values = [max(0.0, _num(r.get(key)) or 0.0) for r in rows]
        ax.bar(steps, values, width, bottom=bottom, color=colour, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    missing = [label for k, label, _ in STEP_COMPONENTS if k not in {p[0] for p in present}]
    if has_total:
        other = [max(0.0, t - b) if t is not None else 0.0 for t, b in zip(totals, bottom)]
        ax.bar(steps, other, width, bottom=bottom, color=OTHER_COLOUR, label="other (step time − the rest)")
        ax.plot([s for s, t in zip(steps, totals) if t is not None], [t for t in totals if t is not None], linestyle="none",
                marker="_", markersize=12, color="black", label="step_time_sec")
    _style(ax, "Step time breakdown", "step", "seconds", True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.savefig(path, dpi=100)
    note = "Stacked per step; the black tick is step_time_sec (commit to commit)."
    over = sum(1 for t, b in zip(totals, bottom) if t is not None and b > 1.02 * t)
    if over:
        note += (f" In {over} step(s) the parts add up to more than step_time_sec: packing and weight sync can"
                 " run while the trainer computes, so their bars show work done, not trainer time lost.")
    return note + (f" Not in metrics.jsonl: {', '.join(missing)}." if missing else "")


def _lane_key(lane: str) -> tuple[int, int, str]:
    if lane in LANE_ORDER:
        return (0, LANE_ORDER.index(lane), lane)
    if lane.startswith("sampler/") and lane[len("sampler/"):].isdigit():
        return (1, int(lane[len("sampler/"):]), lane)
    return (2, 0, lane)


def _span_colours(names: Iterable[str]) -> dict[str, str]:
    colours: dict[str, str] = {}
    extra = 0
    for name in names:
        if name in SPAN_COLOURS:
            colours[name] = SPAN_COLOURS[name]
        elif name not in colours:
            colours[name] = FALLBACK_COLOURS[extra % len(FALLBACK_COLOURS)]
            extra += 1
    return colours


def timeline_window(all_spans: Sequence[timeline.Span], steps: int = GANTT_STEPS) -> tuple[float, float, list[int]]:
    """(start, end, steps shown): from the first train_step of the last `steps` steps that trained
    to the end of the trace; the whole trace when the run has no more steps than that."""
    end = max(s.end for s in all_spans)
    trained = sorted({s.step for s in all_spans if s.lane == "trainer" and s.name == "train_step"})
    if len(trained) <= steps:
        return min(s.start for s in all_spans), end, trained
    shown = trained[-steps:]
    start = min(s.start for s in all_spans if s.lane == "trainer" and s.name == "train_step" and s.step == shown[0])
    before = [s.start for s in all_spans if s.lane == "trainer" and s.name == "optim_step" and s.step == shown[0] - 1]
    return (min(before) if before else start), end, shown  # from the previous commit, to show its boundary


def plot_timeline(data: RunData, path: Path) -> str:
    if data.events is None:
        raise PlotSkipped("no trace.json")
    all_spans = timeline.spans(data.events)
    if not all_spans:
        raise PlotSkipped("trace.json has no spans yet")
    start, end, shown = timeline_window(all_spans)
    length = max(end - start, 1e-6)
    pad = 0.03 * length  # room for a commit label at either edge
    visible = [s for s in all_spans if s.end >= start and s.start <= end]
    lanes = sorted({s.lane for s in all_spans}, key=_lane_key)
    names = sorted({s.name for s in visible}, key=lambda n: (list(SPAN_COLOURS).index(n) if n in SPAN_COLOURS else len(SPAN_COLOURS), n))
    colours = _span_colours(names)
    fig = _new_figure(13, 1.5 + 0.55 * len(lanes))
    ax = fig.add_subplot()
    min_width = 0.002 * length  # sub-millisecond spans (pack) stay visible as ticks
    for row, lane in enumerate(lanes):
        for name in names:
            bars = [(max(s.start, start), max(min(s.end, end) - max(s.start, start), min_width))
                    for s in visible if s.lane == lane and s.name == name]
            if bars:
                ax.broken_barh(bars, (row - 0.38, 0.76), facecolors=colours[name], edgecolors="white", linewidth=0.4)
    for s in visible:  # label the trainer's spans when there is room
        if s.lane == "trainer" and s.dur > 0.035 * length:
            label = f"{s.step}.{s.args.get('microbatch')}" if s.name == "train_step" else f"optim {s.step}"
            ax.text(max(s.start, start) + s.dur / 2, lanes.index("trainer"), label, ha="center", va="center", fontsize=6,
                    color="white", clip_on=True)
    for s in visible:  # commits: where step N ends and N+1's boundary starts
        if s.lane == "trainer" and s.name == "optim_step" and start <= s.end <= end:
            ax.axvline(s.end, color="black", linestyle=":", linewidth=0.8, alpha=0.6)
            ax.text(s.end, -0.62, f"commit {s.step}", fontsize=7, ha="center", va="bottom", clip_on=True)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.75)
    ax.set_xlim(start - pad, end + pad)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colours[n], label=n) for n in names], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    what = f"steps {shown[0]}–{shown[-1]}" if shown else "whole trace"
    _style(ax, f"Trainer timeline ({what}, t = {start:.4g}–{end:.4g} s)", "seconds since the run started", "")
    ax.grid(True, axis="x", alpha=0.3)
    ax.grid(False, axis="y")
    fig.savefig(path, dpi=110)
    return (f"Spans of trace.json, {what}; labels on the trainer lane are step.microbatch. Spans shorter than "
            f"{1e3 * min_width:.2f} ms are drawn at that width. Bookkeeping and get_metrics of step N run while "
            "step N+1 trains.")


def plot_padding(data: RunData, path: Path) -> str:
    xs, ys = _series(data.metrics, "padding_efficiency")
    if not xs:
        raise PlotSkipped("no padding_efficiency in metrics.jsonl")
    fig = _new_figure(9, 3.2)
    ax = fig.add_subplot()
    ax.plot(xs, ys, color="#ff7f0e", marker="o", markersize=3)
    mean = sum(ys) / len(ys)
    ax.axhline(mean, color="grey", linestyle="--", linewidth=0.8, label=f"mean {mean:.4g}")
    ax.set_ylim(min(0.0, min(ys)) if min(ys) < 0.5 else min(ys) - 0.05, 1.01)
    _style(ax, "Padding efficiency (real tokens / padded tokens)", "step", "efficiency", True)
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=100)
    return f"Mean {mean:.4g} over {len(ys)} step(s)."


def plot_staleness(data: RunData, path: Path) -> str:
    if data.trajectories is None:
        raise PlotSkipped("no trajectory log (trajectories.parquet, trajectories/*.parquet or trajectories.jsonl)")
    trained = [r for r in data.trajectories if r.get("status") in TRAINED_STATUSES]
    values = [int(v) for v in (_num(r.get("staleness")) for r in trained) if v is not None]
    if not values:
        raise PlotSkipped(f"{data.trajectory_source} has no trained trajectories with a staleness")
    filtered = sum(1 for r in data.trajectories if str(r.get("status", "")).startswith("filtered"))
    counts = Counter(values)
    keys = list(range(min(counts), max(counts) + 1))
    fig = _new_figure(6, 3.2)
    ax = fig.add_subplot()
    bars = ax.bar(keys, [counts.get(k, 0) for k in keys], 0.8, color="#9467bd")
    ax.bar_label(bars, fontsize=8)
    ax.margins(y=0.12)
    ax.set_xticks(keys)
    _style(ax, "Staleness of trained trajectories", "staleness (trained version − sampling version)", "trajectories")
    ax.grid(False, axis="x")
    fig.savefig(path, dpi=100)
    return f"{len(values)} trained trajectories from {data.trajectory_source}; {filtered} filtered ones not shown."


@dataclass(slots=True, frozen=True)
class PlotSpec:
    name: str  # PNG file stem
    title: str
    draw: Callable[[RunData, Path], str]  # writes the PNG, returns a caption; raises PlotSkipped


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Reward and held-out accuracy", plot_reward),
    PlotSpec("step_time", "Step time breakdown", plot_step_time),
    PlotSpec("timeline", "Trainer timeline", plot_timeline),
    PlotSpec("padding", "Padding efficiency", plot_padding),
    PlotSpec("staleness", "Staleness", plot_staleness),
)


@dataclass(slots=True, frozen=True)
class PlotResult:
    spec: PlotSpec
    png: Path | None  # None: skipped
    note: str


def render_plots(data: RunData, out_dir: Path) -> list[PlotResult]:
    """Draw every plot into `out_dir`; a plot that cannot be drawn is skipped with its reason and
    its PNG from an earlier report removed, so the files always match the HTML."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[PlotResult] = []
    for spec in PLOTS:
        png = out_dir / f"{spec.name}.png"
        try:
            note = spec.draw(data, png)
            results.append(PlotResult(spec, png, note))
        except PlotSkipped as skip:
            png.unlink(missing_ok=True)
            results.append(PlotResult(spec, None, f"skipped: {skip}"))
        except Exception as exc:  # one bad plot must not cost the rest of the report
            png.unlink(missing_ok=True)
            results.append(PlotResult(spec, None, f"skipped: could not be drawn ({type(exc).__name__}: {exc})"))
    return results


# ------------------------------------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 1250px; color: #222; }
h1 { margin-bottom: 0.2em; } .sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 3px 10px; text-align: left; }
th { background: #f4f4f4; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.src { color: #888; font-size: 0.85em; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; } .skip { color: #a33; } .error { color: #a00; font-weight: 600; }
.cols { columns: 2; column-gap: 2em; } .notes li { color: #a60; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _figures_table(figures: Sequence[KeyFigure]) -> str:
    rows = []
    for f in figures:
        raw = "" if f.value is None else json.dumps(f.value)
        rows.append(f'<tr data-key="{_e(f.key)}"><th>{_e(f.label)}</th>'
                    f'<td class="num" data-value="{_e(raw)}">{_e(f.text)}</td><td class="src">{_e(f.source)}</td></tr>')
    return '<table class="figures"><tr><th>figure</th><th>value</th><th>from</th></tr>' + "".join(rows) + "</table>"


def _last_row_table(rows: Sequence[Row]) -> str:
    if not rows:
        return '<p class="skip">metrics.jsonl has no complete row yet.</p>'
    last = rows[-1]
    cells = "".join(f'<tr data-key="{_e(k)}"><th>{_e(k)}</th><td class="num" data-value="{_e(json.dumps(v))}">{_e(format_value(v))}</td></tr>'
                    for k, v in last.items())
    return f'<div class="cols"><table class="last-metrics">{cells}</table></div>'


def _ledger_table(summary: Row | None) -> str:
    ledger = summary.get("ledger") if summary else None
    if not isinstance(ledger, dict):
        return ""
    cells = "".join(f"<tr><th>{_e(k)}</th><td class=\"num\">{_e(json.dumps(v) if isinstance(v, dict) else format_value(v))}</td></tr>"
                    for k, v in ledger.items())
    return f"<h2>Ledger</h2><table class=\"ledger\">{cells}</table>"


def _plot_html(result: PlotResult, run_dir: Path) -> str:
    title = _e(result.spec.title)
    if result.png is None:
        return f'<section><h2>{title}</h2><p class="skip">{_e(result.note)}</p></section>'
    rel = result.png.relative_to(run_dir).as_posix()
    data_uri = "data:image/png;base64," + base64.b64encode(result.png.read_bytes()).decode("ascii")
    return (f'<section><h2>{title}</h2><figure><a href="{_e(rel)}"><img src="{data_uri}" alt="{title}"></a>'
            f'<figcaption>{_e(result.note)} <a href="{_e(rel)}">{_e(rel)}</a></figcaption></figure></section>')


def render_html(data: RunData, figures: Sequence[KeyFigure], plots: Sequence[PlotResult]) -> str:
    name = data.run_dir.resolve().name
    status = next((f.text for f in figures if f.key == "status"), "")
    error = data.summary.get("error") if data.summary else None
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>relayrl report — {_e(name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>relayrl run <code>{_e(name)}</code></h1>",
        f'<p class="sub">status <b>{_e(status)}</b> · {len(data.metrics)} step(s) in metrics.jsonl · report written {when}</p>',
    ]
    if error:
        parts.append(f'<p class="error">error: {_e(error)}</p>')
    if data.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in data.notes) + "</ul>")
    parts.append("<h2>Key figures</h2>" + _figures_table(figures))
    parts.extend(_plot_html(p, data.run_dir) for p in plots)
    parts.append(_ledger_table(data.summary))
    step = data.metrics[-1].get("step") if data.metrics else None
    parts.append(f"<h2>Last metrics row (step {_e(format_value(step))})</h2>" + _last_row_table(data.metrics))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(run_dir: Path) -> Path:
    """Write `run_dir/report.html` and its PNGs under `run_dir/report/`; returns the HTML's path.
    Works on a finished, a crashed and a still running run. Writes nothing and raises
    FileNotFoundError naming the directory when it does not exist or holds none of `RUN_FILES`,
    and ValueError naming the file and event when its trace.json is not a trace."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not is_run_dir(run_dir):  # checked before anything is written into it
        raise FileNotFoundError(f"{run_dir}: not a run directory (no {', '.join(RUN_FILES)})")
    data = load_run(run_dir, strict=True)
    figures = key_figures(data)
    plots = render_plots(data, run_dir / REPORT_DIR)
    out = run_dir / REPORT_HTML
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render_html(data, figures, plots), encoding="utf-8")
    os.replace(tmp, out)  # a reader never sees a half-written report
    return out


# ------------------------------------------------------------------------------------------- runs

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
    for key in ("status", "steps", "wall_time_s", "samples_per_s", "trainer_busy_fraction", "accuracy_before", "accuracy_after", "reward_last"):
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
