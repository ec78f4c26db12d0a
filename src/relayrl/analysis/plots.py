"""The report's plots: matplotlib figures drawn from a `RunData` into PNG files.

Invariant: a plot is drawn only from what the run's files hold (`RunData`), through matplotlib's
object-oriented API (no pyplot: the process's backend and figure registry are left alone); a plot
the files cannot support raises `PlotSkipped` with the reason, and `render_plots` never lets one
plot cost the others — a skipped plot's PNG from an earlier report is removed, so the PNGs on disk
always match the plots listed. Stacked step-time bars show only time the trainer is exposed to,
so no bar rises above the step's `step_time_sec`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from relayrl.analysis import timeline
from relayrl.analysis.rundata import Row, RunData, finite

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

GANTT_STEPS = 4  # the timeline plot shows the last few steps, enough to see the boundary
TRAINED_STATUSES = frozenset({"ok", "failed"})  # trajectory-log statuses of trained trajectories

# Waiting for data (the trainer's wait for a step's groups) is expected in a pipeline whose samplers
# set its pace: drawn in a neutral colour, never an alarm colour.
WAIT_COLOUR = "#b5a98f"

# Step-time components (metrics.jsonl key, label, colour). Only exposed time is stacked — time the
# trainer spends computing or waiting — so a bar never rises above step_time_sec (commit to commit):
# - training: train_time, the trainer's train_step calls;
# - optimizer: optim_time, the optim_step call (with train.ppo_epochs / minibatches_per_step > 1,
#   the step's further passes run inside it);
# - waiting for data: exposed_generation_time, waiting for the step's groups (part of the gap);
# - rest of the boundary gap: boundary_gap_sec (commit to the next train_step) minus that wait;
# - other: step_time_sec minus the above (waits between micro-batches).
# Packing and weight sync run while the trainer computes: they are drawn as markers, not stacked.
STEP_COMPONENTS: tuple[tuple[str, str, str], ...] = (
    ("train_time", "training", "#1f77b4"),
    ("optim_time", "optimizer update(s)", "#17becf"),
    ("exposed_generation_time", "waiting for data (expected while samples are generated)", WAIT_COLOUR),
    ("boundary_gap_sec", "rest of the boundary gap", "#ff7f0e"),
)
OVERLAPPED_COMPONENTS: tuple[tuple[str, str, str], ...] = (
    ("packing_time", "packing (overlaps training)", "#bcbd22"),
    ("weight_sync_time", "weight sync (overlaps training)", "#9467bd"),
)
OTHER_COLOUR = "#c7c7c7"

# Timeline colours by span name; names not listed take colours from FALLBACK_COLOURS in order.
SPAN_COLOURS: dict[str, str] = {
    "train_step": "#1f77b4",
    "optim_step": "#0b2e59",
    "get_metrics": "#17becf",
    "pack": "#ff7f0e",
    "wait_data": WAIT_COLOUR,
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
LANE_ORDER = ("trainer", "actor:trainer", "trainer.fetch", "orchestrator", "bookkeeping", "eval")


class PlotSkipped(Exception):
    """A plot cannot be drawn from this run's files; the message says why."""


def _series(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    """(x, y) of the rows where `key` is a number; x is the row's `step` (else its index)."""
    xs: list[float] = []
    ys: list[float] = []
    for i, row in enumerate(rows):
        y = finite(row.get(key))
        if y is None:
            continue
        step = finite(row.get("step"))
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


def _eval_series(data: RunData, key: str) -> tuple[list[float], list[float]]:
    """(policy version, value) of the evals.jsonl rows where `key` is a number."""
    pairs = [(finite(r.get("version")), finite(r.get(key))) for r in data.evals]
    kept = [(v, y) for v, y in pairs if v is not None and y is not None]
    return [v for v, _ in kept], [y for _, y in kept]


def plot_reward(data: RunData, path: Path) -> str:
    """Reward (top panel) and held-out accuracy (bottom panel): two figures on two axes."""
    xs, mean = _series(data.metrics, "reward_mean")
    eval_x, accuracy = _eval_series(data, "accuracy")
    heldout_x, heldout_reward = _eval_series(data, "reward_mean")
    if not xs and not eval_x:
        raise PlotSkipped("no reward_mean in metrics.jsonl and no evals.jsonl")
    fig = _new_figure(9, 6.5 if eval_x else 4)
    if eval_x:
        ax, acc_ax = fig.subplots(2, 1, sharex=True)
    else:
        ax, acc_ax = fig.add_subplot(), None
    if xs:
        ax.plot(xs, mean, color="#1f77b4", marker="o", markersize=3, label="reward (mean of the step's trajectories)")
        std_x, std = _series(data.metrics, "reward_std")
        if std_x == xs:
            ax.fill_between(
                xs,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color="#1f77b4",
                alpha=0.18,
                label="± reward std",
            )
    if heldout_x:
        ax.plot(
            heldout_x, heldout_reward, color="#17becf", marker="D", markersize=5, linewidth=1.5, label="held-out mean reward (evals.jsonl)"
        )
    _style(ax, "Reward", "" if acc_ax is not None else "step", "reward", True)
    ax.legend(loc="upper left", fontsize=8)
    if acc_ax is not None:
        acc_ax.plot(eval_x, accuracy, color="#2ca02c", marker="s", markersize=5, linewidth=2, label="held-out accuracy (evals.jsonl)")
        first_x, first = _eval_series(data, "first_turn_accuracy")
        if first_x:
            acc_ax.plot(first_x, first, color="#98df8a", marker="^", markersize=5, linewidth=1.5, label="first-turn accuracy (evals.jsonl)")
        _style(acc_ax, "Held-out accuracy (the task's correctness check)", "step (reward) · policy version (held-out)", "accuracy", True)
        acc_ax.set_ylim(-0.02, 1.02)
        acc_ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=100)
    note = "Band: ± one standard deviation of the step's rewards."
    if not eval_x:
        return note + " No held-out evaluations in this run (evals.jsonl absent)."
    return note + (
        " Held-out accuracy is the share of held-out prompts the task's own check counts correct; the held-out mean"
        " reward is the run's reward functions on the same greedy completions."
    )


