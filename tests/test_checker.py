"""The trace checker accepts a correct run and names the first violation of each rule."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.telemetry.checker import check_events
from relayrl.telemetry.tracer import TraceEvent, load_trace
from simutil import make_program, run_checked, sim_config


@pytest.fixture(scope="module")
def good_trace(tmp_path_factory: pytest.TempPathFactory) -> list[TraceEvent]:
    tmp = tmp_path_factory.mktemp("checker")
    cfg = sim_config("sim.get_metrics=0.03", "sim.train_step=0.02", "sim.reduce_metrics=0.005", "orchestrator.checkpoint_every=1")
    run_checked(make_program(cfg, tmp))
    return load_trace(tmp / "run" / "trace.json")


def _span(events: list[TraceEvent], name: str, step: int, **args: object) -> TraceEvent:
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") == "X" and e["name"] == name and a.get("step") == step and all(a.get(k) == v for k, v in args.items()):  # type: ignore[union-attr]
            return e
    raise AssertionError(name)


def _violations(events: list[TraceEvent]) -> list[str]:
    return check_events(events).violations


def test_good_trace_passes(good_trace: list[TraceEvent]) -> None:
    report = check_events(good_trace)
    assert report.ok and report.completed and report.steps == 4


def test_checkpoint_before_the_steps_logs_or_after_the_next_update_is_a_violation(good_trace: list[TraceEvent]) -> None:
    assert _span(good_trace, "checkpoint", 1)
    ev = copy.deepcopy(good_trace)
    _span(ev, "checkpoint", 1)["ts"] = float(_span(ev, "log_trajectories", 1)["ts"]) - 10.0  # type: ignore[arg-type]
    assert any("checkpoint" in v and "log_trajectories finished" in v for v in _violations(ev))
    ev = copy.deepcopy(good_trace)
    ck, optim = _span(ev, "checkpoint", 1), _span(ev, "optim_step", 2)
    ck["dur"] = float(optim["ts"]) - float(ck["ts"]) + 100.0  # type: ignore[arg-type]
    assert any(v.startswith("checkpoint:") and "was issued" in v for v in _violations(ev))


def test_fetch_landing_after_next_optim_violates_rule_2(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    fetch, optim = _span(ev, "get_metrics", 1), _span(ev, "optim_step", 2)
    fetch["dur"] = float(optim["ts"]) - float(fetch["ts"]) + 100.0  # type: ignore[arg-type]
    assert any(v.startswith("rule 2") for v in _violations(ev))


def test_bookkeeping_before_next_first_train_step_violates_rule_3(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    red = _span(ev, "reduce_metrics", 1)
    red["ts"] = float(_span(ev, "train_step", 2, microbatch=0)["ts"]) - 500.0  # type: ignore[arg-type]
    assert any(v.startswith("rule 3") for v in _violations(ev))


def test_bookkeeping_on_the_loop_thread_violates_rule_3(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    _span(ev, "log_metrics", 0)["args"]["thread"] = "MainThread"  # type: ignore[index]
    assert any("event loop's thread" in v for v in _violations(ev))


def test_bookkeeping_after_next_optim_violates_rule_4(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    rel = _span(ev, "release_memory", 0)
    rel["dur"] = float(_span(ev, "optim_step", 1)["ts"]) - float(rel["ts"]) + 1000.0  # type: ignore[arg-type]
    assert any(v.startswith("rule 4") for v in _violations(ev))


def test_missing_bookkeeping_in_completed_run_violates_rule_4(good_trace: list[TraceEvent]) -> None:
    ev = [e for e in copy.deepcopy(good_trace) if not (e.get("name") == "log_trajectories" and (e.get("args") or {}).get("step") == 2)]  # type: ignore[union-attr]
    assert any("never ran log_trajectories" in v for v in _violations(ev))


def test_uncommitted_step_in_completed_run_violates_rule_5(good_trace: list[TraceEvent]) -> None:
    ev = [e for e in copy.deepcopy(good_trace) if not (e.get("name") in ("optim_step",) and (e.get("args") or {}).get("step") == 3)]  # type: ignore[union-attr]
    assert any(v.startswith("rule 5") for v in _violations(ev))


def test_on_step_end_out_of_order_violates_rule_6(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    a, b = _span(ev, "on_step_end", 1), _span(ev, "on_step_end", 2)
    a["args"]["step"], b["args"]["step"] = 2, 1  # type: ignore[index]
    assert any(v.startswith("rule 6") for v in _violations(ev))


def test_train_step_too_stale_is_a_violation(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    _span(ev, "train_step", 3, microbatch=0)["args"]["min_version"] = 0  # type: ignore[index]
    assert any(v.startswith("staleness") for v in _violations(ev))


def test_fetch_holding_next_microbatch_violates_rule_1(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    fetch, mb0 = _span(ev, "get_metrics", 1), _span(ev, "train_step", 2, microbatch=0)
    shift = float(fetch["ts"]) + float(fetch["dur"]) + 50.0 - float(mb0["ts"])  # type: ignore[arg-type]
    # move step 2 and everything after it so mb0 starts the moment the fetch landed
    for e in ev:
        if e.get("ph") == "X" and float(e["ts"]) >= float(mb0["ts"]) and e is not fetch:  # type: ignore[arg-type]
            e["ts"] = float(e["ts"]) + shift  # type: ignore[arg-type]
    assert any(v.startswith("rule 1") for v in _violations(ev))


def test_cli_check_trace_exit_codes(good_trace: list[TraceEvent], tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    (good / "trace.json").write_text(json.dumps(good_trace))
    ok = subprocess.run([sys.executable, "-m", "relayrl.cli", "check-trace", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0 and "rules 1–6" in ok.stdout
    bad = tmp_path / "bad"
    bad.mkdir()
    ev = copy.deepcopy(good_trace)
    _span(ev, "log_metrics", 0)["args"]["thread"] = "MainThread"  # type: ignore[index]
    (bad / "trace.json").write_text(json.dumps(ev))
    res = subprocess.run([sys.executable, "-m", "relayrl.cli", "check-trace", str(bad)], capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.startswith("violation: rule 3")
    missing = subprocess.run([sys.executable, "-m", "relayrl.cli", "check-trace", str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no trace" in missing.stderr
