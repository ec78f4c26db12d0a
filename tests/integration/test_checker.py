"""The trace checker accepts a correct run and names the first violation of each rule."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from relayrl.analysis.checker import check_events
from relayrl.telemetry.tracer import TraceError, TraceEvent, load_trace
from support.cli import relayrl
from support.simutil import event_args, make_program, run_checked, sim_config


@pytest.fixture(scope="module")
def good_trace(tmp_path_factory: pytest.TempPathFactory) -> list[TraceEvent]:
    tmp = tmp_path_factory.mktemp("checker")
    cfg = sim_config("sim.get_metrics=0.03", "sim.train_step=0.02", "sim.reduce_metrics=0.005", "orchestrator.checkpoint_every=1")
    run_checked(make_program(cfg, tmp))
    return load_trace(tmp / "run" / "trace.json")


def _span(events: list[TraceEvent], name: str, step: int, **args: object) -> TraceEvent:
    for e in events:
        a = event_args(e)
        if e.get("ph") == "X" and e["name"] == name and a.get("step") == step and all(a.get(k) == v for k, v in args.items()):
            return e
    raise AssertionError(name)


def _violations(events: list[TraceEvent]) -> list[str]:
    return check_events(events).violations


def test_good_trace_passes(good_trace: list[TraceEvent]) -> None:
    report = check_events(good_trace)
    assert report.ok and report.completed and report.steps == 4


def test_checkpoint_before_the_steps_logs_or_after_the_next_update_is_a_violation(good_trace: list[TraceEvent]) -> None:
    assert _span(good_trace, "checkpoint", 2)
    ev = copy.deepcopy(good_trace)
    _span(ev, "checkpoint", 2)["ts"] = float(_span(ev, "log_trajectories", 2)["ts"]) - 10.0  # type: ignore[arg-type]
    assert any("checkpoint" in v and "log_trajectories finished" in v for v in _violations(ev))
    ev = copy.deepcopy(good_trace)
    ck, optim = _span(ev, "checkpoint", 2), _span(ev, "optim_step", 3)
    ck["dur"] = float(optim["ts"]) - float(ck["ts"]) + 100.0  # type: ignore[arg-type]
    assert any(v.startswith("checkpoint:") and "was issued" in v for v in _violations(ev))


def test_fetch_landing_after_next_optim_violates_rule_2(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    fetch, optim = _span(ev, "get_metrics", 2), _span(ev, "optim_step", 3)
    fetch["dur"] = float(optim["ts"]) - float(fetch["ts"]) + 100.0  # type: ignore[arg-type]
    assert any(v.startswith("rule 2") for v in _violations(ev))


def test_bookkeeping_before_next_first_train_step_violates_rule_3(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    red = _span(ev, "reduce_metrics", 2)
    red["ts"] = float(_span(ev, "train_step", 3, microbatch=0)["ts"]) - 500.0  # type: ignore[arg-type]
    assert any(v.startswith("rule 3") for v in _violations(ev))


def test_bookkeeping_on_the_loop_thread_violates_rule_3(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    _span(ev, "log_metrics", 1)["args"]["thread"] = "MainThread"  # type: ignore[index]
    assert any("event loop's thread" in v for v in _violations(ev))


def test_bookkeeping_after_next_optim_violates_rule_4(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    rel = _span(ev, "release_memory", 1)
    rel["dur"] = float(_span(ev, "optim_step", 2)["ts"]) - float(rel["ts"]) + 1000.0  # type: ignore[arg-type]
    assert any(v.startswith("rule 4") for v in _violations(ev))


def test_missing_bookkeeping_in_completed_run_violates_rule_4(good_trace: list[TraceEvent]) -> None:
    ev = [e for e in copy.deepcopy(good_trace) if not (e.get("name") == "log_trajectories" and event_args(e).get("step") == 3)]
    assert any("never ran log_trajectories" in v for v in _violations(ev))


def test_uncommitted_step_in_completed_run_violates_rule_5(good_trace: list[TraceEvent]) -> None:
    ev = [e for e in copy.deepcopy(good_trace) if not (e.get("name") in ("optim_step",) and event_args(e).get("step") == 4)]
    assert any(v.startswith("rule 5") for v in _violations(ev))


def test_on_step_end_out_of_order_violates_rule_6(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    a, b = _span(ev, "on_step_end", 2), _span(ev, "on_step_end", 3)
    a["args"]["step"], b["args"]["step"] = 3, 2  # type: ignore[index]
    assert any(v.startswith("rule 6") for v in _violations(ev))


def test_train_step_too_stale_is_a_violation(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    _span(ev, "train_step", 4, microbatch=0)["args"]["min_version"] = 0  # type: ignore[index]
    assert any(v.startswith("staleness") for v in _violations(ev))


def test_fetch_holding_next_microbatch_violates_rule_1(good_trace: list[TraceEvent]) -> None:
    ev = copy.deepcopy(good_trace)
    fetch, mb0 = _span(ev, "get_metrics", 2), _span(ev, "train_step", 3, microbatch=0)
    shift = float(fetch["ts"]) + float(fetch["dur"]) + 50.0 - float(mb0["ts"])  # type: ignore[arg-type]
    # move step 3 and everything after it so mb0 starts the moment the fetch landed
    for e in ev:
        if e.get("ph") == "X" and float(e["ts"]) >= float(mb0["ts"]) and e is not fetch:  # type: ignore[arg-type]
            e["ts"] = float(e["ts"]) + shift  # type: ignore[arg-type]
    assert any(v.startswith("rule 1") for v in _violations(ev))


def _with_actor_spans(events: list[TraceEvent], shift_us: float = 0.0, error_s: float = 0.001) -> list[TraceEvent]:
    """`events` plus, as a Ray run traces them, an actor span inside each train_step and
    optim_step call (100 µs after the call started, 100 µs before it ended), moved by `shift_us`,
    with that actor's clock estimate."""
    ev = copy.deepcopy(events)
    ev.append(
        {"ph": "M", "pid": 1, "tid": 9, "name": "relayrl_clock", "args": {"lane": "actor:trainer", "offset_s": 0.0, "error_s": error_s}}
    )
    for e in list(ev):
        if e.get("ph") == "X" and e.get("cat") == "trainer":
            ts, dur = float(e["ts"]), float(e["dur"])  # type: ignore[arg-type]
            args = {"call_start": ts / 1e6, "call_end": (ts + dur) / 1e6, "step": e["args"]["step"]}  # type: ignore[index]
            ev.append(
                {
                    "ph": "X",
                    "pid": 1,
                    "tid": 9,
                    "cat": "actor:trainer",
                    "name": e["name"],
                    "ts": ts + 100 + shift_us,
                    "dur": dur - 200,
                    "args": args,
                }
            )
    return ev


