"""Runs with rollout.interruptible on the sim: generations that a weight load interrupted carry
both versions, their trajectories count the oldest, and the run passes check-trace; at
max_staleness 0 nothing is interrupted."""

from __future__ import annotations

from pathlib import Path

from relayrl.analysis.timeline import spans
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
