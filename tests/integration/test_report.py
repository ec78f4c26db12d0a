"""The run report: PNGs that decode, an HTML that references them and shows the run's own numbers,
and the same on a run still going, a crashed run and a run missing columns; `list_runs`."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from relayrl.analysis import timeline
from relayrl.analysis.plots import PLOTS, SPAN_COLOURS, step_time_stack, timeline_window
from relayrl.analysis.report import write_report
from relayrl.analysis.rundata import load_run, read_jsonl
from relayrl.analysis.runlist import list_runs, runs_text
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.tracer import load_trace
from relayrl.types import StepResult

PNG_NAMES = [p.name for p in PLOTS if p.applies is None]  # every run's plots (not the multi-turn one)
OVERRIDES = [
    "run.steps=6",
    "orchestrator.release_memory=false",
    "rollout.groups_per_step=4",
    "rollout.num_generations=4",
    "train.row_tokens=64",
    "train.rows_per_microbatch=2",
    "sim.train_step=0.03",  # visible training and bookkeeping on the Gantt chart
    "sim.reduce_metrics=0.01",
]


def _run(run_dir: Path, callbacks: list[Callback] | None = None) -> None:
    cfg = load_config(None, OVERRIDES)
    asyncio.run(asyncio.wait_for(build_program(cfg, callbacks or [], run_dir=run_dir).run(), 60))


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    _run(run_dir)
    return run_dir


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("report", "report.html"))
    return dst


def _metrics(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


class _Tables(HTMLParser):
    """data-key → (data-value, shown text) of the key-figures and last-metrics tables."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, tuple[str, str]] = {}
        self.last: dict[str, tuple[str, str]] = {}
        self.hrefs: list[str] = []
        self.srcs: list[str] = []
        self._table = ""
        self._key = ""
        self._value: str | None = None
        self._text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("class") or ""
        elif tag == "tr":
            self._key = a.get("data-key") or ""
        elif tag == "td" and "data-value" in a:
            self._value, self._text = a["data-value"] or "", ""
        elif tag == "a" and a.get("href"):
            self.hrefs.append(a["href"] or "")
        elif tag in ("img", "script", "link"):
            self.srcs.append(a.get("src") or a.get("href") or "")

    def handle_data(self, data: str) -> None:
        if self._value is not None:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._value is not None:
            target = self.figures if self._table == "figures" else self.last if self._table == "last-metrics" else None
            if target is not None and self._key:
                target[self._key] = (self._value, self._text)
            self._value = None


def _parse(html_path: Path) -> _Tables:
    parser = _Tables()
    parser.feed(html_path.read_text(encoding="utf-8"))
    return parser


def _assert_pngs(run_dir: Path, names: list[str], tables: _Tables) -> None:
    from PIL import Image

    for name in names:
        png = run_dir / "report" / f"{name}.png"
        with Image.open(png) as image:
            image.load()  # decodes the whole file
            assert image.format == "PNG" and image.width >= 400 and image.height >= 200, (name, image.size)
        assert f"report/{name}.png" in tables.hrefs, name


def test_report_of_a_finished_run(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path / "run")
    out = write_report(run_dir)
    assert out == run_dir / "report.html"
    tables = _parse(out)
    _assert_pngs(run_dir, PNG_NAMES, tables)
    # Opens offline: every image is embedded, nothing is fetched, no script.
    assert tables.srcs and all(s.startswith("data:image/png;base64,") for s in tables.srcs)
    assert "<script" not in out.read_text() and "http" not in "".join(tables.srcs)

    metrics = _metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    figures = tables.figures
    assert figures["status"][1] == "completed"
    assert figures["steps"][1] == str(len(metrics)) == str(summary["steps_completed"]) == "6"
    last_reward = metrics[-1]["reward_mean"]
    assert isinstance(last_reward, float)
    assert figures["reward_last"] == (json.dumps(last_reward), f"{last_reward:.4g}")
    assert figures["wall_time_s"][1] == f"{summary['wall_time_s']:.4g} s"
    assert figures["trainer_busy_fraction"][1] == f"{100 * summary['trainer_busy_fraction']:.1f} %"
    assert figures["accuracy_before"][1] == "–"  # the sim backend has no held-out evaluation
    # The last metrics row is shown as it is in metrics.jsonl.
    assert {k: json.loads(v) for k, (v, _) in tables.last.items()} == metrics[-1]
    assert tables.last["step"][1] == "6"


