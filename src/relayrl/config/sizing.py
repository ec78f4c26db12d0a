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

GPU memory (the local backend on CUDA, `check_gpu_fits`): every copy of the model a run keeps on a
GPU is counted against that GPU's memory before anything is loaded: the trainer's parameters,
gradients and AdamW moments (fp32 master weights unless model.dtype = "bfloat16-pure"), its
committed snapshot, the KL reference, a LoRA base (frozen, in the compute dtype), its activations
(estimated from the micro-batch; train.gradient_checkpointing keeps one tensor per layer), each hf
sampler and the evaluation's engine (weights in the compute dtype and a KV cache), and each vLLM
replica's share (rollout.gpu_memory_utilization × the GPU's memory). The model's shape comes from
its config.json, instantiated on the `meta` device (nothing is read or allocated). GPU_HEADROOM of
each GPU stays free (CUDA contexts, the allocator's fragmentation). A vLLM replica's default share
is what the rest leaves, split between the replicas on that GPU, at most vLLM's own default.

Invariant: a configuration whose estimate exceeds the memory budget (each estimate on its own),
or a size beyond its cap, is refused before the run starts, in one line naming the keys that size
it, the value, the bound and why; it never starts and runs the machine out of memory (or blocks
its event loop for minutes creating objects, or spawns processes for minutes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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


# --- GPU memory ----------------------------------------------------------------------------------

GiB = GB
GPU_HEADROOM = 0.05  # of each GPU's memory left free: CUDA contexts, allocator fragmentation, NCCL buffers
VLLM_MAX_UTILIZATION = 0.92  # vLLM's own default gpu_memory_utilization (vllm/config/cache.py)
VLLM_OVERHEAD_BYTES = 2 * GiB  # a vLLM replica's activations, CUDA graphs and sampler beside weights and KV
LOGIT_COPIES = 3  # fp32 logits, their log-softmax and its gradient, per micro-batch token
MEMORY_KEYS = "model.dtype, rollout.num_samplers, train.gradient_checkpointing or rollout.gpu_memory_utilization"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizes a model's copies: parameter count (tied weights once) and the dimensions its
    activations and KV cache scale with."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_per_token: int  # KV-cache elements per token: 2 × layers × kv heads × head dim
    context: int  # max_position_embeddings


def model_shape(model_dir: Path) -> ModelShape | None:
    """The shape of the model whose config.json is in `model_dir`, instantiated on the `meta`
    device (no weights read, nothing allocated); None without a readable config.json (a GGUF
    file alone)."""
    if not (model_dir / "config.json").is_file():
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        config = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (hidden // heads if heads else 0))
    return ModelShape(
        params=params,
        layers=layers,
        hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", 0) or 4 * hidden),
        vocab=int(getattr(text, "vocab_size", 0) or 0),
        kv_per_token=2 * layers * kv_heads * head_dim,
        context=int(getattr(text, "max_position_embeddings", 0) or 2048),
    )


def precision_bytes(dtype: str, cuda_bf16: bool) -> tuple[int, int]:
    """(master, compute) bytes per parameter for `model.dtype` on a CUDA device: "float32" 4/4;
    "bfloat16" (and "auto" where the GPU supports it) fp32 master weights and optimizer state with
    bf16 compute, 4/2; "bfloat16-pure" 2/2."""
    if dtype == "bfloat16-pure":
        return 2, 2
    if dtype == "bfloat16" or (dtype == "auto" and cuda_bf16):
        return 4, 2
    return 4, 4


@dataclass(frozen=True, slots=True)
class GpuUse:
    """One resident copy on a GPU: its device index, what it is and its estimated bytes."""

    device: int
    what: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Placement:
    """The CUDA device index of each part of a run in this process (None: not on CUDA)."""

    trainer: int | None
    samplers: Sequence[int | None]  # one per replica
    evaluation: int | None


def activation_bytes(cfg: Config, shape: ModelShape, compute: int) -> int:
    """The trainer's activations for one micro-batch (rows_per_microbatch × row_tokens tokens),
    kept for the backward pass: per layer ~10 hidden-sized and 4 MLP-sized tensors per token (SDPA
    keeps no L×L scores), one hidden-sized tensor per layer with train.gradient_checkpointing (plus
    the layer being recomputed), and the fp32 logits path."""
    t = cfg.train
    tokens = t.rows_per_microbatch * t.row_tokens
    per_layer = tokens * (10 * shape.hidden + 4 * shape.intermediate) * compute
    if t.gradient_checkpointing:
        layers = shape.layers * tokens * shape.hidden * compute + per_layer
    else:
        layers = shape.layers * per_layer
    return layers + LOGIT_COPIES * tokens * shape.vocab * 4


def _kv_bytes(shape: ModelShape, sequences: int, tokens: int, compute: int) -> int:
    return sequences * tokens * shape.kv_per_token * compute


def gpu_residents(cfg: Config, shape: ModelShape, where: Placement, cuda_bf16: bool) -> list[GpuUse]:
    """Every fixed copy the run keeps on a GPU (the vLLM replicas' shares aside): see the module.
    The sharded trainer's rank r is on the trainer's device + r, each holding 1/N of the
    parameters, gradients and optimizer moments (and a whole KL reference)."""
    master, compute = precision_bytes(cfg.model.dtype, cuda_bf16)
    t, r, p = cfg.train, cfg.rollout, shape.params
    uses: list[GpuUse] = []
    if where.trainer is not None:
        ranks = t.world_size
        lora = t.lora is not None
        trainable = 0 if lora else p  # LoRA adapters: well under 1% of the model
        for rank in range(ranks):
            d = where.trainer + rank
            if lora:
                uses.append(GpuUse(d, "LoRA base", p * compute // ranks))
            else:
                uses.append(GpuUse(d, "trainer parameters", p * master // ranks))
                uses.append(GpuUse(d, "gradients", trainable * master // ranks))
                uses.append(GpuUse(d, "optimizer moments", 2 * trainable * master // ranks))
            if ranks == 1 and not lora:
                uses.append(GpuUse(d, "snapshot", p * master))
            if cfg.algorithm.kl_beta > 0 and not lora:
                uses.append(GpuUse(d, "KL reference", p * compute))
            uses.append(GpuUse(d, "activations", activation_bytes(cfg, shape, compute)))
    if r.engine == "hf":
        sequences = r.prompts_per_request * r.num_generations
        for i, at in enumerate(where.samplers):
            if at is not None:
                uses.append(GpuUse(at, f"sampler {i}", p * compute + _kv_bytes(shape, sequences, t.row_tokens, compute)))
    if where.evaluation is not None and cfg.eval.enabled:
        kv = _kv_bytes(shape, r.prompts_per_request, t.row_tokens, compute)
        uses.append(GpuUse(where.evaluation, "evaluation engine", p * compute + kv))
    return uses


def vllm_minimum_bytes(shape: ModelShape, compute: int, max_model_len: int) -> int:
    """The least a vLLM replica can start with: its weights, the KV cache of one whole context
    (vLLM refuses less) and VLLM_OVERHEAD_BYTES."""
    return shape.params * compute + shape.kv_per_token * max_model_len * compute + VLLM_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """What a run keeps on each GPU and each vLLM replica's gpu_memory_utilization."""

    uses: list[GpuUse]
    memory: dict[int, tuple[int, int]]  # device -> (free, total) bytes
    utilization: dict[int, float] = field(default_factory=dict)  # vLLM replica -> its share of its GPU


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f}"


def plan_gpu_memory(
    cfg: Config, shape: ModelShape, where: Placement, memory: dict[int, tuple[int, int]], *, cuda_bf16: bool, max_model_len: int
) -> GpuPlan:
    """The run's GPU plan (see the module), or a ConfigError in one line naming the GPU, what is
    estimated to be on it, and the keys that change it. `memory`: (free, total) bytes per device."""
    uses = gpu_residents(cfg, shape, where, cuda_bf16)
    compute = precision_bytes(cfg.model.dtype, cuda_bf16)[1]
    vllm = cfg.rollout.engine == "vllm"
    replicas: dict[int, list[int]] = {}
    if vllm:
        for i, d in enumerate(where.samplers):
            if d is not None:
                replicas.setdefault(d, []).append(i)
    minimum = vllm_minimum_bytes(shape, compute, max_model_len)
    asked = cfg.rollout.gpu_memory_utilization
    utilization: dict[int, float] = {}
    for d in sorted({u.device for u in uses} | set(replicas)):
        free, total = memory[d]
        here = [u for u in uses if u.device == d]
        fixed = sum(u.nbytes for u in here)
        budget = free - GPU_HEADROOM * total
        n = len(replicas.get(d, []))
        share = asked * total if asked else min(VLLM_MAX_UTILIZATION * total, (budget - fixed) / n) if n else 0.0
        need = fixed + n * max(share, minimum)
        items = [f"{u.what} {_gib(u.nbytes)}" for u in here]
        if n:
            items.append(f"{n} vLLM replica{'s' if n > 1 else ''} ≥ {_gib(max(share, minimum))} each")
        if need > budget or (n and share < minimum):
            why = (
                f"rollout.gpu_memory_utilization = {asked} gives each vLLM replica {_gib(share)} GiB, less than its weights, "
                f"one {max_model_len}-token context of KV cache and {_gib(VLLM_OVERHEAD_BYTES)} GiB overhead ({_gib(minimum)} GiB)"
                if n and asked and share < minimum
                else f"an estimated {_gib(need)} GiB is more than the {_gib(budget)} GiB it has free (less {GPU_HEADROOM:.0%} headroom)"
            )
            raise ConfigError(
                f"GPU memory: cuda:{d} ({_gib(total)} GiB): {why}; on it: {', '.join(items)} (GiB); "
                f"change {MEMORY_KEYS} (or train.lora, train.world_size, rollout.device / rollout.replica_devices)"
            )
        for i in replicas.get(d, []):
            utilization[i] = round(share / total, 4)
    return GpuPlan(uses, memory, utilization)


def cuda_memory(device: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device `device` (torch.cuda.mem_get_info; the total from
    get_device_properties)."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    total = int(torch.cuda.get_device_properties(device).total_memory)
    return int(free), total


def check_gpu_fits(
    cfg: Config,
    model_dir: Path,
    where: Placement,
    *,
    cuda_bf16: bool,
    max_model_len: int | None = None,
    memory: Callable[[int], tuple[int, int]] = cuda_memory,
) -> GpuPlan | None:
    """The GPU plan of a run placed as `where` (in this process), refused up front (ConfigError)
    when it does not fit (`plan_gpu_memory`); None when nothing is on CUDA or the model's shape is
    unknown (no config.json)."""
    devices = {d for d in (where.trainer, where.evaluation, *where.samplers) if d is not None}
    if not devices:
        return None
    shape = model_shape(model_dir)
    if shape is None:
        return None
    if where.trainer is not None:
        devices |= {where.trainer + r for r in range(cfg.train.world_size)}
    import torch

    count = torch.cuda.device_count()
    if max(devices) >= count:  # refused before this, naming the keys (backends/local/placement.check_placement)
        return None
    return plan_gpu_memory(
        cfg,
        shape,
        where,
        {d: memory(d) for d in sorted(devices)},
        cuda_bf16=cuda_bf16,
        max_model_len=max_model_len or shape.context,
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


def lora_version_bytes(model: object, r: int, targets: list[str]) -> int:
    """Bytes of one LoRA version (`relayrl.models.lora.adapter_payload`) of rank `r` on `model`:
    per targeted layer its float32 A (r × in) and B (out × r) and its float32 scaling."""
    return sum(4 * (r * (fin + fout) + 1) for _, fin, fout in lora_shapes(model, targets))


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


# --- the Ray object store ------------------------------------------------------------------------

DEFAULT_OBJECT_STORE_MB = 256  # ray.object_store_mb = 0 (sized from the model): at least this
STORE_VERSIONS = 2  # weight versions the store holds at once (the one being read, the next one)
STORE_MICROBATCHES = 2  # micro-batches in flight to the trainer actor (the one it trains, the one queued ahead)
# a collated micro-batch (relayrl.backends.local.collate.PackedBatch) per laid-out position: four
# int64 tensors over (rows, row_tokens) and at most one loss token per position (three int64, two float32)
MICROBATCH_BYTES_PER_POSITION = 4 * 8 + 3 * 8 + 2 * 4


@dataclass(frozen=True, slots=True)
class StoreNeed:
    """What the Ray object store must hold: STORE_VERSIONS weight versions of `version` bytes
    (`params` parameters, tied weights once, `per_param` bytes each) and STORE_MICROBATCHES
    micro-batches of `microbatch` bytes."""

    params: int
    per_param: int
    version: int
    microbatch: int

    @property
    def nbytes(self) -> int:
        return STORE_VERSIONS * self.version + STORE_MICROBATCHES * self.microbatch

    @property
    def mb(self) -> int:
        return -(-self.nbytes // MB)

    def why(self) -> str:
        return (
            f"{self.nbytes:,} bytes ({self.mb:,} MB): {STORE_VERSIONS} weight versions of {self.version:,} bytes "
            f"({self.params:,} parameters × {self.per_param} B) plus {STORE_MICROBATCHES} micro-batches of "
            f"{self.microbatch:,} bytes (train.row_tokens × train.rows_per_microbatch × {MICROBATCH_BYTES_PER_POSITION} B)"
        )


def store_need(cfg: Config, model_dir: Path) -> StoreNeed | None:
    """What a Ray run of the local backend puts in the object store at once (`StoreNeed`): a
    version is the trainer's export, its master weights (fp32 unless model.dtype =
    "bfloat16-pure"; with train.lora its adapters, counted as nothing beside the micro-batches).
    None when the model's shape is unknown (no config.json: a GGUF file alone)."""
    shape = model_shape(model_dir)
    if shape is None:
        return None
    master, _ = precision_bytes(cfg.model.dtype, cuda_bf16=False)
    params = 0 if cfg.train.lora is not None else shape.params
    t = cfg.train
    return StoreNeed(
        params=params,
        per_param=master,
        version=params * master,
        microbatch=t.row_tokens * t.rows_per_microbatch * MICROBATCH_BYTES_PER_POSITION,
    )


def object_store_mb(cfg: Config, need: StoreNeed | None) -> int:
    """The object store size (MB) of the local cluster a run starts: ray.object_store_mb, or with
    0 what `need` asks (at least DEFAULT_OBJECT_STORE_MB). A size set below `need` is refused
    (ConfigError) naming the key and the bytes needed."""
    mb = cfg.ray.object_store_mb
    if mb == 0:
        return max(DEFAULT_OBJECT_STORE_MB, need.mb if need is not None else 0)
    if need is not None and mb * MB < need.nbytes:
        raise ConfigError(
            f"ray.object_store_mb = {mb} is too small: the Ray object store must hold {need.why()}; "
            f"set ray.object_store_mb to at least {need.mb} (or 0: sized from the model)"
        )
    return mb


def check_joined_store(need: StoreNeed | None, node_bytes: Sequence[float], address: str) -> None:
    """A joined Ray cluster (ray.address): refused (ConfigError) when a node's object store
    (`node_bytes`, each alive node's) cannot hold `need`."""
    if need is None or not node_bytes or min(node_bytes) >= need.nbytes:
        return
    raise ConfigError(
        f"ray.address = {address!r}: the Ray cluster's smallest object store is {int(min(node_bytes)):,} bytes, "
        f"but it must hold {need.why()}; start its nodes with a larger --object-store-memory (ray.object_store_mb "
        f"sizes only a cluster relayrl starts)"
    )
