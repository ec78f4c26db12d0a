"""Device placement (train.device, rollout.device, model.dtype): the config's checks, the
resolution against what a machine has (mocked `Accelerators`: this machine has no GPU, and no
test pretends a GPU computed), the GPUs a Ray actor asks for, and the trainer moving a
micro-batch to its device (torch's "meta" device stands for another device)."""

from __future__ import annotations

import threading
from dataclasses import is_dataclass

import pytest
import torch

from relayrl.backends.local import trainer as trainer_module
from relayrl.backends.local.devices import Accelerators, DeviceError, resolve_device, resolve_dtype
from relayrl.backends.ray.build import with_gpu
from relayrl.config.schema import Config, ConfigError, load_config

NO_GPU = Accelerators(cuda_available=False, device_count=0, bf16=False, cuda_build=None)
TWO_GPUS = Accelerators(cuda_available=True, device_count=2, bf16=True, cuda_build="12.8")
OLD_GPU = Accelerators(cuda_available=True, device_count=1, bf16=False, cuda_build="12.8")


def test_device_keys_default_to_the_cpu_and_float32() -> None:
    cfg = Config()
    assert (cfg.train.device, cfg.rollout.device, cfg.model.dtype) == ("cpu", "cpu", "float32")


@pytest.mark.parametrize("spec", ["cpu", "cuda", "cuda:0", "cuda:12", "auto", " CUDA:1 "])
def test_device_specs_accepted(spec: str) -> None:
    cfg = load_config(None, [f"train.device={spec}", f"rollout.device={spec}"])
    assert cfg.train.device == cfg.rollout.device == spec.strip().lower()


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cuda:x", "mps", "", "cuda 0"])
def test_bad_device_specs_refused_naming_the_key(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"rollout.device='{spec}'"])
    message = str(err.value)
    assert "rollout.device" in message and "'cpu', 'cuda', 'cuda:N'" in message and "\n" not in message


def test_model_dtype_auto_accepted() -> None:
    assert load_config(None, ["model.dtype=auto"]).model.dtype == "auto"


def test_cpu_and_auto_resolve_to_the_cpu_without_cuda() -> None:
    assert resolve_device("cpu", "train.device", NO_GPU) == torch.device("cpu")
    assert resolve_device("auto", "train.device", NO_GPU) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_auto_resolves_to_the_cpu_on_this_machine() -> None:
    """The real probe: no GPU here, so "auto" is the CPU and model.dtype "auto" float32."""
    device = resolve_device("auto", "rollout.device")
    assert device == torch.device("cpu")
    assert resolve_dtype("auto", [device, device]) == torch.float32


def test_cuda_resolves_when_the_machine_has_it() -> None:
    assert resolve_device("cuda", "train.device", TWO_GPUS) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", "train.device", TWO_GPUS) == torch.device("cuda", 1)
    assert resolve_device("auto", "train.device", TWO_GPUS) == torch.device("cuda", 0)


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_refused_in_one_line(spec: str) -> None:
    with pytest.raises(DeviceError) as err:
        resolve_device(spec, "train.device", NO_GPU)
    assert str(err.value) == (
        f"train.device = {spec!r}: this machine has no CUDA device (torch.cuda.is_available() is False; "
        f"torch {torch.__version__} is a CPU build); use train.device=cpu"
    )
    assert isinstance(err.value, ConfigError)  # exit 2


def test_a_cuda_index_out_of_range_is_refused_naming_what_the_machine_has() -> None:
    with pytest.raises(DeviceError, match=r"^rollout.device = 'cuda:2': this machine has 2 CUDA devices \(cuda:0..cuda:1\)$"):
        resolve_device("cuda:2", "rollout.device", TWO_GPUS)


