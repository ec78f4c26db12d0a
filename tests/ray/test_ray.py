"""The Ray backend (relayrl.backends.ray): sim and local workers in Ray actors on one local
cluster shared by the module (each cluster start costs seconds), plus one CLI run that starts and
stops its own cluster."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from relayrl.analysis import timeline  # noqa: E402
from relayrl.analysis.checker import check_run_dir  # noqa: E402
from relayrl.backends.ray.actors import RaySampler, RayTrainer, trainer_call  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.backends.ray.transport import ArrayState, decode, encode  # noqa: E402
from relayrl.backends.registry import build_backend  # noqa: E402
from relayrl.config.schema import load_config  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from relayrl.types import TrainBatch  # noqa: E402
from support.cli import relayrl  # noqa: E402
from support.rayutil import local_cluster, processes_with  # noqa: E402
from support.simutil import run_checked, settled_groups, sim_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


cluster = pytest.fixture(scope="module")(local_cluster)


@pytest.mark.slow
def test_sim_run_on_ray_completes_balances_and_passes_the_checker(cluster: RayCluster, tmp_path: Path) -> None:
    sets = ["ray.enabled=true", "ray.address=auto", "rollout.num_samplers=2", "sim.generate_per_request=0.005", "sim.train_step=0.02"]
    cfg = sim_config(*sets)
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run"))
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == cfg.run.steps * cfg.rollout.groups_per_step
    assert settled_groups(ledger) == ledger["groups_dispatched"]
    assert check_run_dir(tmp_path / "run").ok
    events = result.tracer.events
    names = {e.get("name") for e in events}
    assert "ray_start" in names
    assert ray.is_initialized()  # a joined cluster is left running
    # the actors' own spans are on the run's clock, each inside the orchestrator's call of it
    all_spans = timeline.spans(events)
    clocks = {e["args"]["lane"] for e in events if e.get("name") == "relayrl_clock"}  # type: ignore[index]
    assert clocks == {"actor:trainer", "actor:sampler/0", "actor:sampler/1"}
    calls = [s for s in all_spans if s.lane == "trainer" and s.name == "train_step"]
    inside = [s for s in all_spans if s.lane == "actor:trainer" and s.name == "train_step"]
    assert [(s.step, s.args["microbatch"]) for s in inside] == [(s.step, s.args["microbatch"]) for s in calls]
    for span in inside:  # the round trip is outside the actor's span
        assert span.args["call_start"] < span.start and span.end < span.args["call_end"]  # type: ignore[operator]
    # each micro-batch after the first of its step was sent before the previous one's result came
    # back (one ahead), so the trainer need not wait a round trip between them
    for before, after in zip(inside, inside[1:]):
        if after.step == before.step:
            assert after.args["call_start"] < before.args["call_end"]  # type: ignore[operator]
    assert {s.step for s in all_spans if s.lane == "actor:trainer" and s.name == "optim_step"} == set(range(1, cfg.run.steps + 1))
    for replica in (0, 1):
        assert any(s.lane == f"actor:sampler/{replica}" and s.name == "generate" for s in all_spans)
        assert any(s.lane == f"actor:sampler/{replica}" and s.name == "load_weights" for s in all_spans)
    # each generate span, the actor's and the driver's, records its decode rows and passes (relayrl.plan fits from them)
    for lane in ("actor:sampler/0", "sampler/0"):
        generated = [s for s in all_spans if s.lane == lane and s.name == "generate"]
        assert all(s.args["sequences"] == s.args["n"] * cfg.rollout.num_generations for s in generated)  # type: ignore[operator]
        assert all(1 <= s.args["steps"] <= cfg.rollout.max_new_tokens for s in generated)  # type: ignore[operator]
    # the trainer's busy fraction is read inside its actor: the calls' round trips count as idle
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trainer_busy_fraction"] == pytest.approx(timeline.trainer_busy_fraction(all_spans))

    # ... and its busy time is the actor's own: each call's span in the actor lies inside the
    # call's window on the driver (sent to returned), which adds the round trip. (Not the driver's
    # "trainer" lane: with a micro-batch sent ahead its train_step span ends when the previous
    # one returns, so its seconds match the actor's only up to the hops: they read up to 0.008 s
    # under the actor's once the actors ran at the driver's priority.)
    def busy_seconds(lane: str) -> float:
        return sum(s.dur for s in all_spans if s.lane == lane and s.name in ("train_step", "optim_step"))

    windows = sum(
        float(s.args["call_end"]) - float(s.args["call_start"])  # type: ignore[arg-type, misc]
        for s in all_spans
        if s.lane == "actor:trainer" and s.name in ("train_step", "optim_step")
    )
    assert timeline.trainer_lane(all_spans) == "actor:trainer"
    assert busy_seconds("actor:trainer") < windows


def test_trainer_actor_answers_get_metrics_while_a_train_step_runs(cluster: RayCluster) -> None:
    cfg = sim_config("ray.enabled=true", "ray.address=auto", "sim.train_step=1.0")
    backend = build_backend(cfg, __import__("threading").Event(), evaluate=False)
    trainer = backend.trainer
    assert isinstance(trainer, RayTrainer)
    batch = TrainBatch(0, 0, None, num_tokens=8, num_sequences=1, advantages=[1.0], step_completion_tokens=4, step_sequences=1)

    async def go() -> None:
        try:
            train_ref = trainer_call(trainer.actor, "train_step", 0, batch)
            fetch = await trainer_call(trainer.actor, "get_metrics")
            still_training = not ray.wait([train_ref], timeout=0)[0]
            train = await train_ref
            assert still_training  # the fetch came back while the train step was running
            assert fetch.end < train.end
        finally:
            await backend.close()

    asyncio.run(go())


def test_samplers_load_an_export_ahead_as_it_ends_with_the_version_it_exported(cluster: RayCluster) -> None:
    cfg = sim_config("ray.enabled=true", "ray.address=auto", "rollout.num_samplers=2", "sim.weight_sync=0.3")
    backend = build_backend(cfg, __import__("threading").Event(), evaluate=False)
    trainer, samplers = backend.trainer, [s for s in backend.samplers if isinstance(s, RaySampler)]
    assert isinstance(trainer, RayTrainer) and len(samplers) == 2
    batch = TrainBatch(0, 0, None, num_tokens=8, num_sequences=1, advantages=[1.0], step_completion_tokens=4, step_sequences=1)

    async def go() -> None:
        try:
            await trainer.train_step(batch)
            assert await trainer.optim_step() == 1
            await trainer.train_step(batch)
            await trainer._drain()
            unseen = await trainer._send("optim_step")  # committed in the actor before the export runs, not yet seen by the driver
            await unseen.ref
            pending = await trainer.export_ahead()
            assert pending.weights.version == 1  # what the driver knew when it sent the export
            loads = [asyncio.ensure_future(s.load_weights(pending.weights)) for s in samplers]
            await asyncio.sleep(0.1)
            assert not any(load.done() for load in loads)  # each waits for the export (0.3 s) in its actor
            exported = await pending.done
            await asyncio.gather(*loads)
            assert exported.version == 2
            assert [await s.loaded_version() for s in samplers] == [2, 2]  # the version exported, not the one sent
            await trainer._result(unseen)
        finally:
            await backend.close()

    asyncio.run(go())


def test_a_load_waiting_for_an_export_that_timed_out_is_cancelled_in_its_actor(cluster: RayCluster) -> None:
    from relayrl.orchestrator.deadlines import BoundedTrainer, CallTimeoutError
    from relayrl.orchestrator.publisher import WeightPublisher
    from relayrl.orchestrator.replicas import ReplicaPool
    from relayrl.telemetry.tracer import Tracer

    cfg = sim_config("ray.enabled=true", "ray.address=auto", "rollout.num_samplers=1", "sim.weight_sync=60")  # the export hangs
    backend = build_backend(cfg, __import__("threading").Event(), evaluate=False)
    [sampler] = [s for s in backend.samplers if isinstance(s, RaySampler)]
    pool = ReplicaPool.of(backend.samplers, failover=True)
    publisher = WeightPublisher(BoundedTrainer(backend.trainer, 0.5), pool, Tracer(None, {}), load_timeout_s=30.0)

    async def go() -> None:
        try:
            with pytest.raises(CallTimeoutError, match="export_weights"):
                await publisher.publish_newest()
            assert pool.retired == []
            # the actor serves calls one at a time: it answers only once the load waiting for the export was cancelled there
            assert await asyncio.wait_for(sampler.loaded_version(), 10.0) is None
        finally:
            await backend.close()

    asyncio.run(go())


@pytest.mark.slow
def _thread_niceness(pid: int) -> dict[int, int]:
    """Each thread of process `pid` -> its niceness (Linux /proc: field 19 of the thread's stat)."""
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[16])  # fields after the command name, from field 3
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread niceness from Linux /proc")
def test_actors_run_at_the_drivers_priority(cluster: RayCluster) -> None:
    # Ray starts workers 15 nicer than its raylet: the trainer actor then ran below the driver
    # (in one process the trainer thread runs at the orchestrator's priority), losing the CPU to
    # it on busy cores (issue 31 section 5)
    cfg = sim_config("ray.enabled=true", "ray.address=auto", "rollout.num_samplers=2")
    backend = build_backend(cfg, __import__("threading").Event(), evaluate=False)
    trainer = backend.trainer
    assert isinstance(trainer, RayTrainer)
    driver = os.getpriority(os.PRIO_PROCESS, 0)

    async def go() -> None:
        try:
            pids = [await trainer.actor.pid.remote()]
            pids += [await s.actor.pid.remote() for s in backend.samplers if isinstance(s, RaySampler)]
            assert len(set(pids)) == 3 and os.getpid() not in pids
            for pid in pids:
                threads = _thread_niceness(pid)
                assert set(threads.values()) == {driver}, (pid, threads)
        finally:
            await backend.close()

    asyncio.run(go())


