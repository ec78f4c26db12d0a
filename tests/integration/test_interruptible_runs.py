"""Runs with rollout.interruptible on the sim: generations that a weight load interrupted carry
both versions, their trajectories count the oldest, and the run passes check-trace; at
max_staleness 0 nothing is interrupted."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from relayrl.analysis.checker import check_events
from relayrl.analysis.timeline import spans
from relayrl.config.schema import load_config
from relayrl.telemetry.tracer import TraceEvent
from support.simutil import event_args, make_program, run_checked, settled_groups, sim_config

# generations of 8 tokens at 20 ms a token, far longer than a train step: every commit's load
# lands while a replica is generating
SLOW_GENERATION = ["sim.generate_per_token=0.02", "sim.train_step=0.005", "sim.optim_step=0.005", "rollout.max_new_tokens=8"]


def generate_spans(result: object) -> list[dict[str, object]]:
    return [s.args for s in spans(result.tracer.events) if s.name == "generate" and s.lane.startswith("sampler/")]  # type: ignore[attr-defined]


def test_interrupted_generations_carry_both_versions_and_pass_the_checker(tmp_path: Path) -> None:
    cfg = sim_config("run.steps=6", "rollout.max_staleness=1", "rollout.interruptible=true", *SLOW_GENERATION)
    result = run_checked(make_program(cfg, tmp_path))
    ledger = result.ledger.as_dict()
    assert settled_groups(ledger) == ledger["groups_dispatched"]
    interrupted = [a for a in generate_spans(result) if "versions" in a]
    assert interrupted, "no generation spanned a weight load"
    for args in interrupted:
        versions = args["versions"]
        assert isinstance(versions, list) and len(versions) >= 2 and versions == sorted(versions)
        assert args["version"] == versions[0]  # the call's version is its oldest token's
    info = [event_args(e) for e in result.tracer.events if e.get("name") == "relayrl_run"]
    assert info and info[0]["interruptible"] is True


def test_at_staleness_0_nothing_is_interrupted(tmp_path: Path) -> None:
    cfg = sim_config("run.steps=4", "rollout.max_staleness=0", "rollout.interruptible=true", *SLOW_GENERATION)
    result = run_checked(make_program(cfg, tmp_path))
    assert not [a for a in generate_spans(result) if "versions" in a]
    info = [event_args(e) for e in result.tracer.events if e.get("name") == "relayrl_run"]
    assert info and info[0]["interruptible"] is False


def _actor_span(name: str, ts: float, dur: float) -> TraceEvent:
    return {
        "ph": "X",
        "pid": 1,
        "tid": 10,
        "cat": "actor:sampler/0",
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"call_start": 0.0, "call_end": 1.0},
    }


def test_check_trace_allows_a_load_beside_a_generate_only_when_interruptible(tmp_path: Path) -> None:
    result = run_checked(make_program(sim_config("run.steps=2"), tmp_path))
    events = [copy.deepcopy(e) for e in result.tracer.events]
    overlapping = [_actor_span("generate", 1000.0, 500.0), _actor_span("load_weights", 1200.0, 100.0)]
    waiting = check_events(events + overlapping).violations
    assert any("ran generate" in v and "load_weights" in v and "at once" in v for v in waiting)

    info = next(e for e in events if e.get("name") == "relayrl_run")
    info["args"]["interruptible"] = True  # type: ignore[index]
    assert check_events(events + overlapping).violations == []
    two_loads = overlapping + [_actor_span("load_weights", 1250.0, 100.0)]  # loads still run one at a time
    assert any("ran load_weights" in v and "at once" in v for v in check_events(events + two_loads).violations)


@pytest.mark.slow
def test_a_local_run_with_interruptible_loads_passes_the_checker(tmp_path: Path) -> None:
    """The local backend on the shipped tiny model: loads run in each sampler's load thread
    beside its generate calls, and the run completes, balanced and checked (whether a load
    lands inside a generation depends on timing here; the unit tests force one)."""
    sets = [
        "run.backend=local",
        "task.kind=arithmetic",
        "run.steps=3",
        "rollout.num_generations=4",
        "rollout.groups_per_step=4",
        "rollout.max_staleness=1",
        "rollout.interruptible=true",
        "rollout.max_new_tokens=16",
        "eval.enabled=false",
        "orchestrator.release_memory=false",
    ]
    result = run_checked(make_program(load_config(None, sets), tmp_path), timeout=120)
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == 12 and settled_groups(ledger) == ledger["groups_dispatched"]
