"""Weight transports on Ray (issue 31 §1): a local-backend run on one local cluster with each
Ray transport passes check-trace, and the collective one delivers the trainer's committed weights
bit for bit to every sampler actor (read inside the actors)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from relayrl.analysis import timeline  # noqa: E402
from relayrl.analysis.checker import check_run_dir  # noqa: E402
from relayrl.backends.ray.actors import RaySampler, RayTrainer  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.config.schema import load_config  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from relayrl.types import Weights  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402
from support.simutil import event_args  # noqa: E402

pytestmark = pytest.mark.torch

cluster = pytest.fixture(scope="module")(local_cluster)


def _config(transport: str, samplers: int) -> Any:
    return load_config(
        None,
        [
            "run.backend=local",
            "run.steps=2",
            "eval.enabled=false",
            "rollout.groups_per_step=2",
            "rollout.num_generations=2",
            f"rollout.num_samplers={samplers}",
            f"rollout.weight_transport={transport}",
            "orchestrator.release_memory=false",
            "ray.enabled=true",
            "ray.address=auto",
        ],
    )


def _state(actor: Any, trainer: bool) -> tuple[dict[str, torch.Tensor], int | None]:
    """The weights inside an actor: the trainer's committed snapshot, a sampler's model."""

    def read(self: Any) -> tuple[dict[str, torch.Tensor], int | None]:
        if trainer:
            snapshot = self._worker.compute.committed_weights()
            return {k: v.clone() for k, v in snapshot.payload.items()}, snapshot.version
        return {k: v.clone() for k, v in self._worker.compute.model.state_dict().items()}, self._loaded

    state: tuple[dict[str, torch.Tensor], int | None] = ray.get(actor.__ray_call__.remote(read))
    return state


def _run(transport: str, samplers: int, tmp_path: Path) -> tuple[list[Any], Any]:
    program = build_program(_config(transport, samplers), run_dir=tmp_path / "run")
    seen: list[Any] = []
    trainer = program.backend.trainer
    assert isinstance(trainer, RayTrainer)
    ray_samplers = [s for s in program.backend.samplers if isinstance(s, RaySampler)]
    close = trainer.close

    async def probe_then_close() -> None:  # the trainer closes after the samplers: read them all first
        seen.append(_state(trainer.actor, trainer=True))
        await close()

    for s in ray_samplers:
        s_close = s.close

        async def read_then_close(s: RaySampler = s, s_close: Any = s_close) -> None:
            seen.append(_state(s.actor, trainer=False))
            await s_close()

        s.close = read_then_close  # type: ignore[method-assign]
    trainer.close = probe_then_close  # type: ignore[method-assign]
    result = asyncio.run(asyncio.wait_for(program.run(), 180))
    report = check_run_dir(tmp_path / "run")
    assert report.ok, report.violations
    assert report.completed
    return seen, result


@pytest.mark.slow
def test_collective_run_passes_check_trace_and_delivers_bit_identical_weights(cluster: RayCluster, tmp_path: Path) -> None:
    seen, result = _run("collective", 2, tmp_path)
    *sampler_states, (trainer_state, trainer_version) = seen
    assert trainer_version == 2
    for state, version in sampler_states:
        assert version == trainer_version
        assert set(state) == set(trainer_state)
        for name, tensor in trainer_state.items():
            assert torch.equal(state[name], tensor), name  # bit for bit
    spans = timeline.spans(result.tracer.events)
    broadcasts = [s for s in spans if s.lane == "actor:trainer" and s.name == "broadcast_weights"]
    assert len(broadcasts) >= 2  # one per committed version (each sync round)
    for replica in (0, 1):
        loads = [s for s in spans if s.lane == f"actor:sampler/{replica}" and s.name == "load_weights"]
        assert loads and all(s.args.get("transport") == "collective" and s.args.get("received_by") == "actor" for s in loads)


@pytest.mark.slow
def test_object_store_run_passes_check_trace(cluster: RayCluster, tmp_path: Path) -> None:
    seen, result = _run("object_store", 1, tmp_path)
    spans = timeline.spans(result.tracer.events)
    assert not [s for s in spans if s.name == "broadcast_weights"]
    assert [s for s in spans if s.lane == "actor:sampler/0" and s.name == "load_weights"]
    (state, version), (trainer_state, trainer_version) = seen
    assert version == trainer_version == 2
    assert all(torch.equal(state[n], t) for n, t in trainer_state.items())


@pytest.mark.slow
def test_bench_weights_measures_both_ray_transports_on_the_tiny_model(cluster: RayCluster) -> None:
    from relayrl.bench.weights import run_weights

    figures = run_weights(["tiny"], replicas=2, versions=1, ray_address="auto", sharded=False)
    tiny = figures["models"]["tiny"]  # type: ignore[index]
    assert set(tiny["transports"]) == {"direct", "file", "object_store", "collective"}
    for name in ("object_store", "collective"):
        t = tiny["transports"][name]
        assert {"seconds_per_version", "gb_per_s", "host_copies"} <= set(t) and t["seconds_per_version"] > 0
    assert tiny["transports"]["object_store"]["host_copies"] == pytest.approx(1.0)  # the one ray.put
    # the trainer's bucket, and each receiver's (gloo on the CPU stages in host memory)
    assert tiny["transports"]["collective"]["host_copies"] == pytest.approx(3.0)


@pytest.mark.slow
def test_a_sampler_actor_killed_in_a_collective_run_is_restarted_and_the_run_completes(cluster: RayCluster, tmp_path: Path) -> None:
    """Replica 1's actor process is killed once version 1 reached both replicas: either the next
    round's broadcast fails (the group is broken for good; the surviving replica loads that
    version from the object store instead and the killed one's load fails) or a sampling call sees
    the death first (the replica restarts and is no member: no round is broadcast again); either
    way it stays in service, its restarted process loads from the object store, later rounds use
    the object store, and the run completes, its trace checked."""
    import warnings

    from relayrl.backends.ray.collective import RayBroadcast
    from relayrl.orchestrator.replicas import SamplerRestartedWarning

    sets = [
        "run.backend=local",
        "run.steps=4",
        "eval.enabled=false",
        "rollout.groups_per_step=2",
        "rollout.num_generations=2",
        "rollout.num_samplers=2",
        "rollout.weight_transport=collective",
        "orchestrator.release_memory=false",
        "ray.enabled=true",
        "ray.address=auto",
    ]
    program = build_program(load_config(None, sets), run_dir=tmp_path / "run")
    broadcast = program.backend.broadcast
    assert isinstance(broadcast, RayBroadcast)
    victim = program.backend.samplers[1]
    assert isinstance(victim, RaySampler)

    load = victim.load_weights
    killed: list[int] = []

    async def load_then_kill(weights: Weights) -> None:
        """Version 1's load, then the kill, before the run goes on: later rounds and sampling
        calls follow it, so the death is seen while the run lasts (a kill from a task of its
        own could land after the last round under load: then nothing sees it)."""
        await load(weights)
        if weights.version >= 1 and not killed:
            killed.append(weights.version)
            ray.kill(victim.actor, no_restart=False)  # Ray restarts its process
            await asyncio.sleep(1.0)  # dead by now

    victim.load_weights = load_then_kill  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SamplerRestartedWarning)
        asyncio.run(asyncio.wait_for(program.run(), 240))
    assert killed
    report = check_run_dir(tmp_path / "run")
    assert report.ok, report.violations
    assert report.completed
    assert len(program.replicas.slots) == 2  # neither replica retired
    assert not victim.collective_member  # its process died: the restarted one joined no group
    events = [e for e in program.tracer.events if e.get("name") in ("broadcast_weights", "load_weights", "load_weights_failed")]
    names = [e["name"] for e in events]
    assert names.count("broadcast_weights") >= 1  # version 1's at least
    after = events[len(names) - names[::-1].index("broadcast_weights") :]  # after the last broadcast
    loads = [e for e in after if e["name"] == "load_weights"]
    assert loads and all(event_args(e).get("transport") in (None, "object_store") for e in loads)  # the object store from then on
    # Two orders are right, by when the death is seen: a broadcast finds the member gone (the group
    # breaks for good and the killed replica's load fails), or a sampling call does first (the
    # replica restarts, no longer a member, and no round is broadcast again).
    if broadcast.broken is not None:
        assert any(e["name"] == "load_weights_failed" for e in after)  # the killed replica's load


def test_a_sampler_actor_whose_engine_joins_the_group_receives_there_and_falls_back_to_the_object_store(cluster: RayCluster) -> None:
    """A sampler actor whose worker's engine can join the weight group (a vLLM replica started
    with relayrl's weight-transfer engine; here a stand-in) joins it in the actor's place: round 1
    lands in the engine, not in the actor (`Received.in_engine`); when round 2's receive fails
    there, the actor loads the trainer's version from the object store, the replica is no member
    any more, and the trainer's broadcast of that round reports failure."""
    import functools

    from relayrl.backends.ray.actors import SamplerActor, TrainerActor
    from relayrl.backends.ray.collective import Broadcast, Member, join
    from relayrl.bench.weights import BenchSampler, BenchTrainer

    class EngineSampler(BenchSampler):
        """A stand-in `VllmSampler` with relayrl's weight-transfer engine: its "engine" joins the
        group (`transfer_refusal` None, `join_transfer`, `receive_round`) and loads what it receives
        into a plain model; from round `fail_from` on its receive fails after leaving the group, as
        relayrl's engine does. `loaded`: ("engine", version) per round received, ("load_weights",
        version) per other load. (Defined here: Ray's workers cannot import the tests' modules.)"""

        def __init__(self, model: str, dtype: str, seed: int, fail_from: int) -> None:
            super().__init__(model, dtype, seed)
            self.fail_from = fail_from
            self.loaded: list[tuple[str, int]] = []
            self._member: Any = None

        def transfer_refusal(self) -> str | None:
            return None

        async def join_transfer(self, host: str, port: int, receiver: int, world: int, backend: str, timeout_s: float) -> None:
            self._member = await asyncio.to_thread(Member.join, host, port, backend, timeout_s, world - 1, receiver=receiver)

        async def receive_round(self, round_: int, version: int | None = None) -> int:
            if round_ >= self.fail_from:
                error = RuntimeError(f"the stand-in engine fails round {round_}")
                self._member.fail(error)  # (leaves the group: the trainer's broadcast fails at once)
                raise error
            got, views = await asyncio.to_thread(self._member.receive, round_)
            await super().load_weights(Weights(got, views))
            self.loaded.append(("engine", got))
            return got

        async def load_weights(self, weights: Any) -> None:
            await super().load_weights(weights)
            self.loaded.append(("load_weights", weights.version))

    trainer_actor = TrainerActor.options(num_cpus=0).remote(functools.partial(BenchTrainer, "tiny", "float32"))
    sampler_actor = SamplerActor.options(num_cpus=0).remote(functools.partial(EngineSampler, "tiny", "float32", 1, fail_from=2))
    trainer, sampler = RayTrainer(trainer_actor, queue_ahead=False), RaySampler(sampler_actor, 0)

    def engine_side(self: Any) -> tuple[list[tuple[str, int]], bool, bool]:
        return list(self._worker.loaded), self._engine_member, self._collective is not None

    async def main() -> list[tuple[int | None, object]]:
        try:
            broadcast = await asyncio.to_thread(join, trainer, [sampler], 0.0)
            rounds: list[tuple[int | None, object]] = []
            for number in (1, 2):
                pending = await broadcast.export_ahead()
                done, _ = await asyncio.gather(pending.done, sampler.load_weights(pending.weights))
                rounds.append((await sampler.loaded_version(), done.payload))
                if number == 1:  # received in the engine, the actor no member itself
                    assert ray.get(sampler_actor.__ray_call__.remote(engine_side)) == ([("engine", rounds[0][0])], True, False)
            return rounds
        finally:
            await asyncio.gather(sampler.close(), trainer.close(), return_exceptions=True)

    sides: list[Any] = []
    real_close = sampler.close

    async def read_then_close() -> None:
        sides.append(ray.get(sampler_actor.__ray_call__.remote(engine_side)))
        await real_close()

    sampler.close = read_then_close  # type: ignore[method-assign]
    (first, ok), (second, failed) = asyncio.run(asyncio.wait_for(main(), 120))
    assert isinstance(ok, Broadcast) and ok.error is None
    assert isinstance(failed, Broadcast) and failed.error is not None  # the engine left the group
    loaded, engine_member, actor_member = sides[0]
    assert first is not None and second is not None and second > first
    assert loaded == [("engine", first), ("load_weights", second)]
    assert not engine_member and not actor_member and not sampler.collective_member
