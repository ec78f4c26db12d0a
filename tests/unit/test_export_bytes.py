"""A version's export holds each distinct parameter storage once (issue 31 §1, T6): a tied
weight (the shipped tiny model's `lm_head` / `embed_tokens`) appears under both names but is one
tensor, so the export's bytes are the model's unique parameter bytes (the Ray transport sends
it once: tests/ray/test_ray.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.models.sharing import distinct_storages, unique_bytes
from support.modelutil import random_qwen2

pytestmark = pytest.mark.torch


def _unique_parameters(model: PreTrainedModel) -> tuple[int, int]:
    """How many distinct parameters and persistent buffers the model has, and their bytes."""
    state = model.state_dict()
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if n in state]  # (parameters(): each once)
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def _trainer(model: PreTrainedModel) -> TrainerCompute:
    return TrainerCompute(model, TrainerSettings(learning_rate=1e-3, total_steps=1, loss=LossConfig(), torch_threads=1))


@pytest.mark.parametrize("which", ["shipped tied", "random untied"])
def test_the_export_holds_each_distinct_parameter_once(which: str) -> None:
    if which == "shipped tied":
        model = load_model_and_tokenizer(shipped_model_dir())[0]
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        model = random_qwen2(96, tie_word_embeddings=False)
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    count, nbytes = _unique_parameters(model)
    trainer = _trainer(model)
    payload = trainer.export().payload
    assert isinstance(payload, dict)
    own = trainer.model.state_dict()
    assert payload.keys() == own.keys()  # every name, a tied alias included (the samplers load by name)
    for name, value in own.items():
        assert torch.equal(payload[name], value) and payload[name].data_ptr() != value.data_ptr(), name  # a copy
    assert distinct_storages(payload) == count
    assert unique_bytes(payload) == nbytes
    tied = payload["lm_head.weight"].data_ptr() == payload["model.embed_tokens.weight"].data_ptr()
    assert tied == (which == "shipped tied")


class _FileEngine:
    """A stand-in vLLM engine that reads the weight file it is asked to load (names, bytes)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.nbytes = 0

    async def collective_rpc(self, method: str, args: tuple[str, ...]) -> list[dict[str, float]]:
        from safetensors import safe_open

        with safe_open(args[0], framework="pt") as f:
            self.names = list(f.keys())
            self.nbytes = sum(f.get_tensor(n).nbytes for n in self.names)
        return [{"seconds": 0.0}]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True


def test_the_vllm_weight_file_holds_a_tied_weight_once() -> None:
    """safetensors refuses tensors that share memory: the sampler writes one name of a tied pair
    (vLLM ties the head to the embedding itself), so the file's bytes are the unique bytes."""
    import asyncio

    from relayrl.backends.vllm.engine import EngineSettings
    from relayrl.backends.vllm.sampler import VllmSampler
    from relayrl.types import Weights

    model = load_model_and_tokenizer(shipped_model_dir())[0]
    count, nbytes = _unique_parameters(model)
    weights = _trainer(model).export()
    engine = _FileEngine()
    sampler = VllmSampler(EngineSettings(model=str(shipped_model_dir())), temperature=1.0, max_new_tokens=4, engine=engine)
    asyncio.run(sampler.load_weights(Weights(version=1, payload=weights.payload)))
    assert "lm_head.weight" not in engine.names and "model.embed_tokens.weight" in engine.names
    assert len(engine.names) == count and engine.nbytes == nbytes
