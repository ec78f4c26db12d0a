"""The sharded trainer on Ray (train.world_size = 2 with ray.enabled): two trainer actors in one
placement group, rank 0 answering; it trains what the one-process trainer trains (within
1e-5), a run with it passes the trace checker, and a killed rank actor fails the next call
naming the rank. One local cluster for the module."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from relayrl.analysis.checker import check_run_dir  # noqa: E402
from relayrl.backends.local.build import TrainerFactory, trainer_settings  # noqa: E402
from relayrl.backends.local.trainer import LocalTrainer  # noqa: E402
from relayrl.backends.ray.actors import RayTrainer  # noqa: E402
from relayrl.backends.ray.build import actor_options  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.backends.ray.ranks import place_ranks  # noqa: E402
from relayrl.config.schema import load_config  # noqa: E402
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402
from support.sharded import assert_trained_alike, microbatch_steps, train_steps  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

cluster = pytest.fixture(scope="module")(local_cluster)

SETS = ["run.backend=local", "run.steps=10", "train.learning_rate=1e-3", "train.warmup_steps=2", "train.lr_schedule=cosine"]
SETS += ["train.torch_threads=1", "train.world_size=2", "ray.enabled=true", "ray.address=auto"]


def test_two_rank_actors_train_what_one_process_trains_and_a_dead_rank_is_named(cluster: RayCluster) -> None:
    cfg = load_config(None, SETS)
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = microbatch_steps(tok, 2)
    group, rank0, ranks = place_ranks(TrainerFactory(cfg, (1,)), 2, {"CPU": 1.0}, actor_options({"CPU": 1.0}))
    ray.get([rank0.ready.remote(), *(a.ready.remote() for a in ranks)], timeout=300)
    table = ray.util.placement_group_table(group)
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
    sharded = RayTrainer(rank0, ranks=2)
    single = LocalTrainer(model, trainer_settings(cfg, 1))

    async def both() -> tuple[Any, Any]:
        out = await train_steps(sharded, steps), await train_steps(single, steps)
        ray.kill(ranks[0], no_restart=True)  # rank 1 dies: the next call names it
        with pytest.raises(Exception, match=r"sharded trainer rank 1 \(Ray actor\) died"):
            for tb in steps[0]:
                await sharded.train_step(tb)
            await sharded.optim_step()
        return out

    try:
        (m2, w2), (m1, w1) = asyncio.run(both())
    finally:
        asyncio.run(sharded.close())
        asyncio.run(single.close())
        ray.util.remove_placement_group(group)
    for a, b in zip(m2, m1, strict=True):
        for key in ("loss", "grad_norm", "tokens", "completion_tokens", "microbatches", "learning_rate"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=0), (key, a, b)
    assert set(w2) == set(w1)
    assert_trained_alike(w2, w1, lr=1e-3)


def test_a_run_with_two_trainer_rank_actors_completes_and_passes_the_checker(cluster: RayCluster, tmp_path: Path) -> None:
    sets = [*SETS, "run.steps=2", "eval.enabled=false", "rollout.groups_per_step=2", "rollout.num_generations=2"]
    sets += ["orchestrator.release_memory=false", "orchestrator.checkpoint_every=1"]
    asyncio.run(asyncio.wait_for(build_program(load_config(None, sets), run_dir=tmp_path / "run").run(), 300))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    assert check_run_dir(tmp_path / "run").ok
    assert list((tmp_path / "run").rglob("trainer-sharded.pt"))  # sharded checkpoints, written by both ranks
    assert not ray.util.placement_group_table() or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()
    )  # the trainer's placement group went with the run


def _in_actor() -> tuple[Any, Any]:
    """Functions run inside the actors (`__ray_call__`): defined in here, so that they travel by
    value (a module-level function travels by reference to this test module, which the actors
    cannot import)."""

    def _count_full_gathers(self: Any) -> None:
        """In rank 0's actor: count every full state-dict gather from now on (`get_model_state_dict`)."""
        import relayrl.backends.local.ranks as ranks_module

        real = ranks_module.get_model_state_dict
        calls: list[int] = []

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return real(*args, **kwargs)

        ranks_module.get_model_state_dict = counting
        ranks_module._full_gathers = calls  # type: ignore[attr-defined]

    def _rank_state(self: Any) -> tuple[dict[str, torch.Tensor], int, int, int, int]:
        """In a trainer rank's actor: its rows of each tensor (the live shards: no step after the
        last commit), the committed version, its snapshot's bytes, a version's bytes, and the full
        gathers counted."""
        import relayrl.backends.local.ranks as ranks_module
        from relayrl.backends.local.ranks import Shards

        compute = self._worker.compute if hasattr(self, "_worker") else self._compute
        rows = {k: v.to_local().detach().clone() for k, v in compute.model.state_dict(keep_vars=True).items()}
        snapshot = compute.committed_weights()
        assert isinstance(snapshot.payload, Shards)
        held = sum(t.numel() * t.element_size() for t in snapshot.payload.flats.values())
        return rows, snapshot.version, held, compute.stream_layout.full.nbytes, len(getattr(ranks_module, "_full_gathers", []))

    return _count_full_gathers, _rank_state


