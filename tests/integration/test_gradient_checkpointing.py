"""train.gradient_checkpointing: off by default; on, the trainer's model recomputes its decoder
layers' activations in the backward pass (each layer runs twice per micro-batch), and a step's
loss and gradients equal the un-checkpointed step's (up to rounding), in one process, with LoRA
and with bfloat16 compute on float32 masters; the sharded trainer's ranks enable it on their own
copies."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local import build
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.bench.trainer import _steps
from relayrl.config.schema import load_config
from relayrl.models.checkpointing import enable_gradient_checkpointing, is_checkpointing
from support.modelutil import random_qwen2
from support.sharded import named

pytestmark = pytest.mark.torch

VOCAB = 128


def _step(model: Any, precision: str = "float32") -> tuple[float, dict[str, torch.Tensor], int]:
    """One micro-batch's forward and backward in `precision` (model.dtype): (loss, gradients by
    name, decoder layer 0's down_proj calls: inside the checkpointed forward)."""
    calls = [0]
    net = model.base_model.model if hasattr(model, "peft_config") else model
    handle = net.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    settings = TrainerSettings(learning_rate=1e-4, total_steps=2, loss=LossConfig(), torch_threads=1, precision=precision)
    compute = TrainerCompute(model, settings)
    tb = _steps(VOCAB, 1, 1, 128)[0][0]
    compute.train_step(tb)
    handle.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return compute._stats.loss, grads, calls[0]


def test_off_by_default_and_enabled_by_the_key() -> None:
    plain = build.make_trainer(load_config(None, ["run.backend=local"]), random_qwen2(VOCAB), 1)
    assert not is_checkpointing(plain.model)  # type: ignore[union-attr]
    on = build.make_trainer(load_config(None, ["run.backend=local", "train.gradient_checkpointing=true"]), random_qwen2(VOCAB), 1)
    assert is_checkpointing(on.model)  # type: ignore[union-attr]
    lora = load_config(None, ["run.backend=local", "train.gradient_checkpointing=true", "train.lora.r=4"])
    assert is_checkpointing(build.make_trainer(lora, random_qwen2(VOCAB), 1).model)  # type: ignore[union-attr]


def test_bf16_compute_on_fp32_masters_checkpoints_in_one_process() -> None:
    """The one-process trainer computes on bfloat16 casts of its float32 masters: the casts span
    the micro-batch's forward and backward, so a layer recomputed in the backward pass recomputes
    on them (it used to fail at step 1: torch's checkpoint found float32 recomputed values)."""
    cfg = load_config(None, ["run.backend=local", "train.gradient_checkpointing=true", "model.dtype=bfloat16"])
    trainer = build.make_trainer(cfg, random_qwen2(VOCAB), 1)
    assert is_checkpointing(trainer.model)  # type: ignore[union-attr]
    pure = load_config(None, ["run.backend=local", "train.gradient_checkpointing=true", "model.dtype=bfloat16-pure"])
    model = random_qwen2(VOCAB)
    torch.nn.Module.to(model, torch.bfloat16)
    assert is_checkpointing(build.make_trainer(pure, model, 1).model)  # type: ignore[union-attr]


def test_each_rank_is_told_to_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.backends.local import sharded
    from support.fakespawn import FakeContext, FakeProcess

    FakeProcess.started = []
    monkeypatch.setattr(sharded.mp, "get_context", lambda method: FakeContext())
    cfg = load_config(None, ["run.backend=local", "train.world_size=2", "train.gradient_checkpointing=true"])
    trainer = build.make_trainer(cfg, random_qwen2(VOCAB), 1)
    try:
        assert [args[8].gradient_checkpointing for args in FakeProcess.started] == [True, True]
    finally:
        trainer._shutdown()  # type: ignore[union-attr]


@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpointed_step_recomputes_and_matches_the_plain_step(lora: bool) -> None:
    torch.set_num_threads(1)
    models = [random_qwen2(VOCAB), random_qwen2(VOCAB)]
    if lora:
        from relayrl.config.schema import LoraConfig
        from relayrl.models.lora import wrap

        models = [wrap(m, LoraConfig(r=4), seed=0) for m in models]
        for n, p in models[0].named_parameters():  # (peft's B starts at zero: give the adapters a gradient path both ways)
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
        models[1].load_state_dict(models[0].state_dict())  # (peft's A init draws from the global RNG)
    enable_gradient_checkpointing(models[1])
    plain_loss, plain, plain_calls = _step(models[0])
    ckpt_loss, ckpt, ckpt_calls = _step(models[1])
    assert plain_calls == 1 and ckpt_calls == 2  # the checkpointed layer ran again in the backward pass
    assert ckpt_loss == pytest.approx(plain_loss, rel=1e-6, abs=1e-7) and plain_loss != 0.0
    assert set(plain) == set(ckpt) and plain
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, rtol=1e-5, atol=1e-6, msg=functools.partial(named, name))


def test_a_checkpointed_bf16_step_on_fp32_masters_matches_the_plain_bf16_step() -> None:
    """model.dtype "bfloat16" in one process: the checkpointed layer recomputes on the same
    bfloat16 casts the forward used (twice the calls, the plain step's loss and float32 master
    gradients, which the old per-forward casts could not give: the recompute failed)."""
    torch.set_num_threads(1)
    models = [random_qwen2(VOCAB), random_qwen2(VOCAB)]
    enable_gradient_checkpointing(models[1])
    plain_loss, plain, plain_calls = _step(models[0], "bfloat16")
    ckpt_loss, ckpt, ckpt_calls = _step(models[1], "bfloat16")
    assert plain_calls == 1 and ckpt_calls == 2
    assert ckpt_loss == pytest.approx(plain_loss, rel=1e-6, abs=1e-7) and plain_loss != 0.0
    assert set(plain) == set(ckpt) and plain
    assert {g.dtype for g in ckpt.values()} == {torch.float32}  # the masters' gradients
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, rtol=1e-5, atol=1e-6, msg=functools.partial(named, name))


@pytest.mark.slow
def test_two_checkpointing_ranks_train_what_two_plain_ranks_train() -> None:
    """FSDP2 with activation checkpointing in each rank: a step's loss, gradient norm and weights
    match the un-checkpointed ranks' (the ranks enable it on their own copies)."""
    import asyncio

    from relayrl.backends.local.sharded import ShardedTrainer
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
    from support.sharded import microbatch_steps, train_steps

    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    steps = microbatch_steps(tok, 1)
    settings = TrainerSettings(learning_rate=1e-3, total_steps=4, loss=LossConfig(), torch_threads=1)

    async def run(checkpointing: bool) -> Any:
        trainer = ShardedTrainer(model, settings, 2, gradient_checkpointing=checkpointing)
        try:
            return await train_steps(trainer, steps)
        finally:
            await trainer.close()

    (m_plain, w_plain), (m_ckpt, w_ckpt) = asyncio.run(run(False)), asyncio.run(run(True))
    for key in ("loss", "grad_norm", "tokens"):
        assert m_ckpt[0][key] == pytest.approx(m_plain[0][key], rel=1e-5, abs=1e-6), key
    for name, value in w_plain.items():
        torch.testing.assert_close(w_ckpt[name], value, rtol=0, atol=1e-5, msg=functools.partial(named, name))
