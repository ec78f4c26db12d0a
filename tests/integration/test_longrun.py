"""Long runs: nothing a run keeps in memory grows with the number of steps (issue 8: the trace
events, step records and step results a run kept made every per-step gc.collect walk more).
Counts and sizes are asserted, never times."""

from __future__ import annotations

import asyncio
import gc
import json
import math
from collections.abc import Sized
from pathlib import Path

import pytest

from relayrl.analysis import timeline
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.ledger import Ledger, LedgerError
from relayrl.orchestrator.window import DispatchWindow
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.stepbook import StepResults
from relayrl.telemetry.tracer import Tracer, load_trace
from relayrl.types import Drawn, FilterReason, Group, Prompt, StepResult
from support.cli import relayrl
from support.simutil import make_program, run_checked, sim_config

# the JSON keys issue 8 names for `relayrl bench soak`
SOAK_KEYS = {
    "rss_drift_fraction",
    "step_time_ratio",
    "release_time_ratio",
    "threads_start",
    "threads_end",
    "fds_start",
    "fds_end",
    "tasks_start",
    "tasks_end",
}
LONG = ("run.steps=300", "rollout.groups_per_step=2", "rollout.num_generations=2", "orchestrator.log_trajectories=false")


class _TrackedObjects(Callback):
    """The number of objects the garbage collector tracks, after a collection, at given steps."""

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)
        self.counts: dict[int, int] = {}

    def on_step_end(self, step: int, result: StepResult) -> None:
        if step in self.steps:
            gc.collect()
            self.counts[step] = len(gc.get_objects())


def test_a_long_run_keeps_a_bounded_number_of_objects(tmp_path: Path) -> None:
    probe = _TrackedObjects(101, 300)
    program = make_program(sim_config(*LONG), tmp_path, [probe])
    result = run_checked(program, timeout=120)
    # Each step used to leave ~15 tracked objects behind (trace events and their args, the step's
    # record and result with their dicts and lists): ~3,000 over 200 steps. Bounded now.
    growth = probe.counts[300] - probe.counts[101]
    assert growth < 600, f"{growth} more gc-tracked objects after 200 more steps"
    # What the run itself holds: no trace event once flushed, the last record, the first and last result.
    assert program.tracer.retained == 0
    assert len(result.records) == 1 and result.records[0].step == 300
    results = program.bookkeeper.results
    assert isinstance(results, StepResults) and results.first is not None and results.last is not None
    assert (results.first.step, results.last.step, len(results)) == (1, 300, 300)


def test_what_a_long_run_no_longer_keeps_is_read_back_from_its_files(tmp_path: Path) -> None:
    program = make_program(sim_config(*LONG), tmp_path)
    result = run_checked(program, timeout=120)
    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(result.results) == 300 == len(rows)
    assert [r.step for r in result.results] == list(range(1, 301))
    assert [r.metrics for r in result.results] == rows
    assert result.results[150].metrics == rows[150] and result.results[-2].step == 299
    assert [r.step for r in result.results[10:13]] == [11, 12, 13]
    # The summary's trace figures are those of trace.json, read back once at the end of the run.
    events = load_trace(run_dir / "trace.json")
    assert result.tracer.events == events
    all_spans = timeline.spans(events)
    gaps = timeline.boundary_gaps(all_spans)
    assert len(gaps) == 299
    assert result.summary["boundary_gap_median_s"] == timeline.median(gaps)
    assert result.summary["trainer_busy_fraction"] == timeline.trainer_busy_fraction(all_spans) > 0
    assert result.summary["steps_completed"] == 300
    assert result.summary["reward_mean_first"] == rows[0]["reward_mean"]
    assert result.summary["reward_mean_last"] == rows[-1]["reward_mean"]


def test_an_in_memory_run_keeps_its_events_and_results(tmp_path: Path) -> None:
    program = build_program(sim_config("run.steps=5"), run_dir=None)
    result = asyncio.run(asyncio.wait_for(program.run(), 60))
    assert len(result.results) == 5 and [r.step for r in result.results] == list(range(1, 6))
    assert program.tracer.retained == len(result.tracer.events) > 5 * 4  # nowhere else to keep them
    assert sum(1 for s in timeline.spans(result.tracer.events) if s.name == "optim_step") == 5
    assert result.summary["trainer_busy_fraction"] > 0  # type: ignore[operator]


def test_a_tracer_with_a_file_lets_flushed_events_go(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    tracer = Tracer(path, {})
    assert tracer.retained == 0  # the metadata went to the file at once
    for n in range(1000):
        tracer.complete("trainer", "train_step", n, n + 0.5, step=n, microbatch=0)
        if n % 10 == 9:
            tracer.flush()
    assert tracer.retained == 0
    tracer.complete("trainer", "optim_step", 1000.0, 1000.5, step=999)
    assert tracer.retained == 1
    assert [e["name"] for e in tracer.events if e.get("ph") == "X"] == ["train_step"] * 1000 + ["optim_step"]
    tracer.close("completed")
    assert tracer.retained == 0
    assert len([e for e in load_trace(path) if e.get("ph") == "X"]) == 1001


def test_the_ledger_keeps_no_per_group_record_of_settled_groups() -> None:
    ledger, window = Ledger(), DispatchWindow(groups_per_step=20, max_staleness=0, total_steps=500)
    for batch in range(500):
        ids = ledger.dispatch([Drawn(i, Prompt(f"p{batch}.{i}", "", "")) for i in range(20)], 4)
        for gid in ids[:-1]:
            ledger.trained(gid, 4)
        ledger.filtered(Group(ids[-1], []), FilterReason.STALE, window)
        ledger.drain_filtered()
    d = ledger.as_dict()
    assert d["groups_trained"] == 500 * 19 and d["groups_filtered"] == {"stale": 500} and d["groups_unused"] == 0
    sizes = {name: len(value) for name in Ledger.__slots__ if isinstance(value := getattr(ledger, name), Sized)}
    assert max(sizes.values()) <= 10, sizes  # 10,000 groups settled: no container holds them
    with pytest.raises(LedgerError, match="settled twice"):
        ledger.trained(0, 4)


def test_soak_bench_reports_every_figure() -> None:
    from relayrl.bench.suite import run_soak

    try:
        figures = run_soak(steps=200, time_scale=0.002)
    finally:
        gc.unfreeze()  # the soak runs with release_memory on, which freezes the heap
    assert SOAK_KEYS <= figures.keys()
    for key in ("rss_drift_fraction", "step_time_ratio", "release_time_ratio"):
        value = figures[key]
        assert isinstance(value, float) and math.isfinite(value), (key, value)
    assert figures["step_time_ratio"] > 0 and figures["release_time_ratio"] > 0  # type: ignore[operator]
    assert -0.5 < figures["rss_drift_fraction"] < 0.5  # type: ignore[operator]
    for key in ("threads", "fds", "tasks"):
        start, end = figures[f"{key}_start"], figures[f"{key}_end"]
        assert isinstance(start, int) and isinstance(end, int) and start > 0 and end > 0, (key, start, end)
    assert [s["step"] for s in figures["samples"]] == [1, 21, 101, 200]  # type: ignore[attr-defined]


def test_soak_bench_json_output() -> None:
    res = relayrl("bench", "soak", "--json", "--steps", "40", "--time-scale", "0.002", timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert SOAK_KEYS <= data.keys()
    assert data["steps"] == 40