def test_the_collective_transport_streams_each_ranks_shards_bit_for_bit_without_a_full_gather(cluster: RayCluster, tmp_path: Path) -> None:
    """rollout.weight_transport = collective with two trainer rank actors and two sampler actors:
    the run passes the checker, every version is broadcast (no object-store export), each rank's
    committed snapshot holds only its own rows, rank 0 never gathers the full state dict, and the
    samplers hold the trainer's weights (its ranks' rows, concatenated) bit for bit."""
    from relayrl.analysis import timeline
    from relayrl.backends.ray.actors import RaySampler
    from relayrl.backends.ray.collective import RayBroadcast

    sets = [*SETS, "run.steps=2", "eval.enabled=false", "rollout.groups_per_step=2", "rollout.num_generations=2"]
    sets += ["rollout.num_samplers=2", "rollout.weight_transport=collective", "orchestrator.release_memory=false"]
    program = build_program(load_config(None, sets), run_dir=tmp_path / "run")
    _count_full_gathers, _rank_state = _in_actor()
    assert isinstance(program.backend.broadcast, RayBroadcast)
    trainer = program.backend.trainer
    assert isinstance(trainer, RayTrainer)
    ray.get(trainer.actor.__ray_call__.remote(_count_full_gathers))
    factory = ray.get(trainer.actor.__ray_call__.remote(lambda self: self._worker._ranks))
    seen: dict[str, Any] = {}
    samplers = [s for s in program.backend.samplers if isinstance(s, RaySampler)]

    def sampler_state(self: Any) -> tuple[dict[str, torch.Tensor], int | None]:
        return {k: v.clone() for k, v in self._worker.compute.model.state_dict().items()}, self._loaded

    for s in samplers:
        s_close = s.close

        async def read_then_close(s: RaySampler = s, s_close: Any = s_close) -> None:
            seen[f"sampler{s.replica}"] = ray.get(s.actor.__ray_call__.remote(sampler_state))
            await s_close()

        s.close = read_then_close  # type: ignore[method-assign]
    close = trainer.close

    async def read_then_close_trainer() -> None:
        seen["rank0"] = ray.get(trainer.actor.__ray_call__.remote(_rank_state))
        seen["rank1"] = ray.get(factory[0].__ray_call__.remote(_rank_state))
        await close()

    trainer.close = read_then_close_trainer  # type: ignore[method-assign]
    result = asyncio.run(asyncio.wait_for(program.run(), 300))
    report = check_run_dir(tmp_path / "run")
    assert report.ok, report.violations
    assert report.completed
    (rows0, v0, held0, version_bytes, gathers), (rows1, v1, held1, _, _) = seen["rank0"], seen["rank1"]
    assert v0 == v1 == 2
    assert gathers == 0  # rank 0 never gathered the full state dict (not at a commit, not for an export)
    assert held0 + held1 == version_bytes and max(held0, held1) < 0.75 * version_bytes  # each rank's snapshot: its rows
    full = {k: torch.cat([rows0[k], rows1[k]]) for k in rows0}
    for name in ("sampler0", "sampler1"):
        state, version = seen[name]
        assert version == 2
        assert set(state) == set(full)
        for key, tensor in full.items():
            assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key  # bit for bit
    spans = timeline.spans(result.tracer.events)
    assert len([s for s in spans if s.lane == "actor:trainer" and s.name == "broadcast_weights"]) >= 2  # one per committed version
    assert not [s for s in spans if s.lane == "actor:trainer" and s.name == "export_weights"]  # no gather for the object store
    for replica in (0, 1):
        loads = [s for s in spans if s.lane == f"actor:sampler/{replica}" and s.name == "load_weights"]
        assert loads and all(s.args.get("transport") == "collective" for s in loads)


