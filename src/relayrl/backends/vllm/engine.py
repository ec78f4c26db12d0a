"""Starting one vLLM `AsyncLLM` engine for a sampler replica: its settings and its environment.

Invariants:
- log-probs come back in the trainer's convention: `logprobs_mode = "processed_logprobs"`, i.e.
  log softmax(logits / temperature) of the sampled token (rollout.top_p must be 1, see
  `relayrl.config.schema`), float32 unless `model.dtype` says bfloat16;
- the engine loads `relayrl.backends.vllm.worker.WeightSync` into its worker, so weights load in
  place (`update_from_file`); with `weight_transfer` (the collective transport) its worker also
  makes relayrl's engine for vLLM's weight-transfer API (`relayrl.backends.vllm.transfer`);
- prefix caching is on with 32-token blocks (the CPU backend caches full blocks only, and its
  default 128 would never cache a short prompt), so an episode's next turn reuses its context's KV;
- settings per device (`relayrl.backends.vllm.build.engine_settings`): on the CPU the engine runs eager and a prompt
  is prefilled in one engine step, never in chunks (`enable_chunked_prefill = False`, with a step
  budget of at least one whole context): a seeded request whose prefill is split has its first
  draw discarded and vLLM rewinds its generator, which a CPU generator cannot do (the engine dies:
  "CPU Generator does not use offset"; measured with the multiturn recipe). On CUDA the engine
  captures CUDA graphs (`enforce_eager = False`), prefills in chunks of CUDA_STEP_TOKENS (a CUDA
  generator rewinds, so a split prefill samples what an unsplit one would), computes in the dtype
  `model.dtype` resolves to there (bfloat16 for "auto" on a GPU that supports it), and takes
  `gpu_memory_utilization` of its GPU (config/sizing.py);
- a CUDA engine computes on the GPU its settings name: its engine core is spawned with
  CUDA_VISIBLE_DEVICES naming that one GPU (as this process numbers it: an inherited
  CUDA_VISIBLE_DEVICES is mapped through), restored here once the engine is up;
- the engine core runs in its own process (never in the caller's: in-process vLLM would set up a
  torch.distributed group and make `torch.set_num_threads` a no-op there, next to the trainer),
  with the worker in that process (`distributed_executor_backend = "uni"`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_DEFAULTS",
    "SHUTDOWN_TIMEOUT_S",
    "EngineSettings",
    "context_length",
    "engine_args",
    "quiet_shutdown",
    "register_transfer_engine",
    "start_engine",
    "visible_devices",
]

# Set (unless already set) before vLLM is imported: 1 GiB of KV cache on CPU, no usage reports,
# vLLM's own log handler (every vLLM process: the engine core's too) at ERROR, on stderr: its
# start-up notes and expected warnings (eager mode, no Triton on the CPU, LD_PRELOAD hints) stay quiet
ENV_DEFAULTS: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_CONFIGURE_LOGGING": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}
SHUTDOWN_TIMEOUT_S = 60.0  # the engine core's own orderly exit (it frees its shared memory); vLLM's default 5 s is killed on a busy machine
WORKER_EXTENSION = "relayrl.backends.vllm.worker.WeightSync"
TRANSFER_BACKEND = "relayrl"  # vLLM's WeightTransferConfig.backend naming relayrl's engine
BLOCK_SIZE = 32
MIN_STEP_TOKENS = 2048  # tokens one engine step computes at most on the CPU, unless a context is longer
CUDA_STEP_TOKENS = 8192  # tokens one engine step computes at most on CUDA (prefill chunked to fit)
_SPAWN_LOCK = threading.Lock()  # CUDA_VISIBLE_DEVICES is process-wide while an engine core spawns


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What one engine is started with."""

    model: str  # a Hugging Face model directory
    dtype: str = "float32"  # "float32" | "bfloat16" (resolved, never "auto")
    max_model_len: int = 2048
    seed: int = 0
    max_num_seqs: int = 256
    skip_tokenizer_init: bool = False  # token ids in and out only (a model without a matching tokenizer)
    cuda_device: int | None = None  # the CUDA device (this process's numbering); None: the CPU
    gpu_memory_utilization: float | None = None  # CUDA: the engine's share of its GPU
    seed_requests: bool = True  # each request seeded (exact resume) rather than the engine only
    weight_transfer: bool = False  # relayrl's weight-transfer engine in the worker (rollout.weight_transport = "collective")

    @property
    def enforce_eager(self) -> bool:
        """No CUDA graphs: the CPU (where vLLM has none)."""
        return self.cuda_device is None

    @property
    def chunked_prefill(self) -> bool:
        """Prefill split over engine steps: CUDA only (see the module)."""
        return self.cuda_device is not None

    @property
    def max_num_batched_tokens(self) -> int:
        """Tokens one engine step computes at most."""
        if self.chunked_prefill:
            return max(CUDA_STEP_TOKENS, self.max_num_seqs)
        return max(MIN_STEP_TOKENS, self.max_model_len, self.max_num_seqs)


