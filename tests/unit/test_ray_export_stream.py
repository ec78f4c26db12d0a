"""The Ray trainer actor copies an exported version out (to the object store) only once the
trainer's CUDA stream has written it: it waits for the export's `Weights.ready` event first (a
recording stand-in here: no GPU, no Ray cluster)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

pytest.importorskip("ray")

from relayrl.backends.ray import actors  # noqa: E402
from relayrl.types import Weights  # noqa: E402


class _Event:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronized")


def test_the_export_waits_for_the_trainers_stream_before_copying_out(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []

    def encode(payload: Any) -> Any:
        log.append("encoded")
        return payload

    class Worker:
        async def export_weights(self) -> Weights:
            return Weights(version=3, payload={"w": torch.zeros(2)}, ready=_Event(log))

    monkeypatch.setattr(actors, "encode", encode)
    monkeypatch.setattr(actors.ray, "put", lambda value: value)
    actor = actors._TrainerActor.__new__(actors._TrainerActor)
    actor._worker = Worker()
    actor._exported = None
    exported = asyncio.run(actor._export())
    assert exported.version == 3 and log == ["synchronized", "encoded"]
