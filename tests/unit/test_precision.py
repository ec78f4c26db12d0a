"""Precision (`model.dtype`): "bfloat16" trains with float32 master weights and AdamW moments under
bfloat16 autocast, so a small update is not rounded away; "auto" resolves by device; the output
projection computes in float32 on both sides; "bfloat16-pure" keeps everything in bfloat16;
the truncated-IS default follows the compute dtype; TF32 and fused AdamW on CUDA."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.devices import Accelerators, resolve_model_precision
from relayrl.backends.local.precision import (
    AUTO_TIS_CAP,
    Fp32Linear,
    Precision,
    cuda_precision_settings,
    effective_tis_cap,
    fp32_head,
    in_compute_dtype,
    optimizer_options,
)
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.bench.trainer import _steps
from relayrl.config.schema import ConfigError, load_config
from support.modelutil import random_qwen2

VOCAB = 256


def _train(model: Any, precision: str, lr: float = 1e-6, steps: int = 3) -> TrainerCompute:
    settings = TrainerSettings(learning_rate=lr, total_steps=10, loss=LossConfig(), precision=precision)
    compute = TrainerCompute(model, settings)
    for batches in _steps(VOCAB, steps, 2, 128):
        for tb in batches:
            compute.train_step(tb)
        compute.optim_step()
    return compute


def _changed_share(before: dict[str, torch.Tensor], model: torch.nn.Module) -> float:
    after = model.state_dict()
    changed = sum(int((after[k].float() != v.float()).sum()) for k, v in before.items())
    return changed / sum(v.numel() for v in before.values())


def test_bf16_trainer_moves_weights() -> None:
    """T5: at lr 1e-6, 3 steps of "bfloat16" (a bfloat16 model given) change >= 90% of the weights
    (pure bfloat16 rounded all but ~2% away); the master weights and both AdamW moments are float32
    while the forward computes in bfloat16."""
    model: Any = torch.nn.Module.to(random_qwen2(VOCAB), torch.bfloat16)
    before = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    compute = _train(model, "bfloat16")
    assert _changed_share(before, compute.model) >= 0.9
    assert all(p.dtype == torch.float32 for p in compute.model.parameters())
    state = compute._optimizer.state
    assert state and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32 for s in state.values())
    # the checkpointed snapshot is float32 too (a resume loses nothing)
    snapshot = compute.committed_weights()
    assert snapshot is not None and isinstance(snapshot.payload, dict)
    assert all(t.dtype == torch.float32 for t in snapshot.payload.values())


def test_bf16_forward_computes_in_bf16() -> None:
    """ "bfloat16" is bfloat16 compute, not float32 training: a decoder linear layer's output
    under the trainer's forward is bfloat16, and the log-probs are float32."""
    model = random_qwen2(VOCAB)
    seen: list[torch.dtype] = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    compute = _train(model, "bfloat16", steps=1)
    assert seen and set(seen) == {torch.bfloat16}
    tb = _steps(VOCAB, 1, 1, 128)[0][0]
    logp, _ = compute._logprobs(compute._net, tb.payload)
    assert logp.dtype == torch.float32


def test_bf16_pure_keeps_everything_in_bf16() -> None:
    """ "bfloat16-pure" only when asked: parameters and AdamW moments in bfloat16."""
    compute = _train(random_qwen2(VOCAB), "bfloat16-pure", lr=1e-3, steps=1)
    assert all(p.dtype == torch.bfloat16 for p in compute.model.parameters())
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in compute._optimizer.state.values())


def test_auto_resolves_by_device() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    bf16_gpu = Accelerators(cuda_available=True, device_count=1, bf16=True, cuda_build="12.8")
    old_gpu = Accelerators(cuda_available=True, device_count=1, bf16=False, cuda_build="12.8")
    assert resolve_model_precision("auto", [cpu, cpu]) == Precision.of("float32")
    assert resolve_model_precision("auto", [gpu, gpu], bf16_gpu) == Precision("bfloat16", torch.float32, torch.bfloat16)
    assert resolve_model_precision("auto", [gpu, cpu], bf16_gpu).name == "float32"
    assert resolve_model_precision("auto", [gpu], old_gpu).name == "float32"
    assert resolve_model_precision("bfloat16-pure", [cpu]) == Precision("bfloat16-pure", torch.bfloat16, torch.bfloat16)
    assert load_config(None, ["model.dtype=bfloat16-pure"]).model.dtype == "bfloat16-pure"
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(None, ["model.dtype=float16"])


def test_auto_on_a_pretend_bf16_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real probe, with torch.cuda pretending a bf16-capable device: "auto" is "bfloat16"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_model_precision("auto", [torch.device("cuda", 0)]).name == "bfloat16"
    assert resolve_model_precision("auto", [torch.device("cpu")]).name == "float32"


def test_tis_is_on_by_default_in_bf16_only() -> None:
    assert effective_tis_cap(None, torch.bfloat16) == AUTO_TIS_CAP
    assert effective_tis_cap(None, torch.float32) is None
    assert effective_tis_cap(0.0, torch.bfloat16) is None  # 0 = off
    assert effective_tis_cap(1.5, torch.float32) == 1.5
    assert effective_tis_cap(None, torch.bfloat16, "sequence") is None  # GSPO clips against the sampler
    from relayrl.backends.local.build import trainer_settings

    cfg = load_config(None, ["run.backend=local", "model.dtype=bfloat16"])
    assert trainer_settings(cfg, 1, Precision.of("bfloat16")).loss.tis_cap == AUTO_TIS_CAP
    assert trainer_settings(cfg, 1, Precision.of("float32")).loss.tis_cap is None
    assert load_config(None, ["algorithm.ratio_level=sequence", "algorithm.tis_cap=0"]).algorithm.tis_cap == 0


