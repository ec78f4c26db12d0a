"""The sharded trainer (train.world_size = 2, FSDP2 over gloo, two local rank processes): a step
equals the one-process trainer's step (loss, gradient norm, weights after 3 steps within 1e-5),
its sharded checkpoint round-trips and refuses another world size, and a killed rank fails the
next call naming the rank."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.trainer import LocalTrainer, TrainerSettings
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from support.sharded import assert_trained_alike, named, train_steps
from support.sharded import microbatch_steps as _steps

pytestmark = pytest.mark.torch


def _settings() -> TrainerSettings:
    return TrainerSettings(learning_rate=1e-3, total_steps=10, loss=LossConfig(), warmup_steps=2, lr_schedule="cosine", torch_threads=1)


def test_two_ranks_train_what_one_process_trains(tmp_path: Path) -> None:
    from relayrl.backends.local.sharded import ShardedTrainer

    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = _steps(tok)
    sharded = ShardedTrainer(model, _settings(), world_size=2)
    single = LocalTrainer(load_model_and_tokenizer(shipped_model_dir())[0], _settings())

    async def both() -> tuple[Any, Any]:
        try:
            start = (await sharded.export_weights()).payload
            assert isinstance(start, dict)
            for name, value in single.model.state_dict().items():
                torch.testing.assert_close(start[name], value, rtol=0, atol=0)
            # gathered per name, a tied weight is still sent once (issue 31 §1: export bytes = unique bytes)
            assert start["lm_head.weight"].data_ptr() == start["model.embed_tokens.weight"].data_ptr()
            return await train_steps(sharded, steps), await train_steps(single, steps)
        finally:
            await sharded.close()
            await single.close()

    (m2, w2), (m1, w1) = asyncio.run(both())
    for a, b in zip(m2, m1, strict=True):
        for key in ("loss", "grad_norm", "tokens", "completion_tokens", "microbatches", "learning_rate", "step"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=0), (key, a, b)
    assert set(w2) == set(w1)
    assert_trained_alike(w2, w1, lr=1e-3)
    moved = max(float((w1[n] - v).abs().max()) for n, v in model.state_dict().items())
    assert moved > 1e-4  # the steps changed the weights


@pytest.mark.slow
def test_two_ranks_make_several_updates_per_step_as_one_process_does() -> None:
    """ppo_epochs = 2, minibatches_per_step = 2 (4 updates a step, the later ones inside
    optim_step on each rank's kept micro-batches, padded where a rank holds fewer of a minibatch):
    the loss, gradient norm, first pass figures and weights after 2 steps equal one process's."""
    from relayrl.backends.local.sharded import ShardedTrainer

    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = _steps(tok, 2, minibatches=2)
    counts = [[sum(1 for tb in batches if tb.minibatch == k) for k in (0, 1)] for batches in steps]
    assert any(n % 2 == 1 for c in counts for n in c), counts  # a partial round in a minibatch: a rank idles
    settings = dataclasses.replace(_settings(), ppo_epochs=2, minibatches_per_step=2)
    sharded = ShardedTrainer(model, settings, world_size=2)
    single = LocalTrainer(load_model_and_tokenizer(shipped_model_dir())[0], dataclasses.replace(settings))

    async def both() -> tuple[Any, Any]:
        try:
            return await train_steps(sharded, steps), await train_steps(single, steps)
        finally:
            await sharded.close()
            await single.close()

    (m2, w2), (m1, w1) = asyncio.run(both())
    keys = ("loss", "grad_norm", "tokens", "completion_tokens", "microbatches", "updates", "ppo_kl", "clip_frac_low_epoch2")
    for a, b in zip(m2, m1, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=0), (key, a, b)
        assert a["updates"] == 4
    for name, value in w1.items():
        atol = 3 * 1e-3 if name.endswith("k_proj.bias") else 1e-5  # (see the test above)
        torch.testing.assert_close(w2[name], value, rtol=0, atol=atol, msg=functools.partial(named, name))
    moved = max(float((w1[n] - v).abs().max()) for n, v in model.state_dict().items())
    assert moved > 1e-4


@pytest.mark.slow
def test_two_ranks_train_lora_adapters_as_one_process_does(tmp_path: Path) -> None:
    """train.lora with world_size 2: only the adapters train (FSDP2 over a peft model, the base
    frozen); the adapters after 2 steps equal one process's, the export sends adapters only, and
    the sharded checkpoint holds the version's adapters whole (what the model export reads)."""
    from relayrl.backends.local.ranks import read_full_weights
    from relayrl.backends.local.sharded import ShardedTrainer
    from relayrl.config.schema import LoraConfig
    from relayrl.models.lora import is_adapter_payload, wrap

    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = _steps(tok, 2)
    lora = LoraConfig(r=4, alpha=8.0)
    torch.manual_seed(0)  # the same adapters to start from (A is drawn at random)
    sharded = ShardedTrainer(wrap(model, lora, seed=0), _settings(), world_size=2)
    torch.manual_seed(0)
    single = LocalTrainer(wrap(load_model_and_tokenizer(shipped_model_dir())[0], lora, seed=0), _settings())

    async def both() -> tuple[Any, Any]:
        try:
            first = await train_steps(sharded, steps)
            await sharded.save_state(tmp_path)
            return first, await train_steps(single, steps)
        finally:
            await sharded.close()
            await single.close()

    (m2, w2), (m1, w1) = asyncio.run(both())
    for a, b in zip(m2, m1, strict=True):
        for key in ("loss", "grad_norm", "tokens", "completion_tokens", "microbatches"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=0), (key, a, b)
    assert is_adapter_payload(w2) and set(w2) == set(w1)
    for name, value in w1.items():
        torch.testing.assert_close(w2[name], value, rtol=0, atol=1e-5, msg=functools.partial(named, name))
    assert max(float(v.abs().max()) for n, v in w1.items() if n.endswith("lora_B")) > 1e-4  # the adapters trained
    version, saved = read_full_weights(tmp_path)
    assert version == 2 and set(saved) == set(w2)
    for name, value in saved.items():
        torch.testing.assert_close(value, w2[name], rtol=0, atol=0)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_the_same_world_size_only(tmp_path: Path) -> None:
    """Save after one step, load into fresh ranks: the next two steps land on the weights of the
    uninterrupted run exactly; the shards read in one process are the saved version's full
    weights; a one-process trainer refuses the checkpoint naming train.world_size."""
    from relayrl.backends.local.ranks import read_full_weights
    from relayrl.backends.local.sharded import ShardedTrainer

    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = _steps(tok)

    async def first() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        trainer = ShardedTrainer(model, _settings(), world_size=2)
        try:
            saved = (await train_steps(trainer, steps[:1]))[1]
            await trainer.save_state(tmp_path)
            return saved, (await train_steps(trainer, steps[1:]))[1]
        finally:
            await trainer.close()

    async def resumed() -> tuple[int, dict[str, torch.Tensor]]:
        trainer = ShardedTrainer(load_model_and_tokenizer(shipped_model_dir())[0], _settings(), world_size=2)
        try:
            version = await trainer.load_state(tmp_path)
            return version, (await train_steps(trainer, steps[1:]))[1]
        finally:
            await trainer.close()

    saved, continued = asyncio.run(first())
    version, full = read_full_weights(tmp_path)  # what the model export reads, in one process
    assert version == 1 and set(full) <= set(saved) and "model.embed_tokens.weight" in full
    for name, value in full.items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
    version, again = asyncio.run(resumed())
    assert version == 1
    for name, value in continued.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0)
    single = LocalTrainer(load_model_and_tokenizer(shipped_model_dir())[0], _settings())
    with pytest.raises(RuntimeError, match=r"train.world_size > 1\); this run has train.world_size = 1"):
        asyncio.run(single.load_state(tmp_path))
    asyncio.run(single.close())