def test_local_backend_on_ray_trains_and_its_weights_reach_the_samplers(cluster: RayCluster, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "run.backend=local",
            "run.steps=2",
            "eval.enabled=false",
            "rollout.groups_per_step=2",
            "rollout.num_generations=2",
            "orchestrator.release_memory=false",
            "ray.enabled=true",
            "ray.address=auto",
        ],
    )
    program = build_program(cfg, run_dir=tmp_path / "run")
    samplers = list(program.backend.samplers)
    versions: list[int | None] = []

    async def go() -> None:
        await program.run()

    for s in samplers:  # ask each sampler actor what it loaded, just before it is closed
        assert isinstance(s, RaySampler)
        s.close = _probe_then_close(s, versions)  # type: ignore[method-assign]
    asyncio.run(asyncio.wait_for(go(), 120))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    assert check_run_dir(tmp_path / "run").ok
    assert versions and all(v is not None and v >= 1 for v in versions), versions


def _probe_then_close(sampler: RaySampler, versions: list[int | None]) -> Callable[[], Coroutine[Any, Any, None]]:
    close = sampler.close

    async def probe() -> None:
        versions.append(await sampler.loaded_version())
        await close()

    return probe


@pytest.mark.slow
def test_a_run_that_starts_its_own_cluster_leaves_no_ray_process(cluster: RayCluster, tmp_path: Path) -> None:
    marker = f"RELAYRL_TEST_RUN={uuid.uuid4().hex}"  # inherited by every process the run starts
    name, value = marker.split("=")
    recipe = ROOT / "src" / "relayrl" / "recipes" / "sim.toml"
    args = ["train", str(recipe), "--ray", "--set", "ray.num_cpus=1", "--set", "run.steps=3", "--set", f"run.output_dir={tmp_path}"]
    res = relayrl(*args, cwd=tmp_path, env={"COLUMNS": "160", name: value}, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "started a local Ray cluster" in res.stdout
    assert processes_with(marker) == []  # not the raylet, the GCS server, nor the raylet's agents and workers


@dataclass
class _Batch:
    ids: torch.Tensor
    mask: torch.Tensor
    rows: int


def test_tensors_cross_as_numpy_arrays_and_come_back_equal() -> None:
    weights = {"w": torch.randn(3, 4), "h": torch.randn(5).to(torch.bfloat16)}
    sent = encode(weights)
    assert isinstance(sent, ArrayState) and sent.bfloat16 == ("h",)
    back = decode(sent)
    assert isinstance(back, dict) and back.keys() == weights.keys()
    assert back["h"].dtype == torch.bfloat16 and torch.equal(back["h"], weights["h"]) and torch.equal(back["w"], weights["w"])
    batch = _Batch(torch.arange(6).view(2, 3), torch.ones(2, 3, dtype=torch.bool), rows=2)
    sent = encode(batch)
    assert isinstance(sent, ArrayState) and sent.cls is _Batch and sent.other == {"rows": 2}
    for array in sent.arrays.values():  # as read back from the object store: read-only shared memory
        array.flags.writeable = False
    viewed, copied = decode(sent), decode(sent, writable=True)
    assert isinstance(viewed, _Batch) and isinstance(copied, _Batch)
    assert torch.equal(copied.ids, batch.ids) and torch.equal(copied.mask, batch.mask) and copied.rows == 2
    assert viewed.ids.data_ptr() == sent.arrays["ids"].ctypes.data  # weights: a view, the receiver copies
    assert copied.ids.data_ptr() != sent.arrays["ids"].ctypes.data
    copied.ids += 1  # a batch the trainer may change in place
    assert encode(None) is None and encode({}) == {} and encode([1, 2]) == [1, 2]


def test_a_tied_weight_crosses_once_and_stays_tied() -> None:
    """A tied pair is one array on the wire (the bytes sent are the unique bytes) and one tensor
    after `decode`, under both names, in the payload's order."""
    import pickle

    head = torch.randn(8, 4).to(torch.bfloat16)
    weights = {"embed": head, "w": torch.randn(3, 4), "lm_head": head.detach()}
    sent = encode(weights)
    assert isinstance(sent, ArrayState) and sent.aliases == {"lm_head": "embed"}
    buffers: list[pickle.PickleBuffer] = []
    pickle.dumps(sent, protocol=5, buffer_callback=buffers.append)  # as Ray serialises it: arrays out of band
    assert sum(memoryview(b).nbytes for b in buffers) == head.nbytes + weights["w"].nbytes
    back = decode(sent)
    assert isinstance(back, dict) and list(back) == list(weights)
    assert back["lm_head"] is back["embed"] and back["embed"].dtype == torch.bfloat16 and torch.equal(back["embed"], head)
    assert torch.equal(back["w"], weights["w"])


def test_multiturn_episodes_on_ray_actors(cluster: RayCluster, tmp_path: Path) -> None:
    """Multi-turn episodes with sampler actors: each turn is one generate_turns call on the actor
    (its lane shows them), the environment steps on the driver, and the run passes the checker."""
    sets = ["ray.enabled=true", "ray.address=auto", "rollout.num_samplers=2", "task.environment=arithmetic_feedback", "rollout.max_turns=3"]
    result = run_checked(build_program(sim_config(*sets, "rollout.max_new_tokens=4"), run_dir=tmp_path / "run"))
    assert any(float(r.metrics["turns_mean"]) > 1.0 for r in result.results)  # type: ignore[arg-type]
    all_spans = timeline.spans(result.tracer.events)
    actor_turns = [s for s in all_spans if s.lane.startswith("actor:sampler/") and s.name == "generate_turns"]
    assert actor_turns and any(s.lane == "env" and s.name == "env_step" for s in all_spans)
    for t in result.records[-1].trajectories:
        assert t.turns and t.policy_version == min(turn.policy_version for turn in t.turns)


@pytest.mark.slow
def test_several_updates_per_step_on_the_ray_trainer_actor(cluster: RayCluster, tmp_path: Path) -> None:
    """The trainer actor wraps the local trainer: ppo_epochs × minibatches_per_step updates inside
    each step's one optim_step, the trace still checked (one commit per step)."""
    cfg = load_config(
        None,
        [
            "run.backend=local",
            "run.steps=2",
            "eval.enabled=false",
            "rollout.groups_per_step=2",
            "rollout.num_generations=2",
            "train.ppo_epochs=2",
            "train.minibatches_per_step=2",
            "orchestrator.release_memory=false",
            "ray.enabled=true",
            "ray.address=auto",
        ],
    )
    asyncio.run(asyncio.wait_for(build_program(cfg, run_dir=tmp_path / "run").run(), 120))
    assert check_run_dir(tmp_path / "run").ok
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/updates"]) for r in rows] == [(1, 4.0), (2, 4.0)]
