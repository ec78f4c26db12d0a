"""Dropout is off in the policy the trainer trains (and in its reference): the trainer computes
log-probs in train mode, the samplers in eval mode, so with dropout left on a model whose config
has dropout > 0 would get a ratio != 1 at staleness 0."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PretrainedConfig, PreTrainedTokenizerBase

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.collate import PackedBatch, TorchCollator
from relayrl.backends.local.generation import SamplingParams
from relayrl.backends.local.logprobs import token_logprobs
from relayrl.backends.local.sampler import SamplerCompute
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.models.loading import disable_dropout, load_model_and_tokenizer, shipped_model_dir
from relayrl.packing import build_microbatch, plan
from relayrl.types import Prompt, SampleRequest, TrainBatch
from support.modelutil import random_qwen2
from support.trajectories import trajectory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_model_and_tokenizer(shipped_model_dir())[1]


def _dropout_rates(model: torch.nn.Module) -> list[float]:
    """Every attention-dropout rate the model's modules hold, and its config's."""
    rates = [float(v) for m in model.modules() for k, v in vars(m).items() if "dropout" in k and isinstance(v, float)]
    config = model.config
    assert isinstance(config, PretrainedConfig)
    return rates + [float(config.attention_dropout)]


def _sampled_batch(model: torch.nn.Module, tok: PreTrainedTokenizerBase) -> TrainBatch:
    """Two groups of 4 completions sampled from `model` (eval mode, a copy), packed as a step."""
    sampler = SamplerCompute(copy.deepcopy(model), copy.deepcopy(tok), SamplingParams(max_new_tokens=6), seed=1)  # type: ignore[arg-type]
    requests = [
        SampleRequest(
            group_id=g, prompt=Prompt(f"p{g}", text, ""), prompt_tokens=tok(text, add_special_tokens=False)["input_ids"], num_samples=4
        )
        for g, text in enumerate(("12+7=", "31-4="))
    ]
    trajs = [
        trajectory(
            group=result.request.group_id,
            sample=i,
            prompt=result.request.prompt,
            prompt_tokens=result.request.prompt_tokens,
            completion_tokens=c.tokens,
            sampler_logprobs=c.logprobs,
            text=c.text,
            advantage=1.0 if i % 2 else -1.0,
        )
        for result in sampler.generate(requests)
        for i, c in enumerate(result.completions)
    ]
    mb = build_microbatch(0, 0, trajs, plan(trajs, 128, 8))
    mb.payload = TorchCollator(pad_token_id=tok.pad_token_id).collate(mb)
    return mb.train_batch()


def test_at_staleness_zero_the_trainer_log_probs_equal_the_samplers_with_dropout_in_the_config(tok: PreTrainedTokenizerBase) -> None:
    model = random_qwen2(len(tok), attention_dropout=0.5)
    assert set(_dropout_rates(model)) == {0.5}
    batch = _sampled_batch(model, tok)
    packed = batch.payload
    assert isinstance(packed, PackedBatch) and int((packed.loss_mask > 0).sum()) >= 8
    # the same batch through a train-mode copy whose dropout is left on: far from the sampler's
    torch.manual_seed(0)
    with torch.no_grad():
        left_on, _ = token_logprobs(copy.deepcopy(model).train(), packed)
    mask = packed.loss_mask > 0
    assert (left_on - packed.old_logprobs)[mask].abs().max() > 1e-2

    ref = copy.deepcopy(model)
    trainer = TrainerCompute(model, TrainerSettings(learning_rate=1e-3, total_steps=1, loss=LossConfig(kl_beta=0.1)), ref_model=ref)
    assert trainer.model.training and set(_dropout_rates(trainer.model)) == {0.0}
    assert set(_dropout_rates(ref)) == {0.0}
    trainer.train_step(batch)
    trainer.optim_step()
    m = trainer.metrics()
    assert m["logprob_diff_max"] < 1e-5
    assert abs(m["ratio_max"] - 1.0) < 1e-5 and abs(m["ratio_min"] - 1.0) < 1e-5


def test_a_loaded_model_has_dropout_off(tok: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    random_qwen2(len(tok), attention_dropout=0.5).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, _ = load_model_and_tokenizer(tmp_path)
    assert set(_dropout_rates(model)) == {0.0}
    ids = torch.tensor([tok("12+7=19", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        evaluated = model.eval()(ids).logits
        trained = model.train()(ids).logits
    torch.testing.assert_close(trained, evaluated, rtol=0, atol=1e-6)


def test_disable_dropout_zeroes_dropout_modules_and_config_rates() -> None:
    """GPT-2 keeps its rates in nn.Dropout modules (attn_pdrop, resid_pdrop, embd_pdrop)."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.5)
    model = GPT2LMHeadModel(cfg)
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.no_grad():
        evaluated = model.eval()(ids).logits
        assert not torch.allclose(model.train()(ids).logits, evaluated, atol=1e-3)  # on: train mode differs
        assert disable_dropout(model) is model
        torch.testing.assert_close(model.train()(ids).logits, evaluated, rtol=0, atol=1e-6)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    assert (model.config.attn_pdrop, model.config.resid_pdrop, model.config.embd_pdrop) == (0.0, 0.0, 0.0)
