"""The collective weight transport with vLLM engines in one process (relayrl.backends.vllm.broadcast
and .transfer): two replicas on the shipped tiny model receive each version through vLLM's
weight-transfer API over a gloo group, bit for bit what the file transport loads; a broadcast that
fails half-way leaves every replica on the version from its file, and the next rounds go by file."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.backends.protocols import Trainer
from relayrl.backends.vllm.broadcast import VllmBroadcast, WeightGroupWarning
from relayrl.backends.vllm.engine import EngineSettings
from relayrl.backends.vllm.sampler import VllmSampler
from relayrl.models.loading import shipped_model_dir
from relayrl.types import Prompt, SampleRequest, Weights
from support.threadloop import Loop, thread_loop

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


class Commits:
    """A trainer stand-in (its `export_weights` only): each `commit` is a new version, the base
    model's weights plus noise."""

    def __init__(self) -> None:
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(shipped_model_dir(), dtype=torch.float32).eval()
        self.version = 0
        self.weights = Weights(0, {k: v.clone() for k, v in self.model.state_dict().items()})

    def commit(self) -> Weights:
        self.version += 1
        gen = torch.Generator().manual_seed(self.version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        self.weights = Weights(self.version, {k: v.clone() for k, v in self.model.state_dict().items()})
        return self.weights

    async def export_weights(self) -> Weights:
        return self.weights


loop = pytest.fixture(scope="module", name="loop")(thread_loop)


@pytest.fixture(scope="module")
def samplers(loop: Loop) -> Iterator[list[VllmSampler]]:
    settings = EngineSettings(model=str(shipped_model_dir()), max_model_len=128, weight_transfer=True)

    async def start() -> list[VllmSampler]:
        return [VllmSampler(settings, temperature=1.0, max_new_tokens=6, replica=i, seed=0) for i in range(2)]

    made = loop.run(start())
    yield made
    for s in made:
        loop.run(s.close())


async def _round(broadcast: VllmBroadcast, samplers: list[VllmSampler]) -> Weights:
    """One sync round as the weight publisher runs it: the loads start with the export."""
    pending = await broadcast.export_ahead()
    loads = [asyncio.ensure_future(s.load_weights(pending.weights)) for s in samplers]
    weights = await pending.done
    await asyncio.gather(*loads)
    return weights


def _requests() -> list[SampleRequest]:
    return [SampleRequest(group_id=i, prompt=Prompt(str(i), "", ""), prompt_tokens=p, num_samples=1) for i, p in enumerate(PROMPTS)]


def _torch_logprobs(model: PreTrainedModel, sampler_out: list[Any]) -> list[list[float]]:
    logps = []
    for prompt, completion in zip(PROMPTS, sampler_out, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.tokens])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        logps.append([float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion.tokens)])
    return logps


def test_each_version_reaches_every_replica_through_vllms_weight_transfer_api(loop: Loop, samplers: list[VllmSampler]) -> None:
    trainer = Commits()
    broadcast = VllmBroadcast(cast(Trainer, trainer), samplers, timeout_s=120)
    for version in (1, 2):
        trainer.commit()
        assert broadcast.covers([0, 1])
        weights = loop.run(_round(broadcast, samplers))
        assert weights.version == version and broadcast.broken is None
        assert [s.version for s in samplers] == [version, version]
        assert all(s.transfer_member for s in samplers) and [s.fell_back for s in samplers] == [0, 0]
        for s in samplers:  # each replica samples with the broadcast weights: its log-probs are torch's under them
            out = loop.run(s.generate(_requests()))
            completions = [r.completions[0] for r in out]
            assert all(r.policy_version == version for r in out)
            expected = _torch_logprobs(trainer.model, completions)
            for got, want in zip((c.logprobs for c in completions), expected, strict=True):
                assert got == pytest.approx(want, abs=2e-3)


def test_a_broadcast_that_fails_half_way_leaves_every_replica_on_the_version_from_its_file(
    loop: Loop, samplers: list[VllmSampler], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = Commits()
    broadcast = VllmBroadcast(cast(Trainer, trainer), samplers, timeout_s=120)
    trainer.commit()
    loop.run(_round(broadcast, samplers))  # the group is set up and works
    fell_back = [s.fell_back for s in samplers]

    send = broadcast._send

    def header_then_leave(round_: int, weights: Weights, state: Any) -> None:
        member = broadcast._member
        assert member is not None
        member._header([round_, weights.version])
        broadcast._leave()  # the trainer's side dies after the header
        raise RuntimeError("the trainer's side died")

    monkeypatch.setattr(broadcast, "_send", header_then_leave)
    trainer.commit()
    with pytest.warns(WeightGroupWarning, match="the trainer's broadcast failed"):
        loop.run(_round(broadcast, samplers))
    assert [s.version for s in samplers] == [2, 2]  # each loaded version 2 from its file
    assert [s.fell_back - f for s, f in zip(samplers, fell_back, strict=True)] == [1, 1]
    assert not any(s.transfer_member for s in samplers) and broadcast.broken is not None
    assert not broadcast.covers([0, 1])  # the publisher uses the file from now on
    out = loop.run(samplers[0].generate(_requests()))
    completions = [r.completions[0] for r in out]
    for got, want in zip((c.logprobs for c in completions), _torch_logprobs(trainer.model, completions), strict=True):
        assert got == pytest.approx(want, abs=2e-3)
    monkeypatch.setattr(broadcast, "_send", send)
