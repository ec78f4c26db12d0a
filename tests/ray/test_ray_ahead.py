"""Queue ahead on Ray (docs/design.md, "queue ahead"): the next step's first micro-batch is sent to
the trainer actor right behind optim_step, so the actor starts it the moment the update ends; the
run's outcome is what it is without it. One local Ray cluster for the module."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from relayrl.analysis import timeline  # noqa: E402
from relayrl.analysis.checker import check_events, check_run_dir  # noqa: E402
from relayrl.backends.local.build import load_base, make_trainer  # noqa: E402
from relayrl.backends.ray.actors import RayTrainer, TrainStepError  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.backends.sim.workers import SimTrainer  # noqa: E402
from relayrl.config.schema import load_config  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from relayrl.orchestrator.deadlines import BoundedTrainer, CallTimeoutError  # noqa: E402
from relayrl.orchestrator.program import RunResult  # noqa: E402
from relayrl.types import TrainBatch  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402
from support.simutil import event_args, run_checked, sim_config  # noqa: E402

cluster = pytest.fixture(scope="module")(local_cluster)

SIM_RAY = [
    "ray.enabled=true",
    "ray.address=auto",
    "run.steps=8",
    # N+1's groups may be sampled a step early, so they are packed by the time optim_step(N) is
    # issued even on a loaded machine (rule 9) and every boundary can queue ahead
    "rollout.max_staleness=2",
    "sim.generate_per_request=0.002",
    "sim.train_step=0.03",
    "sim.optim_step=0.01",
]


def _sim_run(tmp_path: Path, name: str, queue_ahead: bool) -> tuple[RunResult, RayTrainer]:
    program = build_program(sim_config(*SIM_RAY, f"ray.queue_ahead={str(queue_ahead).lower()}"), run_dir=tmp_path / name)
    trainer = program.backend.trainer
    assert isinstance(trainer, RayTrainer) and trainer.queue_ahead is queue_ahead
    return run_checked(program), trainer  # check-trace passes (structure on both trainer lanes)


def _actor_gaps(all_spans: list[timeline.Span]) -> dict[int, float]:
    """Per step N+1, the actor's end of optim_step(N) to its start of train_step(N+1, mb 0)."""
    lane = "actor:trainer"
    optim_end = {s.step: s.end for s in all_spans if s.lane == lane and s.name == "optim_step"}
    first = {s.step: s.start for s in all_spans if s.lane == lane and s.name == "train_step" and s.args.get("microbatch") == 0}
    return {n + 1: first[n + 1] - optim_end[n] for n in optim_end if n + 1 in first}


@pytest.mark.slow
def test_next_first_microbatch_is_queued_behind_optim_step_and_the_run_is_unchanged(cluster: RayCluster, tmp_path: Path) -> None:
    ahead_result, ahead_trainer = _sim_run(tmp_path, "ahead", queue_ahead=True)
    plain_result, plain_trainer = _sim_run(tmp_path, "plain", queue_ahead=False)
    steps = 8
    ahead_spans, plain_spans = timeline.spans(ahead_result.tracer.events), timeline.spans(plain_result.tracer.events)

    # on most boundaries (rule 9 packs N+1's first micro-batch while N's final one trains) the
    # first micro-batch went out behind optim_step; both trainer lanes say which
    assert ahead_trainer.queued_ahead >= steps - 2, ahead_trainer.queued_ahead
    queued = {s.step for s in ahead_spans if s.lane == "actor:trainer" and s.name == "train_step" and s.args.get("ahead")}
    issued = {s.step for s in ahead_spans if s.lane == "trainer" and s.name == "train_step" and s.args.get("ahead")}
    assert len(queued) == ahead_trainer.queued_ahead and queued == issued
    assert all(s.args["microbatch"] == 0 for s in ahead_spans if s.args.get("ahead"))
    assert plain_trainer.queued_ahead == 0 and not any(s.args.get("ahead") for s in plain_spans)

    optim = {s.step: s for s in ahead_spans if s.lane == "actor:trainer" and s.name == "optim_step"}
    orchestrator_optim = {s.step: s for s in ahead_spans if s.lane == "trainer" and s.name == "optim_step"}
    for s in ahead_spans:
        if s.lane == "actor:trainer" and s.args.get("ahead"):
            # sent before optim_step(N)'s result came back: no driver round trip between the two
            assert s.args["call_start"] < optim[s.step - 1].args["call_end"]  # type: ignore[operator]
        if s.lane == "trainer" and s.args.get("ahead"):
            # issued on the orchestrator's lane only after the commit (structure and the deferred points hold)
            assert s.start >= orchestrator_optim[s.step - 1].end
    gaps = _actor_gaps(ahead_spans)
    ahead_gap = statistics.median(gaps[n] for n in queued)
    plain_gap = statistics.median(_actor_gaps(plain_spans).values())
    # inside the actor the queued micro-batch starts about at once; without it, a driver round trip later
    assert ahead_gap < plain_gap / 3, (ahead_gap, plain_gap)
    assert all(g >= 0 for g in (r.metrics.get("boundary_gap_sec") or 0.0 for r in ahead_result.results))

    # the same run: every group accounted for the same way, the same versions committed
    assert ahead_result.ledger.as_dict() == plain_result.ledger.as_dict()
    versions = [r.metrics.get("policy_version") for r in ahead_result.results]
    assert versions == [r.metrics.get("policy_version") for r in plain_result.results] == list(range(1, steps + 1))
    assert [r.step for r in ahead_result.results] == list(range(1, steps + 1))


