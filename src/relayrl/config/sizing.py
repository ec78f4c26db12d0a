"""Sizes a run can hold: up-front bounds on what a run creates before it can be stopped.

- Trajectories: see below.
- Reward workers (`task.reward_workers`): at most MAX_REWARD_WORKERS_PER_CPU per CPU this process
  may use (at least MIN_REWARD_WORKERS_CAP), and BYTES_PER_REWARD_WORKER each (a worker's resident
  memory after importing its functions, measured ~16-21 MB) within the memory budget. A worker
  runs one call at a time, so workers beyond the CPUs only help rewards that wait; those are
  better written async (`task.reward_concurrency`).
- The reasoning-gym training set (`task.dataset_size`, generated up front): at most
  MAX_DATASET_SIZE entries (~40 µs each to generate here: ~40 s at the cap, and more entries than
  any run draws), and BYTES_PER_DATASET_ENTRY each (chain_sum measured ~1.5-2.4 KB) within the
  memory budget.
- LoRA adapters (`train.lora`, checked once the model is loaded: `check_lora`): the rank is at most
  the narrowest targeted layer's width (min of its input and output features: a higher rank adds
  parameters and no expressiveness; r=100000 on the tiny model was OOM-killed with no message),
  and the adapter matrices, r × (in + out) per targeted layer, at LORA_BYTES_PER_PARAM each in the
  trainer (fp32 weight, gradient and AdamW's two moments) plus LORA_SAMPLER_BYTES_PER_PARAM per
  sampler replica (its fp32 copy), within the memory budget.

A run keeps at most (max_staleness + 2) steps' worth of trajectories in memory: the steps the
dispatch window lets run ahead, the step being trained and the step being logged. Each costs about
BYTES_PER_TRAJECTORY plus BYTES_PER_TOKEN for every token it may hold (measured on the sim
backend: ~0.8 KB for a 20-token trajectory; token ids, log-probs and packed copies cost ~64 B per
token). A token bound is known before anything is loaded: a trajectory must fit one packed row.

Invariant: a configuration whose estimate exceeds the memory budget (each estimate on its own),
or a size beyond its cap, is refused before the run starts, in one line naming the keys that size
it, the value, the bound and why; it never starts and runs the machine out of memory (or blocks
its event loop for minutes creating objects, or spawns processes for minutes).
"""

from __future__ import annotations

import os

from relayrl.config.schema import Config, ConfigError

BYTES_PER_TRAJECTORY = 1024
BYTES_PER_TOKEN = 64
GB = 1024**3
MB = 1024**2
BYTES_PER_REWARD_WORKER = 25 * MB
MAX_REWARD_WORKERS_PER_CPU = 4
MIN_REWARD_WORKERS_CAP = 8
BYTES_PER_DATASET_ENTRY = 4 * 1024
MAX_DATASET_SIZE = 1_000_000
SECONDS_PER_DATASET_ENTRY = 40e-6  # chain_sum, one core of this machine
LORA_BYTES_PER_PARAM = 16  # the trainer's fp32 adapter weight, its gradient, AdamW's exp_avg and exp_avg_sq
LORA_SAMPLER_BYTES_PER_PARAM = 4  # each sampler replica's fp32 copy of the adapters


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_reward_workers(cpus: int) -> int:
    return max(MIN_REWARD_WORKERS_CAP, MAX_REWARD_WORKERS_PER_CPU * cpus)


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


def memory_budget(cfg: Config) -> tuple[int, str] | None:
    """The host memory budget and how to name it: orchestrator.max_host_memory_gb, or half of this
    machine's memory when it is 0 (None when that is unknown)."""
    if cfg.orchestrator.max_host_memory_gb > 0:
        return int(cfg.orchestrator.max_host_memory_gb * GB), "orchestrator.max_host_memory_gb"
    total = physical_memory_bytes()
    if total is None:
        return None
    return total // 2, f"half of this machine's {total / GB:.1f} GB"


def check_fits(cfg: Config) -> None:
    """Raise a ConfigError when the run's trajectories, its reward workers or its generated
    training set cannot fit the memory budget (orchestrator.max_host_memory_gb, or half of this
    machine's memory when it is 0), or a size is beyond its cap (module docstring)."""
    budget = memory_budget(cfg)
    check_trajectories(cfg, budget)
    check_reward_workers(cfg, budget)
    check_dataset_size(cfg, budget)


def check_trajectories(cfg: Config, budget: tuple[int, str] | None) -> None:
    if budget is None:
        return
    budget_bytes, what = budget
    need = estimate_host_bytes(cfg)
    if need <= budget_bytes:
        return
    r = cfg.rollout
    raise ConfigError(
        f"rollout.num_generations={r.num_generations} × rollout.groups_per_step={r.groups_per_step} × "
        f"(rollout.max_staleness={r.max_staleness} + 2) = {trajectories_held(cfg):,} trajectories held at once, "
        f"up to {trajectory_tokens(cfg)} tokens each: an estimated {need / GB:,.1f} GB of host memory, more than "
        f"{what} ({budget_bytes / GB:,.1f} GB); lower rollout.num_generations or rollout.groups_per_step "
        "(or raise orchestrator.max_host_memory_gb)"
    )


