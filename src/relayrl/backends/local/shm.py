"""Shared memory (`/dev/shm`) for the sharded trainer's local ranks: what must go through it, and
what to do when it is small (Docker's and Kubernetes' default is 64 MiB).

torch.multiprocessing moves every tensor sent over a rank's pipe through shared memory. Since
ranks load the model themselves (`RankModel`, from the model's source: `model.path` / package /
the shipped model), what still goes through it is each micro-batch the host sends a rank and,
once per version, the full weights rank 0 sends the host. `plan_shm` reads the space
(`shutil.disk_usage("/dev/shm")`) before any rank starts and decides:
- room for two versions' weights and two micro-batches per rank: everything through /dev/shm;
- room for the micro-batches only: each version's weights go through a disk directory instead
  (rank 0 saves them there, the host maps the file and removes it: `spill` / `unspill`), and on
  CUDA NCCL is told not to use /dev/shm for its own transport (NCCL_SHM_DISABLE=1);
- not even that: `SharedMemoryError` (a ConfigError, exit 2) naming the space found and needed and
  how to give a container more (`docker run --shm-size=...` or `--ipc=host`; Kubernetes: an
  emptyDir volume with medium Memory mounted on /dev/shm).
A machine without /dev/shm (not Linux) is not judged: torch uses what the platform has.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.config.schema import ConfigError
from relayrl.types import Weights

__all__ = ["SHM", "SharedMemoryError", "ShmPlan", "Spilled", "plan_shm", "spill", "unspill"]

SHM = Path("/dev/shm")
MiB = 2**20


class SharedMemoryError(ConfigError):
    """/dev/shm cannot hold what the sharded trainer's ranks must pass through it."""


@dataclass(frozen=True, slots=True)
class ShmPlan:
    """How the ranks use shared memory (see the module)."""

    free_bytes: int | None  # what /dev/shm had free (None: not judged)
    spill_dir: str | None  # each version's weights through this disk directory (None: through /dev/shm)

    @property
    def env(self) -> dict[str, str]:
        """Environment for the rank processes (NCCL off /dev/shm when it is short)."""
        return {"NCCL_SHM_DISABLE": "1"} if self.spill_dir is not None else {}


def _mib(n: float) -> str:
    return f"{n / MiB:.0f} MiB"


def plan_shm(weights_bytes: int, microbatch_bytes: int, world_size: int, *, handed_bytes: int = 0, path: Path = SHM) -> ShmPlan:
    """The plan for `world_size` ranks whose versions' weights are `weights_bytes`, a micro-batch
    about `microbatch_bytes`, and `handed_bytes` of model handed to each rank through the pipe
    (0 when they load it themselves)."""
    try:
        free = int(shutil.disk_usage(path).free)
    except OSError:
        return ShmPlan(None, None)
    must = 2 * microbatch_bytes * world_size + handed_bytes
    if free < must:
        raise SharedMemoryError(
            f"/dev/shm has {_mib(free)} free, the sharded trainer's {world_size} ranks need {_mib(must)} there "
            f"(micro-batches{' and the model handed to each rank' if handed_bytes else ''}): give the container more shared "
            "memory (docker run --shm-size=8g, or --ipc=host; Kubernetes: an emptyDir of medium Memory on /dev/shm), "
            "or lower train.world_size / train.row_tokens"
        )
    if free < must + 2 * weights_bytes:
        return ShmPlan(free, tempfile.mkdtemp(prefix="relayrl-weights-"))
    return ShmPlan(free, None)


@dataclass(frozen=True, slots=True)
class Spilled:
    """A version's weights saved to `path` instead of sent through shared memory."""

    path: str


def spill(weights: Weights | None, directory: str | None) -> Weights | Spilled | None:
    """`weights` saved into `directory` (a `Spilled` to send instead), or as they are without one."""
    if weights is None or directory is None:
        return weights
    path = os.path.join(directory, f"v{weights.version}-{os.getpid()}.pt")
    tmp = path + ".tmp"
    torch.save({"version": weights.version, "payload": weights.payload}, tmp)
    os.replace(tmp, path)
    return Spilled(path)


def unspill(value: Any) -> Any:
    """A rank's reply with a `Spilled` in it (at the top, or an item of a tuple) read back: the
    file mapped (not copied) and removed."""
    if isinstance(value, Spilled):
        saved = torch.load(value.path, map_location="cpu", weights_only=True, mmap=True)
        os.unlink(value.path)  # (the mapping stays valid)
        return Weights(version=int(saved["version"]), payload=saved["payload"])
    if isinstance(value, tuple) and any(isinstance(v, Spilled) for v in value):
        return tuple(unspill(v) for v in value)
    return value


def remove_dir(directory: str | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