@pytest.mark.slow
def test_a_killed_rank_fails_the_next_call_naming_it() -> None:
    from relayrl.backends.local.sharded import RankFailed, ShardedTrainer

    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = _steps(tok, 1)
    trainer = ShardedTrainer(model, _settings(), world_size=2)

    async def go() -> None:
        try:
            await trainer.export_weights()  # both ranks are up
            os.kill(trainer.pids[1], signal.SIGKILL)
            with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) died \(exit code -9\)"):
                for tb in steps[0]:
                    await trainer.train_step(tb)
                await trainer.optim_step()
        finally:
            await trainer.close()

    asyncio.run(go())
    assert all(not p.is_alive() for p in [r.process for r in trainer._ranks])


def test_world_size_needs_the_local_backend() -> None:
    from relayrl.config.schema import ConfigError, load_config

    assert load_config(None, ["run.backend=local", "train.world_size=2"]).train.world_size == 2
    with pytest.raises(ConfigError, match=r"train.world_size = 2 needs run.backend = 'local', not 'sim'"):
        load_config(None, ["run.backend=sim", "train.world_size=2"])
    assert load_config(None, ["run.backend=local", "ray.enabled=true", "train.world_size=2"]).ray.enabled  # (tests/ray/test_ray_sharded.py)
    with pytest.raises(ConfigError, match="train.world_size"):
        load_config(None, ["train.world_size=0"])
    assert load_config(None, ["run.backend=local", "train.world_size=2", "train.lora.r=4"]).train.lora is not None
    assert load_config(None, ["run.backend=local", "train.world_size=2", "train.ppo_epochs=2"]).train.ppo_epochs == 2


