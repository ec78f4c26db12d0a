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