def test_actor_spans_outside_their_calls_or_overlapping_are_violations(good_trace: list[TraceEvent]) -> None:
    assert _violations(_with_actor_spans(good_trace)) == []
    assert _violations(_with_actor_spans(good_trace, shift_us=900.0)) == []  # within the clock estimate's 1 ms error
    late = _violations(_with_actor_spans(good_trace, shift_us=1500.0))  # beyond it: the clocks were merged wrongly
    assert late and all(v.startswith("actors: actor:trainer") and "outside its call" in v for v in late)
    ev = _with_actor_spans(good_trace)
    sampler = [
        {
            "ph": "X",
            "pid": 1,
            "tid": 10,
            "cat": "actor:sampler/0",
            "name": "generate",
            "ts": ts,
            "dur": 500.0,
            "args": {"call_start": 0.0, "call_end": 1.0},
        }
        for ts in (1000.0, 1200.0)
    ]
    assert any("ran generate" in v and "at once" in v for v in _violations(ev + sampler))  # one call at a time
    fetch = next(e for e in ev if e.get("cat") == "trainer.fetch")  # an io call overlapping training is fine
    ts, dur = float(fetch["ts"]), float(fetch["dur"])  # type: ignore[arg-type]
    io = {
        "ph": "X",
        "pid": 1,
        "tid": 9,
        "cat": "actor:trainer",
        "name": "get_metrics",
        "ts": ts,
        "dur": dur,
        "args": {"call_start": ts / 1e6, "call_end": (ts + dur) / 1e6},
    }
    assert _violations(ev + [io]) == []


