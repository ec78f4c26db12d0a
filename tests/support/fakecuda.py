"""A pretend CUDA torch for tests on a CPU-only build: torch.cuda's device queries monkeypatched
(is_available, device_count, is_bf16_supported, get_device_properties, mem_get_info, init), so
device resolution and the GPU memory plan see `count` GPUs of `total_gib` GiB each. Nothing is
allocated on them: a test using this must never move a tensor to CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

GiB = 1024**3


def pretend_cuda(
    monkeypatch: pytest.MonkeyPatch, count: int = 2, total_gib: float = 141.0, *, bf16: bool = True, free_gib: float | None = None
) -> None:
    total = int(total_gib * GiB)
    free = int((free_gib if free_gib is not None else total_gib) * GiB)

    def check(device: int) -> int:
        if not 0 <= int(device) < count:
            raise AssertionError(f"pretend CUDA has no device {device}")
        return int(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=0: SimpleNamespace(total_memory=total, name=f"pretend {check(d)}"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=0: (free, total) if check(d) >= 0 else (0, 0))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