def test_a_sampler_killed_in_a_streamed_run_falls_back_to_the_ranks_gathered_export(cluster: RayCluster, tmp_path: Path) -> None:
    """As tests/ray/test_ray_transports.py's kill, with two trainer rank actors streaming: once
    version 1 reached both samplers, replica 1's actor is killed; the broadcast after it fails
    (the groups break for good) or a sampling call sees the death first (the replica restarts, no
    member); either way the object store takes over, its exports gathered from the ranks'
    snapshots, and the run completes with both replicas, its trace checked."""
    import warnings

    from relayrl.backends.ray.actors import RaySampler
    from relayrl.backends.ray.collective import RayBroadcast
    from relayrl.orchestrator.replicas import SamplerRestartedWarning
    from relayrl.types import Weights
    from support.simutil import event_args

    sets = [*SETS, "run.steps=4", "eval.enabled=false", "rollout.groups_per_step=2", "rollout.num_generations=2"]
    sets += ["rollout.num_samplers=2", "rollout.weight_transport=collective", "orchestrator.release_memory=false"]
    program = build_program(load_config(None, sets), run_dir=tmp_path / "run")
    broadcast = program.backend.broadcast
    assert isinstance(broadcast, RayBroadcast)
    victim = program.backend.samplers[1]
    assert isinstance(victim, RaySampler)
    load = victim.load_weights
    killed: list[int] = []

    async def load_then_kill(weights: Weights) -> None:
        await load(weights)
        if weights.version >= 1 and not killed:
            killed.append(weights.version)
            ray.kill(victim.actor, no_restart=False)  # Ray restarts its process
            await asyncio.sleep(1.0)

    victim.load_weights = load_then_kill  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SamplerRestartedWarning)
        asyncio.run(asyncio.wait_for(program.run(), 300))
    assert killed
    report = check_run_dir(tmp_path / "run")
    assert report.ok, report.violations
    assert report.completed
    assert len(program.replicas.slots) == 2 and not victim.collective_member
    events = [e for e in program.tracer.events if e.get("name") in ("broadcast_weights", "export_weights", "load_weights")]
    names = [e["name"] for e in events]
    after = events[len(names) - names[::-1].index("broadcast_weights") :]  # after the last broadcast
    loads = [e for e in after if e["name"] == "load_weights"]
    assert loads and all(event_args(e).get("transport") in (None, "object_store") for e in loads)
    assert "export_weights" in names  # the object store's export: gathered from the ranks' snapshots


def test_a_streaming_rank_keeps_a_version_a_publication_reads_across_a_commit(cluster: RayCluster, tmp_path: Path) -> None:
    """Streaming ranks (no sampler actors): while a publication of version v is under way (its
    pin in rank 0), the next commit keeps v's snapshot on every rank beside the new one; the
    commit after the pin is gone drops it. The object store's export of the committed version
    (gathered from the ranks' snapshots) is the ranks' rows, bit for bit, and so it is after a
    sharded checkpoint is loaded back (each rank's snapshot made anew)."""
    cfg = load_config(None, [*SETS, "rollout.weight_transport=collective"])
    torch.set_num_threads(1)
    _, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = microbatch_steps(tok, 3)
    group, rank0, ranks = place_ranks(TrainerFactory(cfg, (1,)), 2, {"CPU": 1.0}, actor_options({"CPU": 1.0}), stream=True)
    ray.get([rank0.ready.remote(), *(a.ready.remote() for a in ranks)], timeout=300)
    trainer = RayTrainer(rank0, ranks=2)

    def pin(self: Any, version: int, by: int) -> None:
        with self._worker._commits:
            self._worker._pins[version] += by
            if self._worker._pins[version] <= 0:
                del self._worker._pins[version]

    def held(self: Any) -> list[int]:
        compute = self._worker.compute if hasattr(self, "_worker") else self._compute
        return sorted(v for v in range(5) if _holds(compute, v))

    def _holds(compute: Any, version: int) -> bool:
        try:
            compute.shards(version)
            return True
        except RuntimeError:
            return False

    def rows(self: Any) -> dict[str, torch.Tensor]:
        compute = self._worker.compute if hasattr(self, "_worker") else self._compute
        return {k: v.to_local().detach().clone() for k, v in compute.model.state_dict(keep_vars=True).items()}

    async def run() -> Any:
        async def step(batches: list[Any]) -> int:
            for tb in batches:
                await trainer.train_step(tb)
            return await trainer.optim_step()

        assert await step(steps[0]) == 1
        ray.get(rank0.__ray_call__.remote(pin, 1, 1))  # a publication of version 1 under way
        assert await step(steps[1]) == 2
        kept = [ray.get(a.__ray_call__.remote(held)) for a in (rank0, *ranks)]
        ray.get(rank0.__ray_call__.remote(pin, 1, -1))  # ... it ended
        assert await step(steps[2]) == 3
        after = [ray.get(a.__ray_call__.remote(held)) for a in (rank0, *ranks)]
        exported = await trainer.export_weights()
        await trainer.save_state(tmp_path)
        assert await trainer.load_state(tmp_path) == 3
        assert [ray.get(a.__ray_call__.remote(held)) for a in (rank0, *ranks)] == [[3], [3]]
        reloaded = await trainer.export_weights()
        return kept, after, exported, reloaded

    try:
        kept, after, exported, reloaded = asyncio.run(run())
        parts = [ray.get(a.__ray_call__.remote(rows)) for a in (rank0, *ranks)]
    finally:
        asyncio.run(trainer.close())
        ray.util.remove_placement_group(group)
    assert kept == [[1, 2], [1, 2]]  # both ranks kept the pinned version beside the new one
    assert after == [[3], [3]]
    from relayrl.backends.ray.actors import resolve

    for weights in (asyncio.run(resolve(exported)), asyncio.run(resolve(reloaded))):
        assert weights.version == 3
        for name, tensor in weights.payload.items():  # type: ignore[attr-defined]
            assert torch.equal(tensor, torch.cat([p[name] for p in parts])), name
