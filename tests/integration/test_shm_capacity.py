"""/dev/shm for the sharded trainer's ranks (T9 of the GPU review, its sharded part), with a
64 MiB /dev/shm stand-in (a monkeypatched `shutil.disk_usage`): a model handed to the ranks
through shared memory that does not fit is refused up front in one line naming --shm-size and
--ipc=host; ranks that load the model themselves (the run's way) need only the micro-batches
there, and each version's weights then come through a disk directory; that path trains."""

from __future__ import annotations

import asyncio
import shutil
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local import sharded
from relayrl.backends.local.build import RankModel, microbatch_bytes
from relayrl.backends.local.shm import SharedMemoryError, Spilled, plan_shm, spill, unspill
from relayrl.backends.local.trainer import TrainerSettings
from relayrl.config.schema import ConfigError, load_config
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.types import Weights
from support.fakespawn import FakeContext, FakeProcess
from support.sharded import microbatch_steps

pytestmark = pytest.mark.torch

Usage = namedtuple("Usage", "total used free")
MiB = 2**20


def _shm_of(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    real = shutil.disk_usage

    def usage(path: Any) -> Any:
        return Usage(free, 0, free) if str(path) == "/dev/shm" else real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)


def _big_model() -> Qwen2ForCausalLM:
    """A ~250 MiB Qwen2 built on the meta device (sizes only: nothing allocated)."""
    cfg = Qwen2Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2
    )
    with torch.device("meta"):
        return Qwen2ForCausalLM(cfg)


def _settings() -> TrainerSettings:
    return TrainerSettings(learning_rate=1e-3, total_steps=10, loss=LossConfig(), torch_threads=1)


def test_a_model_handed_through_a_64_mib_shm_is_refused_naming_the_docker_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    _shm_of(monkeypatch, 64 * MiB)
    FakeProcess.started = []
    monkeypatch.setattr(sharded.mp, "get_context", lambda method: FakeContext())
    with pytest.raises(SharedMemoryError) as err:
        sharded.ShardedTrainer(_big_model(), _settings(), world_size=2)
    message = str(err.value)
    assert isinstance(err.value, ConfigError)  # exit 2
    assert "/dev/shm has 64 MiB free" in message and "--shm-size" in message and "--ipc=host" in message and "\n" not in message
    assert not FakeProcess.started  # refused before any rank started


def test_ranks_that_load_the_model_themselves_send_versions_through_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    _shm_of(monkeypatch, 64 * MiB)
    FakeProcess.started = []
    monkeypatch.setattr(sharded.mp, "get_context", lambda method: FakeContext())
    cfg = load_config(None, ["run.backend=local", "train.world_size=2"])
    source = RankModel(cfg, torch.float32)
    trainer = sharded.ShardedTrainer(_big_model(), _settings(), 2, source=source, microbatch_bytes=microbatch_bytes(cfg))
    try:
        assert [args[4] for args in FakeProcess.started] == [None, None]  # no model through shared memory
        options = FakeProcess.started[0][8]
        assert isinstance(options.source, RankModel)
        assert options.spill_dir is not None and Path(options.spill_dir).is_dir()
        assert options.env == {"NCCL_SHM_DISABLE": "1"}
    finally:
        trainer._shutdown()
    assert not Path(options.spill_dir).exists()  # removed with the trainer
    roomy = plan_shm(250 * MiB, microbatch_bytes(cfg), 2, path=Path("/nonexistent-shm"))
    assert roomy.spill_dir is None and roomy.free_bytes is None  # no /dev/shm: not judged


