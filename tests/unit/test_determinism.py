"""run.deterministic (T13 of the GPU review): off by default; on, the local backend sets
CUBLAS_WORKSPACE_CONFIG before this process's first CUDA call, turns on
torch.use_deterministic_algorithms and leaves attention on its deterministic (math) kernel;
the sharded trainer's ranks do as their host (recorders stand in for torch's switches, so no
global state of this test process changes)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from relayrl.backends.local import build
from relayrl.config.schema import Config, load_config


@pytest.fixture
def switches(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """torch's determinism switches replaced by recorders; the first CUDA call records what
    CUBLAS_WORKSPACE_CONFIG was then."""
    seen: dict[str, Any] = {"cuda_calls": []}
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, **k: seen.__setitem__("algorithms", on))
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp", "enable_math_sdp"):
        monkeypatch.setattr(torch.backends.cuda, name, lambda on, name=name: seen.__setitem__(name, on))
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)

    def first_cuda_call() -> bool:
        seen["cuda_calls"].append(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return False

    monkeypatch.setattr(torch.cuda, "is_available", first_cuda_call)

    def stop(cfg: Config, dtype: torch.dtype = torch.float32) -> Any:
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(build, "load_base", stop)
    return seen


def _compute(*overrides: str) -> None:
    with pytest.raises(RuntimeError, match="stop before loading"):
        build.compute(load_config(None, ["run.backend=local", "train.device=auto", *overrides]), threading.Event())


def test_off_by_default(switches: dict[str, Any]) -> None:
    assert Config().run.deterministic is False
    _compute()
    assert "algorithms" not in switches and switches["cuda_calls"][0] is None
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_on_it_is_set_before_the_first_cuda_call(switches: dict[str, Any]) -> None:
    _compute("run.deterministic=true")
    assert switches["cuda_calls"] and switches["cuda_calls"][0] == ":4096:8"  # the device probe saw it already
    assert switches["algorithms"] is True
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False
    assert (switches["enable_flash_sdp"], switches["enable_mem_efficient_sdp"], switches["enable_cudnn_sdp"]) == (False, False, False)
    assert switches["enable_math_sdp"] is True


def test_the_ranks_do_as_their_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sharded trainer passes its process's setting to each rank's body."""
    from relayrl.backends.local import sharded
    from support.fakespawn import FakeContext, FakeProcess
    from support.modelutil import random_qwen2

    FakeProcess.started = []
    monkeypatch.setattr(sharded.mp, "get_context", lambda method: FakeContext())
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    trainer = build.make_trainer(load_config(None, ["run.backend=local", "train.world_size=2"]), random_qwen2(32), 1)
    try:
        assert [args[8].deterministic for args in FakeProcess.started] == [True, True]  # rank_main's options
    finally:
        trainer._shutdown()  # type: ignore[union-attr]
