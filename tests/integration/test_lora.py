"""LoRA (train.lora, via peft) on the shipped tiny model: only the adapters train, the KL reference
is the model with its adapters off, the samplers merge adapter-only payloads into their base
weights, checkpoints round-trip, and a LoRA run's exported adapter loads with peft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.collate import PackedBatch
from relayrl.backends.local.generation import SamplingParams
from relayrl.backends.local.logprobs import token_logprobs
from relayrl.backends.local.sampler import SamplerCompute
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.config.schema import ConfigError, LoraConfig, load_config
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.models.lora import SUFFIXES, AdapterMerger, adapter_payload, check_targets, is_adapter_payload, payload_bytes, peft_base, wrap
from relayrl.types import TrainBatch, Weights


def _batch(tok: Any, advantages: tuple[float, float]) -> TrainBatch:
    """A collated one-step micro-batch of two completions of "12+7=" with these advantages."""
    from relayrl.backends.local.collate import TorchCollator
    from relayrl.packing import build_microbatch, plan
    from relayrl.types import Prompt
    from support.trajectories import trajectory

    prompt_ids = tok("12+7=", add_special_tokens=False)["input_ids"]
    trajs = [
        trajectory(
            sample=i,
            prompt=Prompt("p", "12+7=", "19"),
            prompt_tokens=prompt_ids,
            completion_tokens=tok(c, add_special_tokens=False)["input_ids"],
            sampler_logprobs=[-1.0] * len(c),
            text=c,
            advantage=a,
        )
        for i, (c, a) in enumerate(zip(("19", "18"), advantages, strict=True))
    ]
    mb = build_microbatch(0, 0, trajs, plan(trajs, 64, 4))
    mb.payload = TorchCollator(pad_token_id=tok.pad_token_id).collate(mb)
    return mb.train_batch()


def _trainer(kl_beta: float = 0.0, lr: float = 1e-2) -> tuple[TrainerCompute, Any]:
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    settings = TrainerSettings(learning_rate=lr, total_steps=8, loss=LossConfig(kl_beta=kl_beta))
    return TrainerCompute(wrap(model, LoraConfig(r=4, alpha=8.0), seed=0), settings), tok


def _steps(trainer: TrainerCompute, tok: Any, n: int) -> None:
    for i in range(n):
        trainer.train_step(_batch(tok, (1.0, -1.0) if i % 2 == 0 else (-0.5, 1.0)))
        trainer.optim_step()


def test_only_the_adapters_train_and_travel() -> None:
    trainer, tok = _trainer(kl_beta=0.1)
    named = dict(trainer.model.named_parameters())
    base_before = {n: p.detach().clone() for n, p in named.items() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in named.items() if "lora_" in n}
    optimized = {id(p) for group in trainer._optimizer.param_groups for p in group["params"]}
    assert optimized == {id(named[n]) for n in lora_before}  # the optimizer holds the adapters only
    _steps(trainer, tok, 2)
    assert all(torch.equal(named[n], t) for n, t in base_before.items())  # no base weight moved
    assert any(not torch.equal(named[n], t) for n, t in lora_before.items())
    weights = trainer.committed_weights()
    assert weights is not None and weights.version == 2
    payload = weights.payload
    assert isinstance(payload, dict) and is_adapter_payload(payload)
    assert all(k.endswith(SUFFIXES) for k in payload)
    full = sum(t.numel() * t.element_size() for t in peft_base(trainer.model).state_dict().values() if t.dtype.is_floating_point)
    assert payload_bytes(payload) < full / 5  # r = 4 on a 128-wide model


def test_the_reference_is_the_base_model_with_adapters_off() -> None:
    trainer, tok = _trainer(kl_beta=0.1)
    assert trainer.ref_model is None  # no second copy
    _steps(trainer, tok, 2)  # the adapters are now non-zero
    batch = _batch(tok, (1.0, -1.0)).payload
    assert isinstance(batch, PackedBatch)
    base, _ = load_model_and_tokenizer(shipped_model_dir())
    with torch.no_grad():
        expected, _ = token_logprobs(base.train(), batch)
        with trainer.model.disable_adapter():
            ref, _ = token_logprobs(peft_base(trainer.model), batch)
        policy, _ = token_logprobs(peft_base(trainer.model), batch)
    torch.testing.assert_close(ref, expected, rtol=0, atol=1e-5)
    assert (policy - expected).abs().max() > 1e-3  # the adapters do change the policy
    trainer.train_step(_batch(tok, (1.0, -1.0)))
    trainer.optim_step()
    assert trainer.metrics()["kl_mean"] > 0  # the KL term sees the policy move away from the base


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_sampler_merge_equals_the_peft_forward_each_version() -> None:
    trainer, tok = _trainer()
    base, tok2 = load_model_and_tokenizer(shipped_model_dir())
    sampler = SamplerCompute(base, tok2, SamplingParams())
    ids = torch.tensor([tok("12+7=19", add_special_tokens=False)["input_ids"], tok("45-13=32", add_special_tokens=False)["input_ids"][:7]])
    for version in (1, 2, 3):  # each merge starts from the base: never onto a merged copy
        _steps(trainer, tok, 1)
        weights = trainer.committed_weights()
        assert weights is not None and weights.version == version
        sampler.load_weights(weights)
        assert sampler.version == version
        trainer.model.eval()
        torch.testing.assert_close(_logits(sampler.model, ids), _logits(trainer.model, ids), rtol=0, atol=1e-4)
        trainer.model.train()
    # a payload that does not fit changes nothing
    good = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    payload = dict(adapter_payload(trainer.model))
    first = next(k for k in payload if k.endswith(".lora_A"))
    payload[first] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="has shapes A"):
        sampler.load_weights(Weights(version=9, payload=payload))
    assert sampler.version == 3 and all(torch.equal(v, good[k]) for k, v in sampler.model.state_dict().items())


def test_a_checkpoint_round_trips_the_adapters_and_optimizer(tmp_path: Path) -> None:
    trainer, tok = _trainer()
    _steps(trainer, tok, 2)
    trainer.save_state(tmp_path)
    saved = torch.load(tmp_path / "trainer.pt", map_location="cpu", weights_only=True)
    assert is_adapter_payload(saved["model"])  # adapters only, not the base weights
    fresh, _ = _trainer()
    assert fresh.load_state(tmp_path) == 2
    a, b = adapter_payload(trainer.model), adapter_payload(fresh.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = trainer._optimizer.state_dict()["state"], fresh._optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    # both go on identically
    for t in (trainer, fresh):
        t.train_step(_batch(tok, (1.0, -1.0)))
        t.optim_step()
    a, b = adapter_payload(trainer.model), adapter_payload(fresh.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_config_is_checked_in_one_line() -> None:
    model, _ = load_model_and_tokenizer(shipped_model_dir())
    with pytest.raises(ConfigError, match=r"^invalid config key 'train.lora.target_modules': 'qkv' is not a linear layer"):
        check_targets(model, LoraConfig(target_modules=["q_proj", "qkv"]))
    with pytest.raises(ConfigError, match=r"'lm_head' shares its weight with the input embeddings"):  # the tiny model ties them
        check_targets(model, LoraConfig(target_modules=["q_proj", "lm_head"]))
    cases = {
        "train.lora.r=0": "invalid config key 'train.lora.r'",
        "train.lora.alpha=-1": "invalid config key 'train.lora.alpha'",
        "train.lora.dropout=1.0": "invalid config key 'train.lora.dropout'",
        "train.lora.dropout=0.1": "train.lora.dropout = 0.1 needs algorithm.tis_cap",
        "train.lora.target_modules=[]": "invalid config key 'train.lora.target_modules'",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message) as info:
            load_config(None, ["run.backend=local", override])
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"train.lora needs run.backend = 'local'"):
        load_config(None, ["run.backend=sim", "train.lora={}"])
    with pytest.raises(ConfigError, match="train.lora is not supported with rollout.engine = 'vllm'"):
        load_config(None, ["run.backend=local", "rollout.engine=vllm", "train.lora={}"])
    cfg = load_config(None, ["run.backend=local", "train.lora.dropout=0.05", "algorithm.tis_cap=2"])
    assert cfg.train.lora == LoraConfig(dropout=0.05)


def test_adapter_dropout_stays_on_in_training_only_when_asked() -> None:
    model, _ = load_model_and_tokenizer(shipped_model_dir())
    settings = TrainerSettings(learning_rate=1e-3, total_steps=1, loss=LossConfig(), lora_dropout=0.25)
    trainer = TrainerCompute(wrap(model, LoraConfig(dropout=0.25), seed=0), settings)
    dropouts = [m for n, m in trainer.model.named_modules() if n.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, torch.nn.Dropout) and m.p == 0.25 for m in dropouts)
    others = [m for n, m in trainer.model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" not in n]
    assert all(m.p == 0.0 for m in others)


def test_config_toml_round_trips_train_lora(tmp_path: Path) -> None:
    from relayrl.config.schema import config_to_toml

    cfg = load_config(None, ["run.backend=local", "train.lora.r=4", 'train.lora.target_modules=["q_proj","v_proj"]'])
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path).train.lora == LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    assert json.loads(json.dumps(cfg.model_dump()))["train"]["lora"]["r"] == 4


LORA_RUN = [
    "run.backend=local",
    "run.steps=40",
    "train.lora.r=8",
    "train.learning_rate=2e-3",  # measured: 1e-2 and 5e-3 learn less or lose accuracy on this model
    "train.warmup_steps=0",
    "rollout.groups_per_step=16",
    "task.heldout_size=100",
    "eval.every_steps=0",
    "orchestrator.checkpoint_every=40",
]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default recipe with LoRA adapters, shortened to 40 steps (~30 s on 2 cores)."""
    from relayrl.orchestrator.build import build_program
    from support.simutil import run_checked

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    from relayrl.recipes import default_recipe

    run_checked(build_program(load_config(default_recipe(), LORA_RUN), run_dir=run_dir), timeout=300)
    return run_dir