@pytest.mark.slow
def test_bench_trainer_reports_each_world_size_and_shards_the_state() -> None:
    from relayrl.bench.trainer import run_trainer

    figures = run_trainer([1, 2], model="tiny", steps=2, microbatches=2, row_tokens=64)
    configs: Any = figures["configs"]
    assert [c["world_size"] for c in configs] == [1, 2]
    assert all(c["tokens_per_s"] > 0 for c in configs)
    one, two = (c["ranks"] for c in configs)
    whole = one[0]["param_bytes"] + one[0]["optim_bytes"]
    assert whole == pytest.approx(3 * int(figures["param_bytes"]), rel=1e-3)  # type: ignore[call-overload]  # (+ AdamW step counts)
    for r in two:  # each rank holds about half (dim-0 shards round up)
        assert 0.4 * whole <= r["param_bytes"] + r["optim_bytes"] <= 0.6 * whole


@pytest.mark.slow
def test_a_run_whose_rank_dies_fails_naming_it_and_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    """Rank 1 is killed after step 2 (checkpointed): the run fails with the rank named, well
    within train.call_timeout_s, and `--resume` goes on from step 2 to the end."""
    from relayrl.backends.local.sharded import RankFailed
    from relayrl.config.schema import load_config
    from relayrl.orchestrator.build import build_program
    from relayrl.orchestrator.deadlines import BoundedTrainer
    from relayrl.rundir.checkpoint import CHECKPOINTS, complete_checkpoints
    from relayrl.telemetry.callbacks import Callback
    from support.simutil import run_checked

    sets = ["run.backend=local", "task.kind=arithmetic", "rollout.num_generations=4", "rollout.groups_per_step=4"]
    sets += ["orchestrator.release_memory=false", "eval.enabled=false", "orchestrator.checkpoint_every=1", "train.world_size=2"]
    sets += ["train.torch_threads=1", "rollout.sampler_threads=1", "train.call_timeout_s=600"]
    run_dir = tmp_path / "run"

    class KillRank(Callback):
        pid = 0

        def on_step_end(self, step: int, result: object) -> None:
            if step == 2:
                assert isinstance(program.trainer, BoundedTrainer)
                self.pid = program.trainer.inner.pids[1]  # type: ignore[attr-defined]
                os.kill(self.pid, signal.SIGKILL)

    kill = KillRank()
    program = build_program(load_config(None, [*sets, "run.steps=4"]), [kill], run_dir=run_dir)
    with pytest.raises(RankFailed) as failed:
        asyncio.run(asyncio.wait_for(program.run(), 300))
    assert str(failed.value) == f"sharded trainer rank 1 (pid {kill.pid}) died (exit code -9)"
    newest = complete_checkpoints(run_dir / CHECKPOINTS)[-1]  # step 2's, or step 1's if 2's was still being written
    assert (newest / "trainer-sharded.pt").is_file() and newest.name in ("step-000001", "step-000002")
    result = run_checked(build_program(load_config(None, [*sets, "run.steps=4"]), run_dir=run_dir, resume=True), timeout=300)
    assert [r.step for r in result.results] == list(range(int(newest.name[5:]) + 1, 5))


