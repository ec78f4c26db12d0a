"""T15: trainer and samplers in one process each compute on their own CUDA stream, and the
weights the trainer hands a sampler carry an event the sampler's stream waits for.

CPU only: `torch.cuda.Stream`, `set_stream`, `current_stream` and `Event` are replaced by
recorders, and the models report a CUDA device (`model.device`), so the workers take their CUDA
paths while every tensor stays on the CPU.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local import streams
from relayrl.backends.local.generation import SamplingParams
from relayrl.backends.local.sampler import LocalSampler
from relayrl.backends.local.trainer import LocalTrainer, TrainerSettings
from support.modelutil import random_qwen2

CUDA0 = torch.device("cuda", 0)


@dataclass(eq=False)
class FakeStream:
    device: torch.device
    waited: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class FakeEvent:
    recorded_on: list[FakeStream] = field(default_factory=list)

    def record(self, stream: FakeStream) -> None:
        self.recorded_on.append(stream)


class Recorder:
    """Stand-ins for torch.cuda's streams and events, recording which thread did what."""

    def __init__(self) -> None:
        self.made: list[FakeStream] = []
        self.entered: dict[str, list[FakeStream]] = {}  # thread name -> streams it made current
        self.events: list[FakeEvent] = []
        self._default: dict[tuple[str, torch.device], FakeStream] = {}

    def stream(self, device: Any = None, **_: Any) -> FakeStream:
        s = FakeStream(torch.device(device))
        self.made.append(s)
        return s

    def set_stream(self, stream: FakeStream) -> None:
        self.entered.setdefault(threading.current_thread().name, []).append(stream)

    def current_stream(self, device: Any = None) -> FakeStream:
        name = threading.current_thread().name
        if name in self.entered:
            return self.entered[name][-1]
        return self._default.setdefault((name, torch.device(device)), FakeStream(torch.device(device)))

    def event(self, **_: Any) -> FakeEvent:
        e = FakeEvent()
        self.events.append(e)
        return e


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(torch.cuda, "Stream", rec.stream)
    monkeypatch.setattr(torch.cuda, "set_stream", rec.set_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", rec.current_stream)
    monkeypatch.setattr(torch.cuda, "Event", rec.event)
    monkeypatch.setattr(FakeStream, "wait_event", lambda self, event: self.waited.append(event), raising=False)
    # the workers' models say they are on cuda:0 (their tensors stay on the CPU)
    monkeypatch.setattr(Qwen2ForCausalLM, "device", property(lambda self: CUDA0))
    return rec


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0} | {f"t{i}": i for i in range(1, 32)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")


def test_worker_threads_use_own_streams(recorder: Recorder) -> None:
    trainer = LocalTrainer(random_qwen2(32, 0), TrainerSettings(learning_rate=1e-4, total_steps=2, loss=LossConfig()))
    sampler = LocalSampler(random_qwen2(32, 1), _tokenizer(), SamplingParams(max_new_tokens=2), interruptible=True)
    other = LocalSampler(random_qwen2(32, 2), _tokenizer(), SamplingParams(max_new_tokens=2), replica=1)

    async def main() -> None:
        try:
            weights = await trainer._host.call(trainer.compute.export)  # in the trainer's thread
            await sampler.load_weights(weights)  # in the sampler's load thread
            await sampler._host.call(lambda: None)  # starts the sampler's generate thread
            await other._host.call(lambda: None)
            threads = {name: entered for name, entered in recorder.entered.items()}
            (t_stream,) = threads["relayrl-trainer_0"]
            (s_stream,) = threads["relayrl-sampler-0_0"]
            (l_stream,) = threads["relayrl-sampler-0-load_0"]
            (o_stream,) = threads["relayrl-sampler-1_0"]
            # each worker its own stream on its device; a sampler's two threads share it
            assert len({id(t_stream), id(s_stream), id(o_stream)}) == 3 and l_stream is s_stream
            assert all(s.device == CUDA0 for s in (t_stream, s_stream, o_stream))
            assert threading.current_thread().name not in threads  # the event loop's thread keeps its stream
            # the handoff: recorded on the trainer's stream after the export, waited for on the sampler's
            assert isinstance(weights.ready, FakeEvent) and weights.ready.recorded_on == [t_stream]
            assert s_stream.waited == [weights.ready] and t_stream.waited == []
        finally:
            await trainer.close()
            await sampler.close()
            await other.close()

    asyncio.run(main())


def test_cpu_workers_make_no_stream() -> None:
    """On the CPU nothing changes: no stream, no event (the real torch.cuda is never called)."""
    assert streams.worker_stream("cpu") is None and streams.handoff("cpu") is None
    streams.enter_stream(None)
    streams.receive(None, [torch.zeros(2)], "cpu")