def test_check_trace_flags_a_queued_microbatch_the_actor_ran_before_the_update(cluster: RayCluster, tmp_path: Path) -> None:
    result, trainer = _sim_run(tmp_path, "run", queue_ahead=True)
    assert trainer.queued_ahead >= 1
    events = copy.deepcopy(list(result.tracer.events))
    optim_ts = {
        e["args"]["step"]: e["ts"]  # type: ignore[index]
        for e in events
        if e.get("cat") == "actor:trainer" and e.get("name") == "optim_step"
    }
    moved = next(e for e in events if e.get("cat") == "actor:trainer" and event_args(e).get("ahead"))
    step = moved["args"]["step"]  # type: ignore[index]
    moved["ts"] = optim_ts[step - 1]  # as if the actor had run it alongside optim_step(step - 1)
    violations = check_events(events).violations
    assert any(
        v.startswith(f"structure: actor:trainer train_step(step {step})") and "(queued ahead) starts before" in v for v in violations
    ), violations


def test_a_failing_queued_train_step_fails_the_run_naming_the_step(cluster: RayCluster, tmp_path: Path) -> None:
    program = build_program(sim_config(*SIM_RAY), run_dir=tmp_path / "run")
    trainer = program.backend.trainer
    assert isinstance(trainer, RayTrainer)
    optim_step_ahead = trainer.optim_step_ahead
    poisoned_steps: list[int] = []

    async def poison_from_step_2(ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
        def poisoned() -> TrainBatch | None:
            batch = ahead()
            if batch is not None and batch.step >= 2 and not poisoned_steps:  # the sim trainer's train_step fails on it
                poisoned_steps.append(batch.step)
                batch = dataclasses.replace(batch, advantages=["not a number"])  # type: ignore[list-item]
            return batch

        return await optim_step_ahead(poisoned)

    trainer.optim_step_ahead = poison_from_step_2  # type: ignore[method-assign]
    with pytest.raises(TrainStepError) as failed:
        asyncio.run(asyncio.wait_for(program.run(), 60))
    assert poisoned_steps, "no micro-batch was queued ahead from step 2 on"
    n = poisoned_steps[0]
    named = f"train_step(step {n}, microbatch 0), queued behind optim_step(step {n - 1}), failed in the trainer actor: TypeError"
    assert named in str(failed.value)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and named in summary["error"]
    assert summary["steps_completed"] <= n
    assert check_run_dir(tmp_path / "run").ok


def test_an_update_with_a_queued_microbatch_is_bounded_like_optim_step(cluster: RayCluster, tmp_path: Path) -> None:
    cfg = sim_config(*SIM_RAY, "train.call_timeout_s=0.5")
    program = build_program(cfg, run_dir=tmp_path / "run")
    trainer = program.backend.trainer
    assert isinstance(trainer, RayTrainer) and program.trainer.queue_ahead
    assert not BoundedTrainer(SimTrainer(cfg.sim), 0.5).queue_ahead  # trainers without it keep the plain path
    optim_step_ahead = trainer.optim_step_ahead

    async def hangs_at_version_3(ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
        version, queued = await optim_step_ahead(ahead)
        if version == 3:
            await asyncio.Event().wait()
        return version, queued

    trainer.optim_step_ahead = hangs_at_version_3  # type: ignore[method-assign]
    with pytest.raises(CallTimeoutError, match=r"trainer call optim_step did not return within 0.5s \(train.call_timeout_s\)"):
        asyncio.run(asyncio.wait_for(program.run(), 60))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "optim_step" in summary["error"]


@pytest.mark.slow
def test_torch_steps_queued_ahead_train_as_the_same_calls_in_order(cluster: RayCluster, tmp_path: Path) -> None:
    """The default recipe's torch trainer in its actor, with micro-batches queued ahead: every
    step's loss and gradient norm (the latter reads the weights of every earlier update) equal, to
    1e-6, those of the same micro-batches trained in order, one call at a time, in this process."""
    cfg = load_config(
        None,
        [
            "run.backend=local",
            "run.steps=4",
            "eval.enabled=false",
            "rollout.groups_per_step=2",
            "rollout.num_generations=8",
            "rollout.max_staleness=2",  # generation on 2 busy cores: time to pack the next step ahead
            "train.row_tokens=48",
            "train.rows_per_microbatch=1",  # a group per row: two micro-batches per step
            "train.torch_threads=1",
            "algorithm.dynamic_sampling=true",  # every trained group carries a gradient
            "orchestrator.release_memory=false",
            "ray.enabled=true",
            "ray.address=auto",
        ],
    )
    program = build_program(cfg, run_dir=tmp_path / "run")
    trainer = program.backend.trainer
    assert isinstance(trainer, RayTrainer)
    calls: list[TrainBatch | None] = []  # the trainer's calls in their logical order (None: optim_step)
    train_step, optim_step, optim_step_ahead = trainer.train_step, trainer.optim_step, trainer.optim_step_ahead

    async def record_train(batch: TrainBatch) -> None:
        calls.append(batch)
        await train_step(batch)

    async def record_optim() -> int:
        calls.append(None)
        return await optim_step()

    async def record_optim_ahead(ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
        def recorded() -> TrainBatch | None:
            batch = ahead()  # asked for once the update is sent: after it in the trainer's order
            if batch is not None:
                calls.append(batch)
            return batch

        calls.append(None)
        return await optim_step_ahead(recorded)

    trainer.train_step, trainer.optim_step, trainer.optim_step_ahead = record_train, record_optim, record_optim_ahead  # type: ignore[method-assign]
    result = asyncio.run(asyncio.wait_for(program.run(), 300))
    assert check_run_dir(tmp_path / "run").ok
    assert trainer.queued_ahead >= 1, "nothing was queued ahead: the test did not exercise it"
    ran = [(r.metrics["train/loss"], r.metrics["train/grad_norm"]) for r in result.results]

    model, _ = load_base(cfg)
    local = make_trainer(cfg, model, 1)
    replayed: list[tuple[float, float]] = []

    async def replay() -> None:
        try:
            for batch in calls:
                if batch is None:
                    await local.optim_step()
                    metrics = await local.get_metrics()
                    replayed.append((metrics["loss"], metrics["grad_norm"]))
                else:
                    await local.train_step(batch)
        finally:
            await local.close()

    asyncio.run(replay())
    assert len(replayed) == len(ran) == cfg.run.steps
    for (loss, norm), (loss2, norm2) in zip(ran, replayed, strict=True):
        assert loss == pytest.approx(loss2, rel=1e-6, abs=1e-6) and norm == pytest.approx(norm2, rel=1e-6, abs=1e-6)
