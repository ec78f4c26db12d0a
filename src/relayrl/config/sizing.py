"""Sizes a run can hold: an up-front estimate of the host memory its trajectories need.

A run keeps at most (max_staleness + 2) steps' worth of trajectories in memory: the steps the
dispatch window lets run ahead, the step being trained and the step being logged. Each costs about
BYTES_PER_TRAJECTORY plus BYTES_PER_TOKEN for every token it may hold (measured on the sim
backend: ~0.8 KB for a 20-token trajectory; token ids, log-probs and packed copies cost ~64 B per
token). A token bound is known before anything is loaded: a trajectory must fit one packed row.

Invariant: a configuration whose estimate exceeds the memory budget is refused before the run
starts, with the keys that size it and the estimate named; it never starts and runs the machine
out of memory (or blocks its event loop for minutes creating objects).
"""

from __future__ import annotations

import os

from relayrl.config.schema import Config, ConfigError

BYTES_PER_TRAJECTORY = 1024
BYTES_PER_TOKEN = 64
GB = 1024**3


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def trajectory_tokens(cfg: Config) -> int:
    """An upper bound on one trajectory's tokens."""
    if cfg.run.backend == "sim":
        return cfg.sim.prompt_tokens + cfg.rollout.max_new_tokens
    return cfg.train.row_tokens


def trajectories_held(cfg: Config) -> int:
    r = cfg.rollout
    return (r.max_staleness + 2) * r.groups_per_step * r.num_generations


def estimate_host_bytes(cfg: Config) -> int:
    return trajectories_held(cfg) * (BYTES_PER_TRAJECTORY + BYTES_PER_TOKEN * trajectory_tokens(cfg))


def check_fits(cfg: Config) -> None:
    """Raise a ConfigError when the run's trajectories cannot fit the memory budget
    (orchestrator.max_host_memory_gb, or half of this machine's memory when it is 0)."""
    if cfg.orchestrator.max_host_memory_gb > 0:
        budget, what = int(cfg.orchestrator.max_host_memory_gb * GB), "orchestrator.max_host_memory_gb"
    else:
        total = physical_memory_bytes()
        if total is None:
            return
        budget, what = total // 2, f"half of this machine's {total / GB:.1f} GB"
    need = estimate_host_bytes(cfg)
    if need <= budget:
        return
    r = cfg.rollout
    raise ConfigError(
        f"rollout.num_generations={r.num_generations} × rollout.groups_per_step={r.groups_per_step} × "
        f"(rollout.max_staleness={r.max_staleness} + 2) = {trajectories_held(cfg):,} trajectories held at once, "
        f"up to {trajectory_tokens(cfg)} tokens each: an estimated {need / GB:,.1f} GB of host memory, more than "
        f"{what} ({budget / GB:,.1f} GB); lower rollout.num_generations or rollout.groups_per_step "
        "(or raise orchestrator.max_host_memory_gb)"
    )