def is_multiturn(data: RunData) -> bool:
    """Whether the run played multi-turn episodes (its metrics or evaluations have turn figures)."""
    return any("turns_mean" in r for r in data.metrics) or any("mean_turns" in r for r in data.evals)


def plot_multiturn(data: RunData, path: Path) -> str:
    """Multi-turn runs: turns per episode (left) and first-turn solved rate (right), per step
    (sampled episodes) and per evaluated version (greedy held-out episodes)."""
    turn_x, turns = _series(data.metrics, "turns_mean")
    solved_x, solved = _series(data.metrics, "first_turn_solved_rate")
    eval_turn_x, eval_turns = _eval_series(data, "mean_turns")
    eval_first_x, eval_first = _eval_series(data, "first_turn_accuracy")
    if not (turn_x or solved_x or eval_turn_x or eval_first_x):
        raise PlotSkipped("no turns_mean or first_turn_solved_rate in metrics.jsonl and no multi-turn evaluations")
    fig = _new_figure(11, 4)
    turns_ax, solved_ax = fig.subplots(1, 2)
    turns_ax.plot(turn_x, turns, color="#1f77b4", marker="o", markersize=3, label="sampled episodes (metrics.jsonl)")
    if eval_turn_x:
        turns_ax.plot(eval_turn_x, eval_turns, color="#2ca02c", marker="s", markersize=5, label="held-out, greedy (evals.jsonl)")
    _style(turns_ax, "Turns per episode", "step · policy version (held-out)", "policy turns", True)
    turns_ax.legend(loc="upper right", fontsize=8)
    solved_ax.plot(solved_x, solved, color="#1f77b4", marker="o", markersize=3, label="sampled episodes (metrics.jsonl)")
    if eval_first_x:
        solved_ax.plot(eval_first_x, eval_first, color="#2ca02c", marker="s", markersize=5, label="held-out, greedy (evals.jsonl)")
    _style(solved_ax, "First-turn solved rate", "step · policy version (held-out)", "solved by the first action", True)
    solved_ax.set_ylim(-0.02, 1.02)
    solved_ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=100)
    return "Per step: the mean over the step's sampled episodes; per evaluation: the greedy held-out episodes."


@dataclass(slots=True, frozen=True)
class StepTimeStack:
    """The step-time plot's data: per step, the stacked exposed parts (each >= 0, their sum <= the
    step's step_time_sec where that is known), the remainder, and the overlapped work unstacked."""

    steps: list[float]
    layers: list[tuple[str, str, str, list[float]]]  # (key, label, colour, values), bottom first
    other: list[float] | None  # step_time_sec minus the layers; None without any step_time_sec
    totals: list[float | None]  # step_time_sec
    overlapped: list[tuple[str, str, str, list[float | None]]]  # drawn as markers, not stacked
    missing: list[str]  # labels of components metrics.jsonl does not have