def test_a_lora_version_is_sized_as_its_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """With train.lora a version is the adapters (`adapter_payload`), not the model: a 64 MiB
    /dev/shm holds two of them, so nothing spills to disk (it used to plan for two ~250 MiB
    models and spill every version)."""
    from relayrl.backends.local import build
    from relayrl.config.sizing import lora_version_bytes
    from relayrl.models.lora import adapter_payload, payload_bytes, wrap

    tiny = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    cfg = load_config(None, ["run.backend=local", "train.lora.r=4"])
    assert cfg.train.lora is not None
    targets = list(cfg.train.lora.target_modules)
    assert lora_version_bytes(Qwen2ForCausalLM(tiny), 4, targets) == payload_bytes(
        adapter_payload(wrap(Qwen2ForCausalLM(tiny), cfg.train.lora, seed=0))
    )
    _shm_of(monkeypatch, 64 * MiB)
    FakeProcess.started = []
    monkeypatch.setattr(sharded.mp, "get_context", lambda method: FakeContext())
    lora = load_config(None, ["run.backend=local", "train.world_size=2", "train.lora.r=8"])
    trainer = build.make_trainer(lora, _big_model(), 1)
    assert isinstance(trainer, sharded.ShardedTrainer)
    try:
        assert trainer.shm.spill_dir is None
    finally:
        trainer._shutdown()


def test_a_rank_that_cannot_be_spawned_takes_the_started_ones_and_the_spill_directory_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _shm_of(monkeypatch, 64 * MiB)
    FakeProcess.started = []
    killed: list[int] = []

    class Refused(FakeProcess):
        def start(self) -> None:
            if FakeProcess.started:  # rank 1
                raise OSError("cannot spawn")
            super().start()

        def kill(self) -> None:
            killed.append(self.pid)

    context = FakeContext()
    context.Process = Refused
    monkeypatch.setattr(sharded.mp, "get_context", lambda method: context)
    spills: list[str | None] = []
    real_plan = sharded.plan_shm

    def plan(*args: Any, **kwargs: Any) -> Any:
        made = real_plan(*args, **kwargs)
        spills.append(made.spill_dir)
        return made

    monkeypatch.setattr(sharded, "plan_shm", plan)
    cfg = load_config(None, ["run.backend=local", "train.world_size=2"])
    with pytest.raises(OSError, match="cannot spawn"):
        sharded.ShardedTrainer(_big_model(), _settings(), 2, source=RankModel(cfg, torch.float32), microbatch_bytes=microbatch_bytes(cfg))
    assert len(killed) == 1  # rank 0, started, is ended
    assert spills[0] is not None and not Path(spills[0]).exists()


def test_spilled_weights_read_back_whole_and_the_file_removed(tmp_path: Path) -> None:
    payload = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    sent = spill(Weights(version=7, payload=payload), str(tmp_path))
    assert isinstance(sent, Spilled) and Path(sent.path).is_file()
    back = unspill((7, sent, {"loss": 1.0}))
    assert back[0] == 7 and back[2] == {"loss": 1.0}
    weights = back[1]
    assert isinstance(weights, Weights) and weights.version == 7
    got = weights.payload
    assert isinstance(got, dict)
    for name, value in payload.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_two_ranks_train_with_versions_through_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 2-rank trainer whose /dev/shm has room for micro-batches but not for two versions:
    its start weights and a step's weights arrive through the disk directory."""
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    _shm_of(monkeypatch, 2 * weights + 4 * MiB)  # the handed model fits; two versions more do not
    trainer = sharded.ShardedTrainer(model, _settings(), 2, microbatch_bytes=MiB)
    assert trainer.shm.spill_dir is not None
    spill_dir = Path(trainer.shm.spill_dir)
    steps = microbatch_steps(tok, 1)

    async def go() -> None:
        try:
            start = (await trainer.export_weights()).payload
            assert isinstance(start, dict)
            for name, value in model.state_dict().items():
                torch.testing.assert_close(start[name], value, rtol=0, atol=0)
            for tb in steps[0]:
                await trainer.train_step(tb)
            assert await trainer.optim_step() == 1
            after = await trainer.export_weights()
            moved = after.payload
            assert after.version == 1 and isinstance(moved, dict)
            assert max(float((moved[n] - v).abs().max()) for n, v in model.state_dict().items()) > 1e-5
            assert list(spill_dir.iterdir()) == []  # each file removed once read
        finally:
            await trainer.close()

    asyncio.run(go())
    assert not spill_dir.exists()