def test_in_a_ray_actor_cuda_is_the_gpu_ray_gave_it() -> None:
    """Ray remaps the actor's GPU to cuda:0 (CUDA_VISIBLE_DEVICES): cuda:N is read as cuda, auto is
    CUDA only when Ray gave the actor a GPU, and cuda without one is refused naming the key."""
    one = Accelerators(cuda_available=True, device_count=1, bf16=True)
    assert resolve_device("cuda:3", "train.device", one, ray_gpus=1) == torch.device("cuda", 0)
    assert resolve_device("auto", "train.device", one, ray_gpus=1) == torch.device("cuda", 0)
    assert resolve_device("auto", "train.device", one, ray_gpus=0) == torch.device("cpu")
    assert resolve_device("cpu", "train.device", one, ray_gpus=1) == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"^train.device = 'cuda': the Ray actor was given no GPU"):
        resolve_device("cuda", "train.device", one, ray_gpus=0)
    with pytest.raises(DeviceError, match="no CUDA device"):  # Ray gave a GPU, but torch is a CPU build
        resolve_device("cuda", "train.device", NO_GPU, ray_gpus=1)


def test_dtype_auto_is_bfloat16_only_when_every_device_is_a_bf16_gpu() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dtype("auto", [cpu, cpu], NO_GPU) == torch.float32
    assert resolve_dtype("auto", [gpu, gpu], TWO_GPUS) == torch.bfloat16
    assert resolve_dtype("auto", [gpu, cpu], TWO_GPUS) == torch.float32
    assert resolve_dtype("auto", [gpu], OLD_GPU) == torch.float32
    assert resolve_dtype("float32", [gpu], TWO_GPUS) == torch.float32
    assert resolve_dtype("bfloat16", [cpu], NO_GPU) == torch.bfloat16


def test_a_cuda_actor_asks_ray_for_one_gpu_unless_its_resources_name_gpu() -> None:
    assert with_gpu({}, "cpu", 8.0) == {}
    assert with_gpu({"CPU": 1.0}, "cuda", 0.0) == {"CPU": 1.0, "GPU": 1.0}
    assert with_gpu({}, "cuda:3", 8.0) == {"GPU": 1.0}
    assert with_gpu({"GPU": 0.5}, "cuda", 8.0) == {"GPU": 0.5}  # the user's table wins
    assert with_gpu({}, "auto", 1.0) == {"GPU": 1.0}
    assert with_gpu({}, "auto", 0.0) == {}


def test_the_trainer_moves_its_model_and_each_micro_batch_to_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer on another device ("meta" stands for a GPU here) holds its model there before
    the optimizer is made, and `train_step` hands the loss a micro-batch moved there, whole."""
    from relayrl.algorithms.losses import LossConfig
    from relayrl.backends.local.collate import TorchCollator
    from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
    from relayrl.types import TrainBatch
    from support.trajectories import make_microbatch, trajectory

    model, tokenizer = load_model_and_tokenizer(shipped_model_dir())
    settings = TrainerSettings(learning_rate=1e-3, total_steps=1, loss=LossConfig())
    compute = TrainerCompute(model, settings, device="meta")
    assert compute.device.type == "meta"
    assert all(p.device.type == "meta" for p in compute.model.parameters())
    assert all(p.device.type == "meta" for group in compute._optimizer.param_groups for p in group["params"])

    traj = trajectory(prompt_tokens=[5, 6, 7], completion_tokens=[8, 9], advantage=1.0)
    batch = TorchCollator(pad_token_id=tokenizer.pad_token_id or 0).collate(make_microbatch([traj], [[0]]))
    assert batch.input_ids.device.type == "cpu"
    seen: list[set[str]] = []

    class Reached(Exception):
        pass

    def spy(model: object, packed: object, temperature: float, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append({t.device.type for t in _tensors(packed)})
        raise Reached

    monkeypatch.setattr(trainer_module, "token_logprobs", spy)
    tb = TrainBatch(
        step=0, index=0, payload=batch, num_tokens=5, num_sequences=1, advantages=[1.0], step_completion_tokens=2, step_sequences=1
    )
    with pytest.raises(Reached):
        compute.train_step(tb, threading.Event())
    assert seen == [{"meta"}]


def _tensors(packed: object) -> list[torch.Tensor]:
    from dataclasses import fields

    assert is_dataclass(packed) and not isinstance(packed, type)
    return [v for f in fields(packed) if isinstance(v := getattr(packed, f.name), torch.Tensor)]