def step_time_stack(rows: Sequence[Row]) -> StepTimeStack:
    """Split each step's step_time_sec into exposed parts (see STEP_COMPONENTS): training, the optimizer, then
    exposed generation, then the rest of the boundary gap, each clipped to what is left of the
    step, and `other` for the remainder."""
    steps = [s if (s := finite(r.get("step"))) is not None else float(i) for i, r in enumerate(rows)]
    totals = [finite(r.get("step_time_sec")) for r in rows]
    has = {key: any(finite(r.get(key)) is not None for r in rows) for key, _, _ in (*STEP_COMPONENTS, *OVERLAPPED_COMPONENTS)}
    bottom = [0.0] * len(rows)
    layers: list[tuple[str, str, str, list[float]]] = []
    for key, label, colour in STEP_COMPONENTS:
        if not has[key]:
            continue
        values: list[float] = []
        for i, row in enumerate(rows):
            value = max(0.0, finite(row.get(key)) or 0.0)
            if key == "boundary_gap_sec":  # the gap includes the wait for groups: stack only the rest
                wait = max(0.0, finite(row.get("exposed_generation_time")) or 0.0)
                value = max(0.0, value - wait)
            total = totals[i]
            if total is not None:
                value = min(value, max(0.0, total - bottom[i]))
            values.append(value)
        bottom = [b + v for b, v in zip(bottom, values)]
        layers.append((key, label, colour, values))
    other = [max(0.0, t - b) if t is not None else 0.0 for t, b in zip(totals, bottom)] if any(t is not None for t in totals) else None
    overlapped = [(key, label, colour, [finite(r.get(key)) for r in rows]) for key, label, colour in OVERLAPPED_COMPONENTS if has[key]]
    missing = [label for key, label, _ in (*STEP_COMPONENTS, *OVERLAPPED_COMPONENTS) if not has[key]]
    return StepTimeStack(steps, layers, other, totals, overlapped, missing)


def plot_step_time(data: RunData, path: Path) -> str:
    stack = step_time_stack(data.metrics)
    if not stack.layers and stack.other is None and not stack.overlapped:
        raise PlotSkipped("metrics.jsonl has neither step_time_sec nor any step-time component")
    fig = _new_figure(9, 4)
    ax = fig.add_subplot()
    steps = stack.steps
    bottom = [0.0] * len(steps)
    spacing = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    width = 0.8 * min(spacing) if spacing else 0.8
    for _, label, colour, values in stack.layers:
        ax.bar(steps, values, width, bottom=bottom, color=colour, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    if stack.other is not None:
        ax.bar(steps, stack.other, width, bottom=bottom, color=OTHER_COLOUR, label="other (optim step, waits between micro-batches)")
        ax.plot(
            [s for s, t in zip(steps, stack.totals) if t is not None],
            [t for t in stack.totals if t is not None],
            linestyle="none",
            marker="_",
            markersize=12,
            color="black",
            label="step_time_sec",
        )
    for _, label, colour, series in stack.overlapped:
        ax.plot(
            [s for s, v in zip(steps, series) if v is not None],
            [v for v in series if v is not None],
            linestyle="none",
            marker="o",
            markersize=4,
            markerfacecolor="none",
            color=colour,
            label=label,
        )
    _style(ax, "Step time breakdown", "step", "seconds", True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.savefig(path, dpi=100)
    note = (
        "Stacked per step: the time the trainer computes or waits, adding up to step_time_sec (the black tick, commit"
        " to commit). Packing and weight sync overlap training, so they are drawn as open markers, not stacked."
    )
    return note + (f" Not in metrics.jsonl: {', '.join(stack.missing)}." if stack.missing else "")


def _lane_key(lane: str) -> tuple[int, int, bool, str]:
    if lane in LANE_ORDER:
        return (0, LANE_ORDER.index(lane), False, lane)
    replica = lane.removeprefix("actor:").removeprefix("sampler/")
    if lane.removeprefix("actor:").startswith("sampler/") and replica.isdigit():
        return (1, int(replica), lane.startswith("actor:"), lane)  # a Ray sampler actor's lane below its replica's
    return (2, 0, False, lane)


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
            bars = [
                (max(s.start, start), max(min(s.end, end) - max(s.start, start), min_width))
                for s in visible
                if s.lane == lane and s.name == name
            ]
            if bars:
                ax.broken_barh(bars, (row - 0.38, 0.76), facecolors=colours[name], edgecolors="white", linewidth=0.4)
    for s in visible:  # label the trainer's spans when there is room
        if s.lane == "trainer" and s.dur > 0.035 * length:
            label = f"{s.step}.{s.args.get('microbatch')}" if s.name == "train_step" else f"optim {s.step}"
            ax.text(
                max(s.start, start) + s.dur / 2,
                lanes.index("trainer"),
                label,
                ha="center",
                va="center",
                fontsize=6,
                color="white",
                clip_on=True,
            )
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
    return (
        f"Spans of trace.json, {what}; labels on the trainer lane are step.microbatch. Spans shorter than "
        f"{1e3 * min_width:.2f} ms are drawn at that width. Bookkeeping and get_metrics of step N run while "
        "step N+1 trains."
    )


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
    values = [int(v) for v in (finite(r.get("staleness")) for r in trained) if v is not None]
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
    applies: Callable[[RunData], bool] | None = None  # None: every run; False: not listed at all


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Reward and held-out accuracy", plot_reward),
    PlotSpec("multiturn", "Multi-turn episodes", plot_multiturn, is_multiturn),
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
        if spec.applies is not None and not spec.applies(data):  # not this kind of run: no entry, no PNG
            png.unlink(missing_ok=True)
            continue
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
