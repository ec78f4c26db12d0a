"""Where the local backend's workers compute: `train.device` / `rollout.device` and `model.dtype`
resolved to a torch device and dtype in the process that computes.

Job: turn a device spec ("cpu", "cuda", "cuda:N", "auto"; checked by the config schema) into a
`torch.device` this process can use, and `model.dtype` ("float32", "bfloat16", "bfloat16-pure",
"auto") into a `Precision` (`relayrl.backends.local.precision`), from what this process sees
(`Accelerators.probe()`: torch.cuda.is_available(), device_count(), is_bf16_supported()).

Invariants:
- a spec this machine cannot satisfy ("cuda" without CUDA, "cuda:N" with N out of range) raises
  `DeviceError` (a ConfigError: exit 2) in one line naming the key, the spec and what the machine
  has; nothing is ever silently moved to another device than the one asked for;
- "cuda" and "auto" mean cuda:0, the first device CUDA_VISIBLE_DEVICES leaves visible; "auto" is
  CUDA when this process sees one, else the CPU; so the defaults ("cpu", float32) compute exactly as before;
- in a Ray actor (`in_ray_actor`) CUDA means the GPU Ray gave the actor, which
  CUDA_VISIBLE_DEVICES remaps to cuda:0: "cuda:N" is read as "cuda", and "auto" is CUDA only when
  Ray gave the actor a GPU;
- `model.dtype = "auto"` is "bfloat16" (bfloat16 compute, float32 master weights) only when every
  device given is CUDA and supports it, else "float32": the CPU keeps float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from relayrl.backends.local.precision import Precision, resolve_precision
from relayrl.config.schema import ConfigError, is_cuda_spec

__all__ = ["Accelerators", "DeviceError", "resolve_device", "resolve_dtype", "resolve_model_precision"]


class DeviceError(ConfigError):
    """A device key (train.device, rollout.device) names a device this machine does not have."""


@dataclass(frozen=True, slots=True)
class Accelerators:
    """What CUDA this process sees."""

    cuda_available: bool
    device_count: int
    bf16: bool  # the current CUDA device supports bfloat16
    cuda_build: str | None = None  # torch.version.cuda: None for a CPU build of torch

    @classmethod
    def probe(cls) -> Accelerators:
        """This process's view (torch.cuda.is_available(), device_count(), is_bf16_supported())."""
        available = bool(torch.cuda.is_available())
        count = int(torch.cuda.device_count()) if available else 0
        bf16 = bool(available and torch.cuda.is_bf16_supported())
        return cls(available, count, bf16, torch.version.cuda)

    def describe(self) -> str:
        """What this machine has, for an error line."""
        if not self.cuda_available:
            build = f"torch {torch.__version__}" + (" is a CPU build" if self.cuda_build is None else f" built for CUDA {self.cuda_build}")
            return f"this machine has no CUDA device (torch.cuda.is_available() is False; {build})"
        n = self.device_count
        return f"this machine has {n} CUDA device{'s' if n != 1 else ''} (cuda:0{f'..cuda:{n - 1}' if n > 1 else ''})"


def in_ray_actor() -> bool:
    """Whether this process is a Ray worker running an actor (Ray already imported there)."""
    import sys

    if "ray" not in sys.modules:
        return False
    import ray

    try:
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # no worker context
        return False


def _ray_gpus() -> int:
    import ray

    return len(ray.get_gpu_ids())


def resolve_device(spec: str, key: str, accel: Accelerators | None = None, *, ray_gpus: int | None = None) -> torch.device:
    """The device `spec` names, as this process sees it (`accel`, default: probed). `key` names
    the config key in errors. `ray_gpus`: in a Ray actor, how many GPUs Ray gave it (None: not in
    an actor; see the module)."""
    accel = accel if accel is not None else Accelerators.probe()
    if spec == "cpu":
        return torch.device("cpu")
    if ray_gpus is not None:
        if spec == "auto":
            spec = "cuda" if ray_gpus and accel.cuda_available else "cpu"
            return torch.device("cuda:0" if spec == "cuda" else "cpu")
        if not ray_gpus:
            raise DeviceError(f"{key} = {spec!r}: the Ray actor was given no GPU (its ray.*_resources name GPU = 0)")
        spec = "cuda"
    if spec == "auto":
        return torch.device("cuda", 0) if accel.cuda_available and accel.device_count else torch.device("cpu")
    if not is_cuda_spec(spec):
        raise DeviceError(f"{key} = {spec!r}: not a device (use 'cpu', 'cuda', 'cuda:N' or 'auto')")
    if not accel.cuda_available or accel.device_count == 0:
        raise DeviceError(f"{key} = {spec!r}: {accel.describe()}; use {key}=cpu")
    if spec == "cuda":
        return torch.device("cuda", 0)
    index = int(spec.partition(":")[2])
    if index >= accel.device_count:
        raise DeviceError(f"{key} = {spec!r}: {accel.describe()}")
    return torch.device("cuda", index)


def resolve_dtype(name: str, devices: Sequence[torch.device], accel: Accelerators | None = None) -> torch.dtype:
    """`model.dtype`'s compute dtype for a process computing on `devices` (what a sampler's
    weights are): "auto" is bfloat16 when they are all CUDA and it supports bfloat16 (`accel`,
    default: probed), else float32; see `relayrl.backends.local.precision` for the master dtype."""
    return resolve_model_precision(name, devices, accel).compute


def resolve_model_precision(name: str, devices: Sequence[torch.device], accel: Accelerators | None = None) -> Precision:
    """`model.dtype` resolved for a process computing on `devices` (`resolve_precision` with what
    `accel`, default: probed, says of bfloat16)."""
    if name == "auto" and devices and all(d.type == "cuda" for d in devices):
        accel = accel if accel is not None else Accelerators.probe()
        return resolve_precision(name, devices, accel.bf16)
    return resolve_precision(name, devices, False)


def process_device(spec: str, key: str, *, ray: bool) -> torch.device:
    """`resolve_device` in this process: with `ray` (ray.enabled, called in a worker's actor) the
    GPUs Ray gave the actor decide (the driver of a Ray run computes on the CPU: see
    `relayrl.backends.local.build`)."""
    return resolve_device(spec, key, ray_gpus=_ray_gpus() if ray and in_ray_actor() else None)
