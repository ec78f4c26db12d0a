"""The trainer's and the sampler's compute on the `meta` device (T8 of the GPU review), the CPU's
stand-in for a CUDA device: a model built on meta and a packed batch moved there run the
trainer's forward and backward (`token_logprobs`) and the sampler's token choice (`pick_tokens`)
with every tensor staying on meta; a CPU tensor mixed in raises ("... is not on the expected
device meta"), so a future edit that creates a tensor on the CPU in these paths fails here
instead of on a GPU. The policy loss runs up to its first sanctioned host sync (a `.item()` /
`float()` reads a value, which meta has not) and must stop only there. (Sampling's decode loop
stops inside transformers' mask building, a host sync of every HF forward: not covered.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig, deferred_policy_loss
from relayrl.backends.local.collate import PackedBatch
from relayrl.backends.local.generation import SamplingParams, pick_tokens
from relayrl.backends.local.logprobs import token_logprobs
from relayrl.bench.trainer import _steps
from support.modelutil import random_qwen2

pytestmark = pytest.mark.torch

VOCAB = 64
META = torch.device("meta")
# what a value read on meta says (a sanctioned sync), and what a device mix says (a defect)
VALUE_READ = ("meta tensors", "on meta", "data-dependent", "meta device", "out of meta tensor")
MIXED = "not on the expected device"


def _model() -> Any:
    return torch.nn.Module.to(random_qwen2(VOCAB), META).train()


def _batch() -> PackedBatch:
    payload = _steps(VOCAB, 1, 1, 64)[0][0].payload
    assert isinstance(payload, PackedBatch)
    return payload


def _all_meta(batch: PackedBatch) -> None:
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            assert value.device == META, f.name


def test_the_trainers_forward_and_backward_stay_on_meta() -> None:
    model, batch = _model(), _batch().to(META)
    _all_meta(batch)
    logp, entropy = token_logprobs(model, batch)
    assert logp.device == META and entropy.device == META
    assert logp.shape == batch.target_ids.shape
    logp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device == META for g in grads)
    logp, entropy = token_logprobs(model, batch, entropy_grad=True)  # (an entropy bonus's path)
    (logp.sum() + entropy.sum()).backward()


def test_a_cpu_tensor_mixed_in_raises() -> None:
    """The guard works: a batch tensor left on the CPU fails the meta forward."""
    cpu = _batch()
    mixed = dataclasses.replace(cpu.to(META), position_ids=cpu.position_ids)
    with pytest.raises(RuntimeError, match=MIXED):
        token_logprobs(_model(), mixed)


def test_the_policy_loss_runs_on_meta_up_to_its_one_value_read() -> None:
    """The trainer's loss (deferred_policy_loss) and its backward run on meta without reading a
    value; its one host read is `fetch()`, which meta refuses."""
    model, batch = _model(), _batch().to(META)
    # per-sequence aggregation still checks its sequence index on the host (a sanctioned read)
    for cfg, reads_early in (
        (LossConfig(), False),
        (LossConfig(kl_beta=0.1), False),
        (LossConfig(aggregation="seq_mean_token_mean"), True),
    ):
        logp, _ = token_logprobs(model, batch)
        with pytest.raises((RuntimeError, NotImplementedError)) as info:  # the value read: meta has none
            deferred = deferred_policy_loss(
                logp,
                batch.old_logprobs,
                batch.advantages,
                batch.loss_mask,
                batch.seq_index,
                cfg,
                num_tokens_in_step=16.0,
                num_seqs_in_step=4.0,
                ref_logprobs=logp.detach() if cfg.kl_beta > 0 else None,
            )
            assert not reads_early, "per-sequence aggregation read no value before fetch()"
            assert deferred.loss.device == META and deferred.values.device == META
            deferred.loss.backward()
            deferred.fetch()
        message = str(info.value)
        assert MIXED not in message and "cpu" not in message.lower(), message
        assert any(s in message for s in VALUE_READ), message


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(greedy=True)]


@pytest.mark.parametrize("params", PARAMS)
def test_the_samplers_token_choice_stays_on_meta(params: SamplingParams) -> None:
    logits = torch.empty(6, VOCAB, device=META)
    tokens, logprobs = pick_tokens(logits, params, None)
    assert tokens.device == META and logprobs.device == META and tokens.shape == (6,)
    groups: list[tuple[torch.Generator | None, list[int]]] = [(None, [0, 2]), (None, [1])]  # rows: host indices
    tokens, logprobs = pick_tokens(logits, params, None, per_group=groups)
    assert tokens.device == META and logprobs.device == META
