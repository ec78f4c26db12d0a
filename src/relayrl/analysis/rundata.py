"""Reading a run directory: its files as `RunData`, and the key figures computed from them.

Invariant: reading never writes and never fails on a run still going or one that crashed (no
summary.json, a trace cut off mid-event, a partial last line of a JSONL file): what cannot be read
is left out with a note in `RunData.notes`. Only a trace.json that is not a trace (garbage, not a
crash's cut-off prefix) raises, and only with `strict`. Every key figure comes from the run's
files — summary.json where it has the figure, else computed from metrics.jsonl, the trace or
evals.jsonl — and names the file it comes from.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.analysis import timeline
from relayrl.rundir import jsonl
from relayrl.rundir.lock import is_live
from relayrl.telemetry import trajlog
from relayrl.telemetry.tracer import TraceEvent, load_trace

Row = dict[str, object]

RUNNING_WINDOW_S = 300.0  # a run without summary.json whose logs changed this recently is "running"
TRAJECTORY_COLUMNS = ("step", "staleness", "status", "reward", "policy_version")


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
    samples: list[Sample] = field(default_factory=list)  # best and worst completions of sampled steps (read_samples)
    notes: list[str] = field(default_factory=list)


def read_jsonl(path: Path) -> tuple[list[Row], int]:
    """Rows of a JSON-lines file and the number of lines skipped. A last line that does not parse
    (a writer mid-line, or a crash) is dropped silently; other bad lines are skipped and counted."""
    if not path.exists():
        return [], 0
    return jsonl.read_rows(path, strict=False)  # rows end at "\n" only (see relayrl.rundir.jsonl)


def read_trajectories(run_dir: Path, columns: Sequence[str] = TRAJECTORY_COLUMNS) -> tuple[list[Row], str] | None:
    """The trajectory log's rows (only `columns`) and where they came from; None without a log.
    Only closed files are visible (the open one is hidden until renamed), so a live or crashed
    run reads cleanly: every step in a closed file."""
    files = trajlog.log_files(run_dir)
    if not files:
        return None
    table = trajlog.read_trajectories(run_dir).select(list(columns))
    count = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    return table.to_pylist(), f"trajectories/ ({count}, steps {files[0].first}–{max(f.last for f in files)})"


SAMPLE_STEPS = 10  # the samples table shows up to this many steps, evenly spaced
SAMPLE_CHARS = 300  # prompt and completion texts are cut to this many characters


@dataclass(slots=True, frozen=True)
class Sample:
    """One completion of the samples table: the best or the worst reward of its step."""

    step: int
    which: str  # "best" or "worst"
    reward: float
    prompt: str
    completion: str


def _cut(text: object, limit: int = SAMPLE_CHARS) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def even_picks(items: Sequence[int], count: int) -> list[int]:
    """Up to `count` of `items`, evenly spaced, the first and the last included."""
    if len(items) <= count:
        return list(items)
    if count <= 1:
        return [items[-1]]
    return sorted({items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)})


def read_samples(run_dir: Path, steps: int = SAMPLE_STEPS) -> list[Sample]:
    """For up to `steps` logged steps, evenly spaced: the step's best and worst reward completion
    among its scored trajectories (status ok), texts cut to SAMPLE_CHARS. Reads the trajectory
    log's closed files: the step, status and reward columns, then the texts of the picked steps
    only (a filter on `step`, so a long run's other row groups are not read); [] without a log."""
    files = trajlog.log_files(run_dir)
    if not files:
        return []
    import pyarrow.parquet as pq

    def scored(rows: list[Row]) -> dict[int, list[Row]]:
        by_step: dict[int, list[Row]] = {}
        for r in rows:
            step, reward = r.get("step"), finite(r.get("reward"))
            if isinstance(step, int) and reward is not None and r.get("status") == "ok":
                by_step.setdefault(step, []).append(r)
        return by_step

    light: list[Row] = []
    for f in files:
        light.extend(pq.read_table(f.path, columns=["step", "status", "reward"]).to_pylist())
    picked = even_picks(sorted(scored(light)), steps)
    rows: list[Row] = []
    for f in files:
        wanted = [s for s in picked if f.first <= s <= f.last]
        if wanted:
            columns = ["step", "status", "reward", "prompt", "completion"]
            rows.extend(pq.read_table(f.path, columns=columns, filters=[("step", "in", wanted)]).to_pylist())
    by_step = scored(rows)
    out: list[Sample] = []
    for step in picked:
        ranked = sorted(by_step[step], key=lambda r: finite(r.get("reward")) or 0.0)
        for which, r in (("best", ranked[-1]), ("worst", ranked[0])):
            out.append(Sample(step, which, finite(r.get("reward")) or 0.0, _cut(r.get("prompt")), _cut(r.get("completion"))))
    return out


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
            try:
                data.samples = read_samples(run_dir)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                data.notes.append(f"trajectory log: samples not read ({' '.join(str(exc).split())})")
    return data


def finite(value: object) -> float | None:
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
    ends = [
        (ts + (finite(e.get("dur")) or 0.0)) / 1e6 for e in events if e.get("ph") in ("X", "i") and (ts := finite(e.get("ts"))) is not None
    ]
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

    def add(
        key: str,
        label: str,
        summary_key: str | None,
        compute: Callable[[], tuple[float | int | None, str]],
        show: Callable[[float | int], str] = format_value,
    ) -> None:
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
        times = [t for t in (finite(r.get("step_time_sec")) for r in rows) if t is not None]
        return (sum(times), "metrics.jsonl (sum of step_time_sec)") if times else (None, "")

    def samples() -> tuple[float | int | None, str]:
        seconds, source = wall()
        # trace.json of a resumed run covers only the steps since the resume
        first = int(timeline.run_info(data.events or []).get("first_step", 0) or 0) if source == "trace.json" else 0  # type: ignore[call-overload]
        trained = [n for n in (finite(r.get("num_trajectories")) for r in rows if (finite(r.get("step")) or 0) >= first) if n is not None]
        if seconds is None or seconds <= 0 or not trained:
            return None, ""
        return sum(trained) / seconds, f"metrics.jsonl / {source}"

    def busy() -> tuple[float | int | None, str]:
        if not any(s.lane == "trainer" for s in trace_spans):
            return None, ""
        return timeline.trainer_busy_fraction(trace_spans), "trace.json"

    def gap() -> tuple[float | int | None, str]:
        gaps = [g for g in (finite(r.get("boundary_gap_sec")) for r in rows) if g is not None]
        return (statistics.median(gaps), "metrics.jsonl") if gaps else (None, "")

    accuracies = [a for a in (finite(r.get("accuracy")) for r in data.evals) if a is not None]

    def acc_before() -> tuple[float | int | None, str]:
        return (accuracies[0], "evals.jsonl") if accuracies else (None, "")

    def acc_after() -> tuple[float | int | None, str]:
        return (accuracies[-1], "evals.jsonl") if len(accuracies) > 1 else (None, "")

    heldout_rewards = [a for a in (finite(r.get("reward_mean")) for r in data.evals) if a is not None]

    def heldout_reward_before() -> tuple[float | int | None, str]:
        return (heldout_rewards[0], "evals.jsonl") if heldout_rewards else (None, "")

    def heldout_reward_after() -> tuple[float | int | None, str]:
        return (heldout_rewards[-1], "evals.jsonl") if len(heldout_rewards) > 1 else (None, "")

    def reward(index: int) -> Callable[[], tuple[float | int | None, str]]:
        def compute() -> tuple[float | int | None, str]:
            return (finite(rows[index].get("reward_mean")), "metrics.jsonl") if rows else (None, "")

        return compute

    def filtered() -> tuple[float | int | None, str]:
        counts = [n for n in (finite(r.get("filtered_groups")) for r in rows) if n is not None]
        return (int(sum(counts)), "metrics.jsonl") if counts else (None, "")

    add("steps", "steps", "steps_completed", steps)
    add("wall_time_s", "wall time", "wall_time_s", wall, lambda v: f"{v:.4g} s")
    add("samples_per_s", "samples/s", "samples_per_s", samples)
    add("trainer_busy_fraction", "trainer busy", "trainer_busy_fraction", busy, lambda v: f"{100 * v:.1f} %")
    add("boundary_gap_median_s", "median boundary gap", "boundary_gap_median_s", gap, lambda v: f"{1e3 * v:.4g} ms")
    add("accuracy_before", "held-out accuracy before", "accuracy_before", acc_before)
    add("accuracy_after", "held-out accuracy after", "accuracy_after", acc_after)
    add("heldout_reward_mean_before", "held-out mean reward before", "heldout_reward_mean_before", heldout_reward_before)
    add("heldout_reward_mean_after", "held-out mean reward after", "heldout_reward_mean_after", heldout_reward_after)
    add("reward_first", "first reward (mean)", "reward_mean_first", reward(0))
    add("reward_last", "last reward (mean)", "reward_mean_last", reward(-1))
    add("filtered_groups", "filtered groups", None, filtered)

    def gpu_peak(key: str) -> Callable[[], tuple[float | int | None, str]]:
        def figure() -> tuple[float | int | None, str]:
            peaks = [p for p in (finite(r.get(key)) for r in rows) if p is not None]
            return (max(peaks), f"metrics.jsonl (max of {key})") if peaks else (None, "")

        return figure

    # (CUDA workers: absent on the CPU)
    for key, name, label in (("train/gpu_mem_peak_gb", "train", "trainer"), ("rollout/gpu_mem_peak_gb", "rollout", "samplers'")):
        if any(key in r for r in rows):
            add(f"{name}_gpu_mem_peak_gb", f"{label} peak GPU memory", None, gpu_peak(key), lambda v: f"{v:.3g} GiB")
    return figures
