"""GPU memory in telemetry: a worker's peak allocated CUDA memory per step.

`step_peak_gb(device)` is the peak of `torch.cuda.max_memory_allocated` on `device` since the
previous call (or since the process started using it), in GiB, and resets the peak for the next
step; None where the device is not CUDA (the CPU has no such counter: the metric is then absent).
The trainer reports it as `train/gpu_mem_peak_gb` (the sharded trainer: the largest rank's, and
each rank's as `train/gpu_mem_peak_gb_rank<r>`), and `relayrl report` shows its maximum.
"""

from __future__ import annotations

import torch

__all__ = ["step_peak_gb"]


def step_peak_gb(device: torch.device) -> float | None:
    """Peak allocated GiB on CUDA `device` since the last call, the peak then reset; None off CUDA."""
    if device.type != "cuda":
        return None
    peak = float(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    return peak / 2**30