def test_the_head_computes_in_fp32_on_both_sides() -> None:
    """The sampler's bfloat16 copy and the trainer's float32 master (on its bfloat16 casts) give
    the same float32 logits from the head: the compute dtype's weights, float32 arithmetic."""
    model: Any = fp32_head(random_qwen2(VOCAB))
    head: Any = model.get_output_embeddings()
    assert isinstance(head, Fp32Linear) and set(model.state_dict()) == set(random_qwen2(VOCAB).state_dict())
    sampler = copy.deepcopy(model).to(torch.bfloat16)
    sampler_head: Any = sampler.get_output_embeddings()
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    trainer_logits: torch.Tensor = in_compute_dtype(model, torch.bfloat16, lambda m: m.get_output_embeddings()(hidden))  # type: ignore[operator]
    sampler_logits = sampler_head(hidden)
    assert trainer_logits.dtype == sampler_logits.dtype == torch.float32
    torch.testing.assert_close(trainer_logits, sampler_logits, rtol=1e-6, atol=1e-6)
    plain = torch.nn.functional.linear(hidden, sampler_head.weight)  # what a bfloat16 head gives
    assert (plain.float() - sampler_logits).abs().max() > 1e-4


def test_parameter_casts_keep_gradients_on_the_fp32_masters() -> None:
    """`in_compute_dtype`: the forward sees bfloat16 parameters (tied ones tied), the gradient
    lands on the float32 master parameters."""
    model: Any = fp32_head(random_qwen2(VOCAB))
    ids = torch.tensor([[3, 4, 5, 6]])
    seen: list[torch.dtype] = []
    model.lm_head.register_forward_pre_hook(lambda m, i: seen.append(m.weight.dtype))
    logits: torch.Tensor = in_compute_dtype(model, torch.bfloat16, lambda m: m(input_ids=ids).logits)
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tf32_on_cuda_only_and_fused_adamw_on_cuda_and_cpu() -> None:
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert not cuda_precision_settings(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32
        assert cuda_precision_settings(torch.device("cuda", 1))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    assert optimizer_options(torch.device("cuda", 0)) == {"fused": True}
    assert optimizer_options(torch.device("cpu")) == {"fused": True}
    assert optimizer_options(torch.device("cpu"), fused_cpu=False) == {}  # a sharded compute's DTensors
    assert optimizer_options(torch.device("cuda", 0), fused_cpu=False) == {"fused": True}


def test_the_cpu_trainer_steps_with_fused_adamw_and_the_sharded_one_does_not() -> None:
    """On the CPU the one-process trainer's AdamW is the fused kernel (one pass per parameter),
    and its update is the default implementation's up to float rounding."""
    from relayrl.backends.local.ranks import ShardedCompute

    model = random_qwen2(VOCAB)
    reference = copy.deepcopy(model)
    compute = TrainerCompute(model, TrainerSettings(learning_rate=1e-2, total_steps=1, loss=LossConfig()))
    assert compute._optimizer.defaults["fused"] is True
    assert ShardedCompute.fused_cpu_optimizer is False
    plain = torch.optim.AdamW(list(reference.parameters()), lr=1e-2, weight_decay=0.0)
    for params in (list(model.parameters()), list(reference.parameters())):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.01 * (i + 1))
    compute._optimizer.step()
    plain.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_trainer_asks_for_fused_adamw_and_tf32_on_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainerCompute passes its device to the CUDA settings and AdamW options (a pretend CUDA
    answer on the CPU: the options reach AdamW)."""
    seen: list[torch.device] = []
    import relayrl.backends.local.trainer as trainer_module

    def options(device: torch.device, fused_cpu: bool = True) -> dict[str, bool]:
        seen.append(device)
        return {"foreach": False}

    def settings(device: torch.device) -> bool:
        seen.append(device)
        return True

    monkeypatch.setattr(trainer_module, "optimizer_options", options)
    monkeypatch.setattr(trainer_module, "cuda_precision_settings", settings)
    compute = TrainerCompute(random_qwen2(VOCAB), TrainerSettings(learning_rate=1e-3, total_steps=1, loss=LossConfig()))
    assert seen == [torch.device("cpu"), torch.device("cpu")]
    assert compute._optimizer.defaults["foreach"] is False


def test_a_bf16_build_gives_fp32_trainer_and_bf16_samplers() -> None:
    """The local backend's build with model.dtype "bfloat16": the trainer trains float32 masters
    (its loss with the truncated-IS cap on), every sampler and the held-out engine hold bfloat16
    copies, and every model's head computes in float32."""
    import asyncio
    import threading

    from relayrl.backends.local.build import compute

    cfg = load_config(None, ["run.backend=local", "model.dtype=bfloat16", "rollout.num_samplers=2"])
    parts: Any = compute(cfg, threading.Event())
    samplers: list[Any] = [factory() for factory in parts.samplers]
    greedy: Any = parts.greedy_engine()
    trainer: Any = parts.trainer()
    try:
        assert trainer.settings.precision == "bfloat16" and trainer.settings.loss.tis_cap == AUTO_TIS_CAP
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        for engine in [*samplers, greedy]:
            model: Any = engine.compute.model
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            assert isinstance(model.get_output_embeddings(), Fp32Linear)
    finally:
        for engine in [*samplers, greedy, trainer]:
            asyncio.run(engine.close())