@pytest.mark.slow
def test_a_lora_run_on_two_ranks_completes_and_exports_its_adapter(tmp_path: Path) -> None:
    """train.lora with world_size 2 end to end: samplers load the adapters, the sharded
    checkpoint's adapters become the run's exported adapter (PEFT format), which peft loads."""
    from peft import PeftModel

    from relayrl.backends.local.ranks import read_full_weights
    from relayrl.config.schema import load_config
    from relayrl.orchestrator.build import build_program
    from relayrl.rundir.checkpoint import CHECKPOINTS, complete_checkpoints
    from support.simutil import run_checked

    sets = ["run.backend=local", "task.kind=arithmetic", "rollout.num_generations=4", "rollout.groups_per_step=4", "run.steps=2"]
    sets += ["orchestrator.release_memory=false", "eval.enabled=false", "orchestrator.checkpoint_every=1", "train.world_size=2"]
    sets += ["train.torch_threads=1", "rollout.sampler_threads=1", "train.lora.r=4", "run.save_model=true"]
    run_dir = tmp_path / "run"
    run_checked(build_program(load_config(None, sets), run_dir=run_dir), timeout=300)
    newest = complete_checkpoints(run_dir / CHECKPOINTS)[-1]
    _, adapters = read_full_weights(newest)
    assert adapters and all(".lora_" in k for k in adapters)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (run_dir / "model").iterdir()}
    loaded = PeftModel.from_pretrained(load_model_and_tokenizer(shipped_model_dir())[0], run_dir / "model")
    trained = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert trained and max(float(p.abs().max()) for p in trained) > 0  # B starts at 0: these trained


def test_two_ranks_train_bf16_on_fp32_masters_as_one_process_does() -> None:
    """model.dtype "bfloat16" with world_size 2: FSDP2's MixedPrecisionPolicy (bfloat16 params
    in the forward, float32 gradient reduction) over float32 master weights computes what the
    one-process trainer computes on bfloat16 casts of its float32 masters; the weights a version
    exports (and checkpoints) are float32."""
    from relayrl.backends.local.sharded import ShardedTrainer

    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = _steps(tok)
    settings = dataclasses.replace(_settings(), precision="bfloat16")
    sharded = ShardedTrainer(model, settings, world_size=2)
    single = LocalTrainer(load_model_and_tokenizer(shipped_model_dir())[0], settings)
    fp32 = LocalTrainer(load_model_and_tokenizer(shipped_model_dir())[0], _settings())

    async def all_three() -> tuple[Any, Any, Any]:
        try:
            return await train_steps(sharded, steps), await train_steps(single, steps), await train_steps(fp32, steps)
        finally:
            await sharded.close()
            await single.close()
            await fp32.close()

    (m2, w2), (m1, w1), (m32, _) = asyncio.run(all_three())
    assert all(v.dtype == torch.float32 for v in w2.values())
    for a, b, c in zip(m2, m1, m32, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=2e-3, rel=0), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-2), (a, b)
        assert a["loss"] != c["loss"]  # (bfloat16 compute: not the float32 step)
    for name, value in w1.items():
        atol = 3 * 1e-3 if name.endswith("k_proj.bias") else 2e-4
        torch.testing.assert_close(w2[name], value, rtol=0, atol=atol, msg=functools.partial(named, name))
