"""Where the sharded trainer's ranks compute (T11 of the GPU review): with a pretend 8-GPU
`torch.cuda`, train.device = cuda:4 and world_size = 2 puts the ranks on cuda:4 and cuda:5 (not
cuda:0 and cuda:1), a sampler on a rank's GPU is refused unless train.allow_shared_devices, a rank
beyond the machine's GPUs is refused, and more CPU ranks than cores are refused (issue 34). On a
Ray run the driver's evaluation engine takes no GPU (it is outside Ray's accounting)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from relayrl.backends.local import build, sharded
from relayrl.backends.local.devices import Accelerators, DeviceError, resolve_device
from relayrl.backends.local.placement import check_placement, rank_devices
from relayrl.config.schema import Config, load_config
from support.fakespawn import FakeContext, FakeProcess

EIGHT = Accelerators(cuda_available=True, device_count=8, bf16=True, cuda_build="13.0")


@pytest.fixture
def eight_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees 8 CUDA devices (nothing computes on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def _cfg(*overrides: str) -> Config:
    return load_config(None, ["run.backend=local", *overrides])


def test_rank_r_computes_on_the_base_device_plus_r(eight_gpus: None) -> None:
    base = resolve_device("cuda:4", "train.device")
    assert rank_devices(base, 2) == [torch.device("cuda", 4), torch.device("cuda", 5)]
    assert rank_devices(resolve_device("cuda", "train.device"), 3) == [torch.device("cuda", i) for i in range(3)]
    assert rank_devices(torch.device("cpu"), 2) == [torch.device("cpu")] * 2


def test_the_sharded_trainer_spawns_its_ranks_on_the_devices_train_device_names(eight_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the build: train.device = cuda:4, world_size = 2 → the rank processes are given
    cuda:4 and cuda:5 (fails on the old code: both were given "cuda", rank r taking cuda:r)."""
    from support.modelutil import random_qwen2

    FakeProcess.started = []
    monkeypatch.setattr(sharded.mp, "get_context", lambda method: FakeContext())
    cfg = _cfg("train.device=cuda:4", "train.world_size=2")
    trainer = build.make_trainer(cfg, random_qwen2(32), 1, resolve_device(cfg.train.device, "train.device"))
    try:
        assert [args[7] for args in FakeProcess.started] == ["cuda:4", "cuda:5"]  # rank_main's device argument
        assert [args[0] for args in FakeProcess.started] == [0, 1]
    finally:
        trainer._shutdown()  # type: ignore[union-attr]


def test_a_sampler_on_a_ranks_gpu_is_refused_in_one_line_unless_allowed(eight_gpus: None) -> None:
    cfg = _cfg("train.device=cuda:4", "train.world_size=2", "rollout.device=cuda:5")
    with pytest.raises(DeviceError) as err:
        build.compute(cfg, threading.Event())  # refused before the model loads
    message = str(err.value)
    assert "rollout.device = 'cuda:5'" in message and "cuda:4..cuda:5" in message and "train.allow_shared_devices" in message
    assert "\n" not in message
    shared = _cfg("train.device=cuda:4", "train.world_size=2", "rollout.device=cuda:4", "train.allow_shared_devices=true")
    check_placement(shared, torch.device("cuda", 4), torch.device("cuda", 4))
    # another GPU, the CPU, and one trainer sharing its GPU with the samplers: all fine
    for rollout in (torch.device("cuda", 6), torch.device("cuda", 3), torch.device("cpu")):
        check_placement(cfg, torch.device("cuda", 4), rollout)
    check_placement(_cfg("train.device=cuda:4", "rollout.device=cuda:4"), torch.device("cuda", 4), torch.device("cuda", 4))


def test_a_rank_beyond_the_machines_gpus_is_refused(eight_gpus: None) -> None:
    cfg = _cfg("train.device=cuda:7", "train.world_size=2")
    with pytest.raises(DeviceError, match=r"puts rank 1 on cuda:8: this machine has 8 CUDA devices \(cuda:0\.\.cuda:7\)"):
        build.compute(cfg, threading.Event())
    with pytest.raises(DeviceError, match="cuda:8"):  # even when sharing is allowed
        shared = _cfg("train.device=cuda:7", "train.world_size=2", "train.allow_shared_devices=true")
        check_placement(shared, torch.device("cuda", 7), torch.device("cpu"))


def test_more_cpu_ranks_than_cores_are_refused_unless_allowed() -> None:
    """Issue 34: train.world_size = 64 on 2 cores printed nothing for minutes; now one line."""
    cfg = _cfg("train.world_size=64")
    with pytest.raises(DeviceError) as err:
        check_placement(cfg, torch.device("cpu"), torch.device("cpu"), cores=2)
    assert str(err.value) == (
        "train.world_size = 64 CPU ranks on 2 CPU cores: at most one rank per core "
        "(lower train.world_size, or set train.allow_shared_devices = true to oversubscribe)"
    )
    check_placement(_cfg("train.world_size=2"), torch.device("cpu"), torch.device("cpu"), cores=2)
    check_placement(_cfg("train.world_size=64", "train.allow_shared_devices=true"), torch.device("cpu"), torch.device("cpu"), cores=2)


def test_the_run_refuses_too_many_cpu_ranks_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.backends.local import placement

    monkeypatch.setattr(placement, "cpu_cores", lambda: 2)
    loaded: list[object] = []
    monkeypatch.setattr(build, "load_base", lambda *a, **k: loaded.append(a))
    with pytest.raises(DeviceError, match="train.world_size = 64 CPU ranks on 2 CPU cores"):
        build.compute(_cfg("train.world_size=64"), threading.Event())
    assert not loaded


def test_on_ray_the_drivers_evaluation_engine_takes_no_gpu(eight_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's greedy engine is outside Ray's GPU accounting: it computes on the CPU even
    where the driver's machine has the GPU rollout.device names (old code: cuda:0)."""
    seen: dict[str, Any] = {}

    def load(cfg: Config, dtype: torch.dtype = torch.float32) -> Any:
        seen["dtype"] = dtype
        raise RuntimeError("stop after placement")

    monkeypatch.setattr(build, "load_base", load)
    with pytest.raises(RuntimeError, match="stop after placement"):
        build.compute(_cfg("ray.enabled=true", "rollout.device=cuda:0", "model.dtype=auto"), threading.Event())
    assert seen["dtype"] == torch.float32  # resolved for the CPU, not for cuda:0 (bfloat16)