def test_timeline_shows_the_last_steps_with_bookkeeping_over_training(finished: Path) -> None:
    from PIL import Image

    all_spans = timeline.spans(load_trace(finished / "trace.json"))
    start, end, shown = timeline_window(all_spans)
    assert shown == [3, 4, 5, 6]
    # In that window, bookkeeping of step N runs while N+1 trains: the Gantt has something to show.
    training = [s for s in all_spans if s.name == "train_step" and start <= s.start <= end]
    book = [s for s in all_spans if s.lane == "bookkeeping" and start <= s.start <= end and s.step < 6]
    assert book and any(b.start < t.end and t.start < b.end for b in book for t in training)

    run_dir = finished  # render in place once more to look at the pixels
    write_report(run_dir)
    with Image.open(run_dir / "report" / "timeline.png") as image:
        plot_area = image.convert("RGB").crop((0, 0, int(0.8 * image.width), image.height))  # without the legend
        counted = plot_area.getcolors(maxcolors=1 << 22)
        assert counted is not None
        colours = {rgb: n for n, rgb in counted}

    def pixels(*hex_colours: str) -> int:
        return sum(colours.get(tuple(int(h[i : i + 2], 16) for i in (1, 3, 5)), 0) for h in hex_colours)

    assert pixels(SPAN_COLOURS["train_step"]) > 2000
    assert pixels(*(SPAN_COLOURS[n] for n in ("reduce_metrics", "log_metrics", "log_trajectories", "on_step_end", "release_memory"))) > 200


@contextmanager
def _live(run_dir: Path) -> Iterator[None]:
    """As while the run's process is alive: it holds the lock on the run directory's marker
    (when the run wrote one)."""
    marker = run_dir / ".relayrl-run"
    if not marker.exists():
        yield
        return
    with open(marker, "rb") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield


def test_report_of_a_run_still_going(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path / "live")
    full_summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()
    trace = run_dir / "trace.json"
    lines = trace.read_text().rstrip().splitlines()
    assert lines[-1] == "]" and '"run_end"' in lines[-2]
    text = "\n".join(lines[:-2])  # as while running: no run_end event, no closing bracket
    trace.write_text(text)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write('{"step":7,"policy_version":7,"step_time_sec":0.3,"reward_me')  # a line being written
    with _live(run_dir):
        out = write_report(run_dir)
    tables = _parse(out)
    _assert_pngs(run_dir, PNG_NAMES, tables)

    metrics = _metrics_complete(run_dir)
    figures = tables.figures
    assert figures["status"][1] == "running"
    assert figures["steps"][1] == str(len(metrics)) == "6"
    assert figures["reward_last"][1] == f"{metrics[-1]['reward_mean']:.4g}"
    gaps = [float(g) for m in metrics if isinstance(g := m["boundary_gap_sec"], float)]
    assert len(gaps) == 5 and json.loads(figures["boundary_gap_median_s"][0]) == statistics.median(gaps)
    # Computed from the open trace, the busy fraction is the finished run's one.
    assert json.loads(figures["trainer_busy_fraction"][0]) == pytest.approx(full_summary["trainer_busy_fraction"])
    assert tables.last["step"][1] == "6"

    # Killed in the middle of writing an event: still renders, from the events before it.
    trace.write_text(text[: len(text) - 40])
    os.utime(run_dir / "metrics.jsonl", (1_000_000_000, 1_000_000_000))
    os.utime(trace, (1_000_000_000, 1_000_000_000))
    tables = _parse(write_report(run_dir))
    _assert_pngs(run_dir, PNG_NAMES, tables)
    assert tables.figures["status"][1] == "incomplete"  # no summary, logs untouched for long


def _metrics_complete(run_dir: Path) -> list[dict[str, object]]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


class _Boom(Callback):
    def on_step_end(self, step: int, result: StepResult) -> None:
        if step == 2:
            raise RuntimeError("callback exploded at step 2")


def test_report_of_a_crashed_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="exploded"):
        _run(run_dir, [_Boom()])
    out = write_report(run_dir)
    tables = _parse(out)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert tables.figures["status"][1] == "failed"
    assert tables.figures["steps"][1] == str(summary["steps_completed"])
    assert "callback exploded at step 2" in out.read_text()
    _assert_pngs(run_dir, PNG_NAMES, tables)
    assert tables.last["step"][1] == str(_metrics(run_dir)[-1]["step"])