@pytest.mark.slow
def test_a_lora_run_learns(lora_run: Path) -> None:
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["accuracy_after"] > summary["accuracy_before"]  # measured: 0.27 -> 0.37


@pytest.mark.slow
def test_the_exported_adapter_loads_with_peft_and_reproduces_the_trainers_greedy_outputs(lora_run: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from relayrl.models.export import MARKER, export_run
    from relayrl.models.loading import greedy_completions
    from relayrl.rundir.checkpoint import checkpoint_dir
    from relayrl.tasks.build import build_task

    model_dir = lora_run / "model"  # run.save_model: the adapter
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", MARKER} <= {p.name for p in model_dir.iterdir()}
    assert not (model_dir / "model.safetensors").exists()
    base, tok = load_model_and_tokenizer(shipped_model_dir())
    loaded = peft_base(PeftModel.from_pretrained(base, model_dir).eval())
    # the trainer's policy: its last checkpoint's adapters in a LoRA-wrapped model
    trainer_model, _ = load_model_and_tokenizer(shipped_model_dir())
    trainer = TrainerCompute(
        wrap(trainer_model, LoraConfig(r=8), seed=0), TrainerSettings(learning_rate=1e-3, total_steps=1, loss=LossConfig())
    )
    trainer.load_state(checkpoint_dir(lora_run, 40))
    policy = peft_base(trainer.model.eval())
    prompts = [p.text for p in build_task(load_config(lora_run / "config.toml")).heldout]
    ours = greedy_completions(loaded, tok, prompts, max_new_tokens=4)
    assert ours == greedy_completions(policy, tok, prompts, max_new_tokens=4)
    fresh, _ = load_model_and_tokenizer(shipped_model_dir())
    assert ours != greedy_completions(fresh, tok, prompts, max_new_tokens=4)  # the adapter changes the policy
    # --merged: a plain model with the adapter merged in, the same greedy outputs
    merged = export_run(lora_run, out=lora_run / "merged", merged=True)
    assert not merged.adapter and (merged.directory / "model.safetensors").is_file()
    plain = AutoModelForCausalLM.from_pretrained(merged.directory, local_files_only=True).eval()
    assert greedy_completions(plain, tok, prompts, max_new_tokens=4) == ours


def test_an_adapter_payload_crosses_the_ray_transport() -> None:
    from relayrl.backends.ray.transport import decode, encode

    trainer, tok = _trainer()
    _steps(trainer, tok, 1)
    payload = adapter_payload(trainer.model)
    back = decode(encode(payload))
    assert isinstance(back, dict) and back.keys() == payload.keys()
    assert all(torch.equal(back[k], payload[k]) for k in payload) and is_adapter_payload(back)


def test_a_tiny_adapter_update_survives_in_a_bf16_sampler() -> None:
    """model.dtype "bfloat16": the sampler's weights are bfloat16, so merging W0 + s·B·A into
    them rounds an update below half a bfloat16 ulp of W0 away (here every one: W0 = ±1, the update
    1e-3 per weight); the sampler applies it unmerged, so the output moves by it. A float32 sampler
    merges (its weights change, exactly W0 + s·B·A)."""

    def layer(dtype: torch.dtype) -> Any:
        net = torch.nn.Module()
        net.proj = torch.nn.Linear(128, 4, bias=False)
        with torch.no_grad():
            net.proj.weight.copy_(torch.tensor([1.0, -1.0]).repeat(4, 64))  # each row sums to 0 on x = 1
        return net.to(dtype)

    payload = {"proj.lora_A": torch.full((1, 128), 5e-4), "proj.lora_B": torch.ones(4, 1), "proj.lora_scaling": torch.tensor(2.0)}
    x = torch.ones(2, 128)
    sampler = layer(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(sampler.proj(x.bfloat16()), torch.zeros(2, 4, dtype=torch.bfloat16))
        AdapterMerger(sampler).merge(payload, "test")
        out = sampler.proj(x.bfloat16()).float()
    torch.testing.assert_close(out, torch.full((2, 4), 0.128), rtol=0, atol=1e-3)  # 128 × 2 × 5e-4
    assert all(v.dtype == torch.bfloat16 for v in sampler.state_dict().values())  # the sampler's weights stay bf16
    full = layer(torch.float32)
    AdapterMerger(full).merge(payload, "test")
    torch.testing.assert_close(full.proj.weight, layer(torch.float32).proj.weight + 1e-3, rtol=0, atol=1e-7)


def test_lora_adapters_start_from_run_seed() -> None:
    """Two wraps with one seed give the same adapters whatever torch's global RNG did before,
    and leave the global RNG as it was; another seed gives others."""
    lora = LoraConfig(r=4)

    def adapters(seed: int, noise: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(noise)  # the global RNG in some other state
        model, _ = load_model_and_tokenizer(shipped_model_dir())
        state = torch.random.get_rng_state()
        peft_model = wrap(model, lora, seed=seed)
        assert torch.equal(torch.random.get_rng_state(), state)
        return adapter_payload(peft_model)

    one, two, other = adapters(7, 1), adapters(7, 2), adapters(8, 1)
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert any(not torch.equal(one[k], other[k]) for k in one if k.endswith(".lora_A"))