def context_length(model_dir: Path, default: int = 2048) -> int:
    """The model's context (`max_position_embeddings` of its config.json), or `default`."""
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError):
        return default
    return int(value) if isinstance(value, int) and value > 0 else default


def engine_args(settings: EngineSettings) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` keyword arguments for `settings` (see the module)."""
    args: dict[str, Any] = dict(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        enforce_eager=settings.enforce_eager,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        block_size=BLOCK_SIZE,
        distributed_executor_backend="uni",
        worker_extension_cls=WORKER_EXTENSION,
        max_num_seqs=settings.max_num_seqs,
        enable_chunked_prefill=settings.chunked_prefill,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        disable_log_stats=True,
        skip_tokenizer_init=settings.skip_tokenizer_init,
        use_tqdm_on_load=False,
    )
    if settings.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if settings.weight_transfer:
        args["weight_transfer_config"] = {"backend": TRANSFER_BACKEND}
    return args


def register_transfer_engine() -> None:
    """Register relayrl's weight-transfer engine (`relayrl.backends.vllm.transfer`, imported by
    vLLM when an engine is made) under TRANSFER_BACKEND with this process's vLLM, once; nothing
    where vLLM is absent or has no weight-transfer API."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, "relayrl.backends.vllm.transfer", "RelayrlTransferEngine")


def visible_devices(index: int, inherited: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine core on this process's CUDA device `index`, given this
    process's own CUDA_VISIBLE_DEVICES (`inherited`, None: unset; every GPU visible)."""
    if inherited is None or not inherited.strip():
        return str(index)
    ids = [part.strip() for part in inherited.split(",") if part.strip()]
    if index >= len(ids):
        raise ValueError(f"CUDA device {index} is not among this process's CUDA_VISIBLE_DEVICES={inherited!r}")
    return ids[index]


# Set while an engine core spawns (unless already set), for its processes only: the CPU worker's
# NUMA-binding notice (a torch C++ warning) and a deprecation vLLM's import triggers stay quiet
SPAWN_ENV: dict[str, str] = {
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore::FutureWarning:vllm.triton_utils.dispatcher",
}


@contextmanager
def _spawn_env(settings: EngineSettings) -> Iterator[None]:
    """While an engine core spawns: SPAWN_ENV, and for CUDA, CUDA_VISIBLE_DEVICES naming its GPU
    (all restored after). This process's own CUDA is initialised first, so it keeps seeing what
    it saw."""
    changes = {key: value for key, value in SPAWN_ENV.items() if key not in os.environ}
    if settings.cuda_device is not None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.init()
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM forces once CUDA is up, without its warning
        changes["CUDA_VISIBLE_DEVICES"] = visible_devices(settings.cuda_device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    with _SPAWN_LOCK:
        saved = {key: os.environ.get(key) for key in changes}
        os.environ.update(changes)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


_QUIET = False


def _silence_stderr() -> None:
    descriptor = os.open(os.devnull, os.O_WRONLY)
    os.dup2(descriptor, 2)
    os.close(descriptor)


def quiet_shutdown() -> None:
    """At this interpreter's exit (after the run printed all it had to, its error included), send
    stderr to /dev/null: libtriton, which vLLM imports, reports its nanobind objects as "leaked"
    at every interpreter shutdown (~36 lines that look like a crash). Triton silences its own
    workers the same way. Once per process."""
    global _QUIET
    if not _QUIET:
        atexit.register(_silence_stderr)
        _QUIET = True


def start_engine(settings: EngineSettings) -> Any:
    """A started `vllm.v1.engine.async_llm.AsyncLLM` (blocks until its engine core is up), on the
    device its settings name. Its output handler starts on the event loop of the first call that
    uses it."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # vLLM applies its log level once an engine is configured: its import-time notes too
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.* is deprecated", category=FutureWarning)
    quiet_shutdown()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(**engine_args(settings))
    with _spawn_env(settings):
        return AsyncLLM.from_engine_args(args)
