"""Where the sharded trainer's ranks compute, and which placements of a local run are refused
before anything loads.

Job: map rank r of `train.world_size` = N ranks to its device (`rank_devices`): on CUDA rank r
computes on cuda:(base + r), base being train.device's index ("cuda" = cuda:0), so
train.device = "cuda:4" with N = 2 puts the ranks on cuda:4 and cuda:5; on the CPU every rank
computes on the CPU. And refuse, in one line naming the keys (`DeviceError`, exit 2), a placement
that cannot work or would silently share a device (`check_placement`):
- a rank's device index beyond what the machine has;
- rollout.device (the samplers and the held-out engine) on a device a rank computes on;
- more CPU ranks than CPU cores this process may use (N processes each training a copy of the
  model on fewer cores make no progress worth having: 64 ranks on 2 cores printed nothing for
  minutes);
unless `train.allow_shared_devices` is set. One trainer (N = 1) and the samplers may share a
device: that is the single-GPU recipe, not refused.

On Ray the ranks are actors in a placement group and each computes on the GPU Ray gave it
(`relayrl.backends.local.devices`), so none of this applies there; Ray's resource accounting
refuses what the cluster cannot hold (`relayrl.backends.ray.build`).
"""

from __future__ import annotations

import os

import torch

from relayrl.backends.local.devices import Accelerators, DeviceError
from relayrl.config.schema import Config

__all__ = ["cpu_cores", "check_placement", "rank_devices"]

SHARED = "train.allow_shared_devices"


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def _name(device: torch.device) -> str:
    return f"cuda:{device.index or 0}" if device.type == "cuda" else device.type


def _span(devices: list[torch.device]) -> str:
    names = [_name(d) for d in devices]
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def rank_devices(base: torch.device, world_size: int, accel: Accelerators | None = None) -> list[torch.device]:
    """The device of each of `world_size` ranks, rank 0 first: cuda:(base + r) on CUDA (checked
    against `accel`, default: probed), `base` for every rank otherwise."""
    if base.type != "cuda":
        return [base] * world_size
    start = base.index or 0
    last = start + world_size - 1
    accel = accel if accel is not None else Accelerators.probe()
    if last >= accel.device_count:
        raise DeviceError(
            f"train.world_size = {world_size} from train.device = 'cuda:{start}' puts rank {world_size - 1} on cuda:{last}: "
            f"{accel.describe()} (rank r computes on cuda:{start}+r); lower train.world_size or the device index"
        )
    return [torch.device("cuda", start + r) for r in range(world_size)]


def check_placement(
    cfg: Config, train_device: torch.device, rollout_device: torch.device, accel: Accelerators | None = None, cores: int | None = None
) -> None:
    """Refuse (DeviceError) a local run's placement that cannot work or shares a device (see the
    module); `train_device` / `rollout_device` are train.device / rollout.device resolved."""
    n = cfg.train.world_size
    if n <= 1:
        return
    ranks = rank_devices(train_device, n, accel)  # (an index beyond the machine's: always refused)
    if cfg.train.allow_shared_devices:
        return
    if train_device.type == "cuda":
        if rollout_device.type == "cuda" and (rollout_device.index or 0) in {d.index for d in ranks}:
            raise DeviceError(
                f"rollout.device = {cfg.rollout.device!r} is a device of the sharded trainer's ranks (train.device = "
                f"{cfg.train.device!r}, train.world_size = {n}: {_span(ranks)}): put the samplers on another device, "
                f"or set {SHARED} = true to share it"
            )
        return
    cores = cores if cores is not None else cpu_cores()
    if n > cores:
        raise DeviceError(
            f"train.world_size = {n} CPU ranks on {cores} CPU core{'s' if cores != 1 else ''}: at most one rank per core "
            f"(lower train.world_size, or set {SHARED} = true to oversubscribe)"
        )