def check_reward_workers(cfg: Config, budget: tuple[int, str] | None, cpus: int | None = None) -> None:
    """task.reward_workers: at most `max_reward_workers(cpus)`, and their memory within the budget."""
    n = cfg.task.reward_workers
    cpus = usable_cpus() if cpus is None else cpus
    cap = max_reward_workers(cpus)
    if n > cap:
        raise ConfigError(
            f"task.reward_workers={n:,} is more than {cap} (max({MIN_REWARD_WORKERS_CAP}, {MAX_REWARD_WORKERS_PER_CPU} per CPU × "
            f"{cpus} CPUs)): each worker is a process (~{BYTES_PER_REWARD_WORKER // MB} MB, started at the first reward call) "
            "running one call at a time, so more than the CPUs only helps rewards that wait; lower task.reward_workers "
            "(a reward that waits on the network is better async, bounded by task.reward_concurrency)"
        )
    if budget is None:
        return
    budget_bytes, what = budget
    need = n * BYTES_PER_REWARD_WORKER
    if need > budget_bytes:
        raise ConfigError(
            f"task.reward_workers={n:,} worker processes need an estimated {need / GB:,.1f} GB of host memory "
            f"(~{BYTES_PER_REWARD_WORKER // MB} MB each), more than {what} ({budget_bytes / GB:,.1f} GB); "
            "lower task.reward_workers (or raise orchestrator.max_host_memory_gb)"
        )


def check_dataset_size(cfg: Config, budget: tuple[int, str] | None) -> None:
    """task.dataset_size (reasoning_gym, generated up front): at most MAX_DATASET_SIZE entries, and
    their memory within the budget."""
    t = cfg.task
    if t.kind != "reasoning_gym":
        return
    n = t.dataset_size
    if n > MAX_DATASET_SIZE:
        raise ConfigError(
            f"task.dataset_size={n:,} is more than {MAX_DATASET_SIZE:,}: the training set is generated up front, before the "
            f"run starts (~{MAX_DATASET_SIZE * SECONDS_PER_DATASET_ENTRY:.0f} s at the bound), and cycled every epoch; a run draws "
            "run.steps × rollout.groups_per_step prompts, so lower task.dataset_size"
        )
    if budget is None:
        return
    budget_bytes, what = budget
    need = n * BYTES_PER_DATASET_ENTRY
    if need > budget_bytes:
        raise ConfigError(
            f"task.dataset_size={n:,} entries need an estimated {need / GB:,.1f} GB of host memory "
            f"(~{BYTES_PER_DATASET_ENTRY // 1024} KB each), more than {what} ({budget_bytes / GB:,.1f} GB); "
            "lower task.dataset_size (or raise orchestrator.max_host_memory_gb)"
        )


def lora_shapes(model: object, targets: list[str]) -> list[tuple[str, int, int]]:
    """(module name, in features, out features) of every linear layer of `model` (a torch module)
    whose last name part is in `targets`."""
    named = getattr(model, "named_modules", None)
    if named is None:
        return []
    out = []
    for name, module in named():
        fin, fout = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if isinstance(fin, int) and isinstance(fout, int) and name.rpartition(".")[2] in targets:
            out.append((name, fin, fout))
    return out


def check_lora(cfg: Config, model: object, budget: tuple[int, str] | None = None) -> None:
    """train.lora on `model` (the loaded base model): the rank within the narrowest targeted
    layer's width, and the adapters' memory within the host budget (module docstring)."""
    lora = cfg.train.lora
    if lora is None:
        return
    shapes = lora_shapes(model, list(lora.target_modules))
    if not shapes:
        return  # no targeted layer: check_targets says so
    name, fin, fout = min(shapes, key=lambda s: min(s[1], s[2]))
    width = min(fin, fout)
    if lora.r > width:
        raise ConfigError(
            f"invalid config key 'train.lora.r': {lora.r:,} is more than {width}, the width of the narrowest targeted layer "
            f"({name}: {fin} in, {fout} out): a rank above a layer's width adds parameters and no expressiveness; "
            f"lower train.lora.r to at most {width}"
        )
    budget = memory_budget(cfg) if budget is None else budget
    if budget is None:
        return
    budget_bytes, what = budget
    params = sum(lora.r * (i + o) for _, i, o in shapes)
    per_param = LORA_BYTES_PER_PARAM + LORA_SAMPLER_BYTES_PER_PARAM * cfg.rollout.num_samplers
    need = params * per_param
    if need > budget_bytes:
        raise ConfigError(
            f"train.lora.r={lora.r:,} on {len(shapes)} layers is {params:,} adapter parameters: an estimated "
            f"{need / GB:,.1f} GB of host memory ({LORA_BYTES_PER_PARAM} B each in the trainer, {LORA_SAMPLER_BYTES_PER_PARAM} B "
            f"in each of rollout.num_samplers={cfg.rollout.num_samplers}), more than {what} ({budget_bytes / GB:,.1f} GB); "
            "lower train.lora.r or train.lora.target_modules (or raise orchestrator.max_host_memory_gb)"
        )