def test_cli_check_trace_exit_codes(good_trace: list[TraceEvent], tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    (good / "trace.json").write_text(json.dumps(good_trace))
    ok = relayrl("check-trace", str(good))
    assert ok.returncode == 0 and "rules 1–6" in ok.stdout
    bad = tmp_path / "bad"
    bad.mkdir()
    ev = copy.deepcopy(good_trace)
    _span(ev, "log_metrics", 1)["args"]["thread"] = "MainThread"  # type: ignore[index]
    (bad / "trace.json").write_text(json.dumps(ev))
    res = relayrl("check-trace", str(bad))
    assert res.returncode == 1 and res.stderr.startswith("violation: rule 3")
    missing = relayrl("check-trace", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no trace" in missing.stderr


# -- reading traces: what a crash leaves is accepted, garbage is rejected naming file and event ------


def _as_written(events: list[TraceEvent]) -> tuple[str, list[int]]:
    """The file `Tracer` writes for these events (closing bracket aside) and where each event ends."""
    text, ends = "[", []
    for i, e in enumerate(events):
        text += ("\n" if i == 0 else ",\n") + json.dumps(e, separators=(",", ":"))
        ends.append(len(text))
    return text, ends


def test_load_trace_accepts_every_prefix_a_crash_leaves(good_trace: list[TraceEvent], tmp_path: Path) -> None:
    text, ends = _as_written(good_trace)
    path = tmp_path / "trace.json"
    cuts = sorted({*range(1, len(text) + 1, 101), *(e + d for e in ends for d in (-2, -1, 0, 1, 2) if 1 <= e + d <= len(text))})
    for cut in cuts:
        path.write_text(text[:cut])
        events = load_trace(path)
        assert events == good_trace[: sum(1 for e in ends if e <= cut)], cut  # the torn event is dropped
        check_events(events)  # and the checker reads what is left
    path.write_text(text + "\n]\n")
    assert load_trace(path) == good_trace
    path.write_text(json.dumps({"traceEvents": good_trace}))
    assert load_trace(path) == good_trace


GARBAGE_TRACES: list[tuple[str, bytes, str]] = [
    ("not_objects", b'[1,"x",null]', "event 1: not an object (got 1)"),
    ("ts_text", b'[{"ph":"M","name":"a"},{"ph":"X","name":"s","ts":"abc","dur":1}]', "event 2: 'ts' is not a number (got \"abc\")"),
    ("ts_missing", b'[{"ph":"X","name":"s","dur":1}]', "event 1: a complete event (ph X) without 'ts'"),
    ("ts_infinite", b'[{"ph":"X","name":"s","ts":1e999,"dur":1}]', "event 1: 'ts' is not a finite number"),
    ("dur_negative", b'[{"ph":"X","name":"s","ts":1,"dur":-5}]', "event 1: 'dur' is negative"),
    ("dur_null", b'[{"ph":"X","name":"s","ts":1,"dur":null}]', "event 1: 'dur' is not a number (got null)"),
    ("name_number", b'[{"ph":"X","name":3,"ts":1,"dur":1}]', "event 1: 'name' is not a string (got 3)"),
    ("ph_missing", b'[{"name":"s","ts":1}]', "event 1: has no 'ph'"),
    ("args_list", b'[{"ph":"X","name":"s","ts":1,"dur":1,"args":[1]}]', "event 1: 'args' is not an object"),
    ("step_text", b'[{"ph":"X","name":"s","ts":1,"dur":1,"args":{"step":"2"}}]', "event 1: 'args.step' is not an integer"),
    ("staleness_null", b'[{"ph":"M","name":"relayrl_run","args":{"max_staleness":null}}]', "'args.max_staleness' is not an integer"),
    ("random_bytes", bytes(range(256)) * 3, "not UTF-8 text"),
    ("empty", b"", "the file is empty"),
    ("blank", b" \n\n", "the file is empty"),
    ("object", b'{"ph":"X"}', "not an array of events"),
    ("text", b"hello", "does not start with '['"),
    ("broken_middle", b'[\n{"ph":"M","name":"a"},\n{"ph":"M",name},\n{"ph":"M","name":"b"}', "event 2 (line 3): invalid JSON"),
    ("garbage_last_line", b'[\n{"ph":"M","name":"a"},\nnot an event', "event 2 (line 3): invalid JSON"),
    ("torn_not_json", b'[\n{"ph":"M","name":"a"},\n{"ph":"M"]', "event 2 (line 3): invalid JSON"),
    ("missing_comma", b'[\n{"ph":"M","name":"a"}\n{"ph":"M","name":"b"}', "event 2 (line 3): expected ',' or ']'"),
    ("after_bracket", b'[{"ph":"M","name":"a"}]\nmore', "text after the closing ']' (line 2)"),
]


@pytest.mark.parametrize(("name", "content", "fragment"), GARBAGE_TRACES, ids=[g[0] for g in GARBAGE_TRACES])
def test_load_trace_rejects_garbage_naming_file_and_event(tmp_path: Path, name: str, content: bytes, fragment: str) -> None:
    path = tmp_path / f"{name}.json"
    path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and fragment in message and "\n" not in message, message
    assert isinstance(info.value, ValueError)
