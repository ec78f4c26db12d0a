"""Runs with rollout.interruptible on the sim: generations (and multi-turn turns) that a weight
load interrupted carry both versions, their trajectories count the oldest, and the run passes
check-trace; at max_staleness 0 nothing is interrupted."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any, cast

import pytest

from relayrl.analysis.checker import check_events
from relayrl.analysis.timeline import spans
from relayrl.config.schema import load_config
from relayrl.envs.base import EnvStep
from relayrl.telemetry.tracer import TraceEvent, Tracer
from relayrl.types import Group, Trajectory, token_versions
from support.simutil import event_args, make_program, run_checked, settled_groups, sim_config, trace_spans

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


# -- multi-turn episodes -------------------------------------------------------------------------

MULTITURN = ["task.environment=arithmetic_feedback", "rollout.max_turns=3", "rollout.max_staleness=1", "rollout.interruptible=true"]


def test_a_turn_interrupted_by_a_load_records_both_versions_in_its_trajectory() -> None:
    """The episode runner: a turn's result carries its oldest version and its runs; the turn keeps
    the oldest, the trajectory its oldest token's, and `versions` covers the whole completion
    (the observation's tokens, context only, in the run before them)."""
    from relayrl.orchestrator.stages.episodes import EpisodeRunner, EpisodeSettings
    from relayrl.threads import OrchestratorThreads
    from relayrl.types import Completion, Prompt, SampleRequest, TurnRequest, TurnResult
    from support.envutil import CharEncoder

    class Again:
        def start(self, prompt: object) -> Again:
            return self

        def step(self, action: str) -> EnvStep:
            return EnvStep("no")

    async def turn(requests: list[TurnRequest]) -> list[TurnResult]:
        number = len(calls) + 1
        calls.append(number)
        runs = [(0, 3), (2, 4)] if number == 1 else None  # turn 1: a load landed after its second token
        return [TurnResult(r.episode, Completion([7] * 4, [-0.5] * 4, "a", versions=runs), 3 if number == 1 else 4, 0) for r in requests]

    calls: list[int] = []
    threads = OrchestratorThreads()
    settings = EpisodeSettings(max_turns=2, max_total_tokens=64, max_new_tokens=4, observation_template="{observation}")
    runner = EpisodeRunner(Again(), "again", CharEncoder(), settings, threads, Tracer(None, {}))
    try:
        (group,) = asyncio.run(runner.run([SampleRequest(0, Prompt("p0", "1+1=", "2"), [1, 2, 3], 1)], turn))
    finally:
        threads.shutdown()
    (t,) = group.trajectories
    assert [turn.policy_version for turn in t.turns] == [3, 4]
    assert t.policy_version == 3
    assert t.versions == [(0, 3), (2, 4)]  # the observation "no" (2 tokens) and turn 2 stay in version 4's run
    assert token_versions(t.versions, len(t.completion_tokens)) == [3, 3] + [4] * 8


def test_interrupted_turns_of_a_multiturn_sim_run_count_their_oldest_token_and_pass_the_checker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relayrl.orchestrator.stages.episodes import EpisodeRunner

    sampled: list[Trajectory] = []  # every episode's trajectory, as the episode runner makes it
    make_groups = EpisodeRunner._groups

    def keep(self: EpisodeRunner, *args: Any) -> list[Group]:
        groups = make_groups(self, *args)
        sampled.extend(t for g in groups for t in g.trajectories)
        return groups

    monkeypatch.setattr(EpisodeRunner, "_groups", keep)
    cfg = sim_config("run.steps=4", *MULTITURN, *SLOW_GENERATION)
    result = run_checked(make_program(cfg, tmp_path))
    ledger = result.ledger.as_dict()
    assert settled_groups(ledger) == ledger["groups_dispatched"]
    interrupted = [a for a in generate_spans(result) if "versions" in a]
    assert interrupted and all("turn" in a for a in interrupted), "no turn spanned a weight load"
    for args in interrupted:
        assert args["version"] == cast(list[int], args["versions"])[0]  # the call's version is its oldest token's
    assert all(int(cast(int, r.metrics["staleness_max"])) <= cfg.rollout.max_staleness for r in result.results)
    mixed = [t for t in sampled if t.versions is not None]
    assert mixed, "no trajectory's tokens came from two versions"
    for t in sampled:
        assert t.policy_version == min(turn.policy_version for turn in t.turns)
        if t.versions is not None:
            versions = [v for _, v in t.versions]
            assert t.versions[0] == (0, t.policy_version) and versions == sorted(set(versions))
    inside = [t for t in mixed if any(turn.start < at < turn.end for at, _ in t.versions or [] for turn in t.turns)]
    assert inside, "no load landed inside a turn"


@pytest.mark.slow
def test_a_local_multiturn_run_with_interruptible_loads_passes_the_checker(tmp_path: Path) -> None:
    """The hf engine on the shipped tiny model, multi-turn at staleness 1 with interruptible
    loads (whether a load lands inside a turn depends on timing; the unit tests force one):
    the run completes, balanced, checked, staleness within the window."""
    sets = [
        "run.backend=local",
        "task.kind=arithmetic",
        "task.heldout_size=16",
        "run.steps=3",
        "rollout.num_generations=4",
        "rollout.groups_per_step=4",
        "rollout.max_new_tokens=4",
        "train.row_tokens=48",
        "eval.enabled=false",
        "orchestrator.release_memory=false",
        *MULTITURN,
    ]
    result = run_checked(make_program(load_config(None, sets), tmp_path), timeout=180)
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == 12 and settled_groups(ledger) == ledger["groups_dispatched"]
    assert all(int(cast(int, r.metrics["staleness_max"])) <= 1 for r in result.results)
    assert any(s.args.get("turn") == 2 for s in trace_spans(result) if s.name == "generate")
