"""`run.deterministic`: the local backend's compute made deterministic where torch can make it so.

What is exact where (docs/design.md, "Determinism"): on the CPU, two runs of one config and a
killed run resumed with `--resume` compute bit-identical steps (the exact-resume and bitwise tests
are CPU facts). On CUDA, without this flag, some kernels accumulate with atomics
(`index_select` / `scatter_add_` backward, attention backward, cuBLAS split-K reductions), so two
runs agree only within rounding; with it, `torch.use_deterministic_algorithms(True)`,
`CUBLAS_WORKSPACE_CONFIG=:4096:8` (set before the first CUDA call, as cuBLAS reads it when it
starts), cuDNN deterministic without autotuning, and attention on the math kernel (the flash,
memory-efficient and cuDNN kernels' backward passes are not deterministic) make a run repeat
itself on one machine and software stack, slower; an operation with no deterministic kernel then
raises naming itself. Tests comparing runs on CUDA use tolerances either way.

Invariant: `make_deterministic` runs in every process that computes (the driver before it
resolves a device, each rank and each Ray actor before its model loads), before that process's
first CUDA call.
"""

from __future__ import annotations

import os

import torch

__all__ = ["CUBLAS_WORKSPACE", "make_deterministic"]

#: The cuBLAS workspace setting that makes its reductions deterministic (CUDA's documentation).
CUBLAS_WORKSPACE = ":4096:8"


def make_deterministic() -> None:
    """Deterministic algorithms for this process and the processes it starts (see the module)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE  # (inherited by spawned ranks)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)
