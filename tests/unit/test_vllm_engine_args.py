"""The vLLM engine's arguments on a pretend CUDA machine (issue 30 §3, issue 31 §4; review T4), with
`vllm` stubbed in sys.modules (no vLLM needed): the replica's share of its GPU is set and leaves
room for what the trainer and the evaluation's engine are estimated to keep there, the engine core
is spawned seeing only the GPU rollout.device names, CUDA graphs are on, the dtype is resolved, the
prefill is chunked; on the CPU the engine stays eager in float32; a CUDA build refuses the CPU."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config

from relayrl.backends.local.build import gpu_preflight
from relayrl.backends.vllm.build import VllmSamplerFactory, engine_settings
from relayrl.backends.vllm.engine import visible_devices
from relayrl.backends.vllm.sampler import VllmSampler
from relayrl.bench.gpu_check import QWEN2_05B
from relayrl.config.schema import Config, ConfigError, load_config
from relayrl.config.sizing import GPU_HEADROOM
from support.fakecuda import GiB, pretend_cuda


class _Recorder:
    """Stand-ins for vllm's AsyncEngineArgs and AsyncLLM: what the engine was started with."""

    def __init__(self) -> None:
        self.args: dict[str, Any] = {}
        self.visible: str | None = None
        self.started = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        recorder = self

        class AsyncEngineArgs:
            def __init__(self, **kwargs: Any) -> None:
                self.kwargs = kwargs

        class AsyncLLM:
            @classmethod
            def from_engine_args(cls, args: AsyncEngineArgs) -> object:
                recorder.args = args.kwargs
                recorder.visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                recorder.started += 1
                return types.SimpleNamespace(shutdown=lambda timeout=None: None)

        for name in ("vllm", "vllm.engine", "vllm.v1", "vllm.v1.engine"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        arg_utils = types.ModuleType("vllm.engine.arg_utils")
        arg_utils.AsyncEngineArgs = AsyncEngineArgs  # type: ignore[attr-defined]
        async_llm = types.ModuleType("vllm.v1.engine.async_llm")
        async_llm.AsyncLLM = AsyncLLM  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
        monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", async_llm)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    r = _Recorder()
    r.install(monkeypatch)
    return r


@pytest.fixture(scope="module")
def qwen_half_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2.5-0.5B-shaped config.json (no weights: the stub engine loads nothing)."""
    directory = tmp_path_factory.mktemp("qwen05")
    Qwen2Config(**QWEN2_05B).save_pretrained(directory)
    return directory


def _cfg(model: Path, *sets: str) -> Config:
    return load_config(None, ["run.backend=local", "rollout.engine=vllm", f"model.path={model}", *sets])


def test_a_cuda_replica_gets_a_share_beside_the_trainer_its_gpu_and_cuda_graphs(
    monkeypatch: pytest.MonkeyPatch, recorder: _Recorder, qwen_half_b: Path
) -> None:
    pretend_cuda(monkeypatch, count=2, total_gib=24)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = _cfg(qwen_half_b, "rollout.device=cuda:1", "train.device=cuda:1", "model.dtype=auto")
    cuda1 = torch.device("cuda", 1)
    plan = gpu_preflight(cfg, cuda1, cuda1)
    assert plan is not None
    sampler = VllmSamplerFactory(cfg, 0, qwen_half_b, plan.utilization[0])()
    assert isinstance(sampler, VllmSampler) and recorder.started == 1
    args = recorder.args
    total = 24 * GiB
    others = sum(u.nbytes for u in plan.uses if u.device == 1)
    whats = {u.what for u in plan.uses if u.device == 1}
    assert {"trainer parameters", "gradients", "optimizer moments", "snapshot", "activations", "evaluation engine"} <= whats
    assert others > 10 * GiB  # a 0.5B trainer in fp32 master weights with AdamW: params, grads, moments, snapshot
    share = args["gpu_memory_utilization"]
    assert 0.05 < share < 0.92  # neither vLLM's default 0.92 nor nothing
    assert share * total + others <= total * (1 - GPU_HEADROOM) + 1
    assert recorder.visible == "1"  # the engine core sees cuda:1 only
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # and this process's is restored
    assert args["enforce_eager"] is False
    assert args["dtype"] == "bfloat16"  # "auto" resolved on a bf16-capable GPU
    assert args["enable_chunked_prefill"] is True and args["max_num_batched_tokens"] >= 8192
    assert sampler.settings.seed_requests is False  # rollout.vllm_seeding = "auto" on CUDA: the engine's stream
    assert sampler._seed("k", 3) is None


def test_an_inherited_cuda_visible_devices_is_mapped_through(
    monkeypatch: pytest.MonkeyPatch, recorder: _Recorder, qwen_half_b: Path
) -> None:
    pretend_cuda(monkeypatch, count=2, total_gib=80)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    cfg = _cfg(qwen_half_b, "rollout.device=cuda:1", "model.dtype=float32", "rollout.vllm_seeding=request")
    VllmSamplerFactory(cfg, 0, qwen_half_b)()
    assert recorder.visible == "6" and os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert recorder.args["dtype"] == "float32"  # asked for explicitly: honoured
    assert visible_devices(0, None) == "0" and visible_devices(1, "GPU-a, GPU-b") == "GPU-b"


def test_replicas_on_distinct_gpus_and_sharing_one(monkeypatch: pytest.MonkeyPatch, recorder: _Recorder, qwen_half_b: Path) -> None:
    pretend_cuda(monkeypatch, count=4, total_gib=80)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = _cfg(
        qwen_half_b,
        "rollout.num_samplers=3",
        "rollout.device=cuda",
        "rollout.replica_devices=['cuda:1','cuda:2','cuda:2']",
        "train.device=cuda:0",
    )
    plan = gpu_preflight(cfg, torch.device("cuda", 0), torch.device("cuda", 0))
    assert plan is not None
    assert plan.utilization[0] == pytest.approx(0.92)  # alone on cuda:1
    assert plan.utilization[1] == plan.utilization[2] < 0.5  # two on cuda:2 share it
    seen = []
    for i in range(3):
        VllmSamplerFactory(cfg, i, qwen_half_b, plan.utilization[i])()
        seen.append(recorder.visible)
    assert seen == ["1", "2", "2"]


def test_a_share_that_does_not_fit_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, qwen_half_b: Path) -> None:
    pretend_cuda(monkeypatch, count=1, total_gib=24)
    cfg = _cfg(qwen_half_b, "rollout.device=cuda:0", "train.device=cuda:0", "rollout.gpu_memory_utilization=0.8")
    with pytest.raises(ConfigError) as info:
        gpu_preflight(cfg, torch.device("cuda", 0), torch.device("cuda", 0))
    message = str(info.value)
    assert "\n" not in message and "cuda:0" in message and "rollout.gpu_memory_utilization" in message and "trainer parameters" in message


def test_on_the_cpu_the_engine_is_eager_and_seeds_each_request(monkeypatch: pytest.MonkeyPatch, recorder: _Recorder) -> None:
    from relayrl.models.loading import shipped_model_dir

    monkeypatch.setattr(torch.version, "cuda", None)  # (vLLM's CPU build runs on a CPU build of torch)

    cfg = load_config(None, ["run.backend=local", "rollout.engine=vllm"])
    settings = engine_settings(cfg, shipped_model_dir())
    assert settings.cuda_device is None and settings.seed_requests
    sampler = VllmSamplerFactory(cfg, 0, shipped_model_dir())()
    args = recorder.args
    assert args["enforce_eager"] is True and args["dtype"] == "float32" and "gpu_memory_utilization" not in args
    assert args["enable_chunked_prefill"] is False
    assert isinstance(sampler, VllmSampler) and sampler._seed("k", 3) is not None


def test_a_cuda_build_refuses_the_cpu_in_one_line(monkeypatch: pytest.MonkeyPatch, recorder: _Recorder, qwen_half_b: Path) -> None:
    pretend_cuda(monkeypatch, count=1)
    with pytest.raises(ConfigError) as info:
        engine_settings(_cfg(qwen_half_b), qwen_half_b)
    message = str(info.value)
    assert "\n" not in message and "rollout.device = 'cpu'" in message and "CUDA build" in message
    assert recorder.started == 0


def test_replica_devices_are_checked() -> None:
    with pytest.raises(ConfigError, match="rollout.replica_devices names 1 devices for rollout.num_samplers = 2"):
        load_config(None, ["run.backend=local", "rollout.engine=vllm", "rollout.num_samplers=2", "rollout.replica_devices=['cuda:0']"])
    with pytest.raises(ConfigError, match="rollout.engine = 'vllm' only"):
        load_config(None, ["run.backend=local", "rollout.replica_devices=['cuda:0']"])
    with pytest.raises(ConfigError, match="CUDA device"):
        load_config(None, ["run.backend=local", "rollout.engine=vllm", "rollout.replica_devices=['cpu']"])


def test_on_ray_a_cuda_build_refuses_cpu_replicas_on_the_driver(monkeypatch: pytest.MonkeyPatch, qwen_half_b: Path) -> None:
    from relayrl.backends.vllm.build import check_on_driver

    pretend_cuda(monkeypatch, count=1)
    with pytest.raises(ConfigError, match="rollout.device = 'cpu' with rollout.engine = 'vllm'"):
        check_on_driver(_cfg(qwen_half_b, "ray.enabled=true"))
    check_on_driver(_cfg(qwen_half_b, "ray.enabled=true", "rollout.device=cuda"))  # Ray gives the actor its GPU


def test_the_engine_gets_relayrls_weight_transfer_engine_where_the_collective_transport_reaches_it(
    monkeypatch: pytest.MonkeyPatch, recorder: _Recorder
) -> None:
    """The collective transport lands in the engine's worker in one process and in a Ray sampler
    actor alike (issue 31 §1): the engine is started with relayrl's weight-transfer engine
    whenever the run's transport is or resolves to it, and not for the file, the object store or
    "auto" in one process on the CPU."""
    from relayrl.models.loading import shipped_model_dir

    monkeypatch.setattr(torch.version, "cuda", None)

    def started_with_transfer(*sets: str) -> bool:
        cfg = load_config(None, ["run.backend=local", "rollout.engine=vllm", *sets])
        VllmSamplerFactory(cfg, 0, shipped_model_dir())()
        transfer = recorder.args.get("weight_transfer_config")
        assert transfer in (None, {"backend": "relayrl"}), transfer
        return transfer is not None and engine_settings(cfg, shipped_model_dir()).weight_transfer

    assert started_with_transfer("rollout.weight_transport=collective")
    assert started_with_transfer("ray.enabled=true", "rollout.weight_transport=collective")
    assert not started_with_transfer("ray.enabled=true", "rollout.weight_transport=object_store")
    assert started_with_transfer("ray.enabled=true")  # "auto" with vLLM on Ray: the collective, received in the engine
    assert not started_with_transfer("ray.enabled=true", "train.world_size=2")  # "auto" keeps the object store there
    assert not started_with_transfer("rollout.weight_transport=file")
    assert not started_with_transfer()  # "auto" on the CPU in one process: the file