def test_missing_files_and_columns_skip_plots_with_a_note(tmp_path: Path) -> None:
    run_dir = tmp_path / "bare"
    (run_dir / "report").mkdir(parents=True)
    (run_dir / "report" / "timeline.png").write_bytes(b"stale")  # from an earlier report
    rows = [{"step": i, "reward_mean": 0.1 * i, "step_time_sec": 1.0, "train_time": 0.5} for i in range(3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json, crashed mid-line")
    out = write_report(run_dir)
    tables = _parse(out)
    _assert_pngs(run_dir, ["reward", "step_time"], tables)
    text = out.read_text()
    for plot, reason in (("timeline", "no trace.json"), ("padding", "no padding_efficiency"), ("staleness", "no trajectory log")):
        assert not (run_dir / "report" / f"{plot}.png").exists(), plot
        assert f"report/{plot}.png" not in tables.hrefs
        assert f"skipped: {reason}" in text, plot
    assert tables.figures["steps"][1] == "3"
    assert tables.figures["reward_last"][1] == f"{0.2:.4g}"
    assert tables.figures["wall_time_s"] == (json.dumps(3.0), "3 s")  # the sum of step_time_sec
    assert tables.figures["trainer_busy_fraction"][1] == "–"  # needs the trace


def test_held_out_accuracy_from_evals_jsonl(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path / "evals")
    (run_dir / "summary.json").unlink()
    evals = [{"version": 0, "accuracy": 0.25}, {"version": 3, "accuracy": 0.5}, {"version": 6, "accuracy": 0.625}]
    (run_dir / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    out = write_report(run_dir)
    figures = _parse(out).figures
    assert figures["accuracy_before"] == ("0.25", "0.25")
    assert figures["accuracy_after"] == ("0.625", "0.625")
    assert "No held-out evaluations" not in out.read_text()


def test_trajectories_come_from_the_parquet_log(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path / "pq")
    data = load_run(run_dir)
    assert data.trajectory_source == "trajectories/ (1 file, steps 1–6)"
    assert data.trajectories is not None and len(data.trajectories) == 6 * 16
    # a writer's hidden open file (steps being written, no footer yet) is not read
    (run_dir / "trajectories" / ".steps-000007-open.parquet.tmp").write_bytes(b"half")
    html_path = write_report(run_dir)
    assert "96 trained trajectories from trajectories/ (1 file, steps 1–6)" in html_path.read_text()
    _assert_pngs(run_dir, ["staleness"], _parse(html_path))


def test_list_runs(finished: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    done = _copy(finished, root / "a-done")
    live = _copy(finished, root / "b-live")
    (live / "summary.json").unlink()
    (root / "not-a-run").mkdir()
    runs = list_runs(root)
    assert [r["name"] for r in runs] == ["a-done", "b-live"]
    summary = json.loads((done / "summary.json").read_text())
    a, b = runs
    assert a["status"] == "completed" and a["steps"] == summary["steps_completed"] == 6
    assert a["samples_per_s"] == summary["samples_per_s"] and a["reward_last"] == summary["reward_mean_last"]
    assert a["trainer_busy_fraction"] == summary["trainer_busy_fraction"]
    assert b["status"] == "completed"  # no summary, but the trace recorded the run's end
    assert b["steps"] == 6 and b["reward_last"] == _metrics(live)[-1]["reward_mean"]
    assert b["trainer_busy_fraction"] == pytest.approx(summary["trainer_busy_fraction"])
    assert list_runs(done) == [dict(a)]  # a run directory itself
    assert list_runs(tmp_path / "missing") == []


@pytest.mark.parametrize("content", [None, "notes.txt"], ids=["empty", "other-files"])
def test_report_refuses_a_directory_that_is_not_a_run(tmp_path: Path, content: str | None) -> None:
    run_dir = tmp_path / "not-a-run"
    run_dir.mkdir()
    if content:
        (run_dir / content).write_text("hello")
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(FileNotFoundError, match=rf"^{run_dir}: not a run directory \(no metrics.jsonl, summary.json, trace.json\)$"):
        write_report(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written


def test_report_rejects_a_trace_that_is_not_a_trace(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path / "garbage")
    (run_dir / "trace.json").write_text('[1,"x",null]')
    with pytest.raises(ValueError, match=rf"^{run_dir / 'trace.json'}: event 1: not an object \(got 1\)$"):
        write_report(run_dir)
    assert not (run_dir / "report.html").exists() and not (run_dir / "report").exists()
    # a listing goes on past it: the trace is left out with a note
    (run_dir / "summary.json").unlink()
    data = load_run(run_dir)
    assert data.events is None and any(n.startswith("trace.json: not read (") for n in data.notes)
    assert [r["name"] for r in list_runs(run_dir.parent)] == ["garbage"]


def test_read_jsonl_splits_rows_at_newline_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "note": "a\u2028b\u2029c\x85d"}, {"step": 1, "note": "e"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")  # written raw, as a JSON writer may
    assert read_jsonl(path) == (rows, 0)


def test_step_time_bars_stack_only_exposed_time() -> None:
    rows: list[dict[str, object]] = [
        # packing and weight sync overlap training: stacking them would rise to 1.45 s > 1.0 s
        {
            "step": 0,
            "step_time_sec": 1.0,
            "train_time": 0.8,
            "exposed_generation_time": 0.1,
            "boundary_gap_sec": None,
            "packing_time": 0.3,
            "weight_sync_time": 0.25,
        },
        # the boundary gap includes the wait for groups: only its rest is stacked
        {
            "step": 1,
            "step_time_sec": 1.0,
            "train_time": 0.7,
            "exposed_generation_time": 0.15,
            "boundary_gap_sec": 0.2,
            "packing_time": 0.4,
            "weight_sync_time": 0.3,
        },
        # parts that overshoot (timer noise) are clipped to the step
        {
            "step": 2,
            "step_time_sec": 0.5,
            "train_time": 0.45,
            "exposed_generation_time": 0.2,
            "boundary_gap_sec": 0.3,
            "packing_time": 0.1,
            "weight_sync_time": 0.1,
        },
    ]
    stack = step_time_stack(rows)
    assert [key for key, *_ in stack.layers] == ["train_time", "exposed_generation_time", "boundary_gap_sec"]
    assert [key for key, *_ in stack.overlapped] == ["packing_time", "weight_sync_time"]
    layers = {key: values for key, _, _, values in stack.layers}
    assert layers["boundary_gap_sec"] == pytest.approx([0.0, 0.05, 0.0])
    assert layers["exposed_generation_time"] == pytest.approx([0.1, 0.15, 0.05])
    assert stack.other is not None
    for i, total in enumerate([1.0, 1.0, 0.5]):
        parts = [values[i] for values in layers.values()]
        assert all(p >= 0 for p in parts)
        assert sum(parts) <= total + 1e-12
        assert sum(parts) + stack.other[i] == pytest.approx(total)  # the full bar is the step time


def test_step_time_plot_draws_bars_no_higher_than_the_step(finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    from relayrl.analysis.plots import plot_step_time

    data = load_run(finished, trace=False, trajectories=False)
    assert data.metrics and all("packing_time" in r for r in data.metrics)
    tops: dict[float, float] = {}
    real_bar = Axes.bar

    def bar(self: Axes, x, height, width=0.8, bottom=None, **kwargs):
        for i, xi in enumerate(x):
            tops[xi] = max(tops.get(xi, 0.0), (bottom[i] if bottom is not None else 0.0) + height[i])
        return real_bar(self, x, height, width, bottom=bottom, **kwargs)

    monkeypatch.setattr(Axes, "bar", bar)
    plot_step_time(data, tmp_path / "step_time.png")
    assert (tmp_path / "step_time.png").stat().st_size > 0
    totals = {float(r["step"]): float(r["step_time_sec"]) for r in data.metrics}  # type: ignore[arg-type]
    assert set(tops) == set(totals)
    for step, top in tops.items():
        assert top <= totals[step] * (1 + 1e-9), (step, top, totals[step])


def test_runs_text_keeps_whole_values() -> None:
    runs: list[dict[str, object]] = [
        {"name": "a-very-long-run-name-indeed", "status": "completed", "steps": 12, "samples_per_s": 1234.5678},
        {"name": "b", "status": "running", "steps": None},
    ]
    text = runs_text(runs)
    lines = text.splitlines()
    assert lines[0].split() == ["run", "status", "steps", "wall", "s", "samples/s", "busy", "acc", "before", "acc", "after", "reward"]
    assert lines[1].startswith("a-very-long-run-name-indeed  completed")
    assert "1235" in lines[1] and "…" not in text
    assert lines[2].index("running") == lines[1].index("completed")  # aligned columns


def test_the_report_shows_the_best_and_worst_completion_of_sampled_steps(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path / "samples")
    data = load_run(run_dir)
    assert [(x.step, x.which) for x in data.samples] == [(step, which) for step in range(1, 7) for which in ("best", "worst")]
    assert data.trajectories is not None
    for step in range(1, 7):
        rewards = [r["reward"] for r in data.trajectories if r["step"] == step and r["status"] == "ok"]
        best, worst = (x for x in data.samples if x.step == step)
        assert (best.reward, worst.reward) == (max(rewards), min(rewards))  # type: ignore[type-var]
        assert best.prompt and best.completion is not None
    text = write_report(run_dir).read_text()
    assert '<table class="samples">' in text and text.count('<tr class="best">') == 6 and text.count('<tr class="worst">') == 6


def test_samples_are_cut_and_escaped_and_steps_evenly_spaced() -> None:
    from relayrl.analysis.htmlpage import render_html
    from relayrl.analysis.rundata import RunData, Sample, even_picks

    assert even_picks(list(range(100)), 10) == [0, 11, 22, 33, 44, 55, 66, 77, 88, 99]
    assert even_picks([3, 4], 10) == [3, 4]
    data = RunData(Path("run"), samples=[Sample(0, "best", 1.0, "<b>2+2</b>", "<script>x</script>")])
    page = render_html(data, [], [])
    assert "&lt;script&gt;x&lt;/script&gt;" in page and "<script>" not in page and "&lt;b&gt;2+2&lt;/b&gt;" in page


def _bare_run(run_dir: Path, multiturn: bool) -> Path:
    (run_dir).mkdir(parents=True)
    turns = {"turns_mean": 2.5, "first_turn_solved_rate": 0.25} if multiturn else {}
    rows = [{"step": i, "reward_mean": 0.1 * i, "step_time_sec": 1.0, "train_time": 0.5, **turns} for i in range(1, 4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    multi = {"first_turn_accuracy": 0.2, "mean_turns": 2.4} if multiturn else {}
    evals = [{"version": v, "accuracy": 0.3, "reward_mean": 0.5, **multi} for v in (0, 3)]
    (run_dir / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return run_dir


@pytest.mark.parametrize("multiturn", [True, False])
def test_multi_turn_plots_appear_only_for_a_multi_turn_run(tmp_path: Path, multiturn: bool) -> None:
    run_dir = _bare_run(tmp_path / "run", multiturn)
    (run_dir / "report").mkdir()
    (run_dir / "report" / "multiturn.png").write_bytes(b"stale")  # from an earlier report
    out = write_report(run_dir)
    tables = _parse(out)
    text = out.read_text()
    if multiturn:
        _assert_pngs(run_dir, ["multiturn"], tables)
        assert "Multi-turn episodes" in text
    else:
        assert not (run_dir / "report" / "multiturn.png").exists()
        assert "Multi-turn episodes" not in text and "report/multiturn.png" not in tables.hrefs


def test_reward_and_accuracy_are_drawn_on_separate_panels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.analysis import plots

    figures: list[Figure] = []
    new_figure = plots._new_figure

    def keep(width: float, height: float) -> Figure:
        figures.append(new_figure(width, height))
        return figures[-1]

    monkeypatch.setattr(plots, "_new_figure", keep)
    plots.plot_reward(load_run(_bare_run(tmp_path / "run", False)), tmp_path / "reward.png")
    (fig,) = figures
    labels = [{line.get_label() for line in ax.get_lines()} for ax in fig.axes]
    assert len(fig.axes) == 2  # two panels, no twin axis
    assert "reward (mean of the step's trajectories)" in labels[0] and "held-out accuracy (evals.jsonl)" not in labels[0]
    assert labels[1] == {"held-out accuracy (evals.jsonl)"}
    assert "held-out mean reward (evals.jsonl)" in labels[0]
