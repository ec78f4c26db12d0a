"""Starting one vLLM `AsyncLLM` engine for a sampler replica: its settings and its environment.

Invariants:
- log-probs come back in the trainer's convention: `logprobs_mode = "processed_logprobs"`, i.e.
  log softmax(logits / temperature) of the sampled token (rollout.top_p must be 1, see
  `relayrl.config.schema`), float32 unless `model.dtype` says bfloat16;
- the engine loads `relayrl.backends.vllm.worker.WeightSync` into its worker, so weights load in
  place (`update_from_file`);
- prefix caching is on with 32-token blocks (the CPU backend caches full blocks only, and its
  default 128 would never cache a short prompt), so an episode's next turn reuses its context's KV;
- a prompt is prefilled in one engine step, never in chunks (`enable_chunked_prefill = False`,
  with a step budget of at least one whole context): a seeded request whose prefill is split has
  its first draw discarded and vLLM rewinds its generator, which a CPU generator cannot do (the
  engine dies: "CPU Generator does not use offset"; measured with the multiturn recipe), and a
  rewind would anyway make what a request samples depend on how the engine split it;
- the engine core runs in its own process (never in the caller's: in-process vLLM would set up a
  torch.distributed group and make `torch.set_num_threads` a no-op there, next to the trainer),
  with the worker in that process (`distributed_executor_backend = "uni"`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ENV_DEFAULTS", "EngineSettings", "start_engine", "context_length"]

# Set (unless already set) before vLLM is imported: 1 GiB of KV cache on CPU, no usage reports.
ENV_DEFAULTS: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_CONFIGURE_LOGGING": "0",
}
WORKER_EXTENSION = "relayrl.backends.vllm.worker.WeightSync"
BLOCK_SIZE = 32
MIN_STEP_TOKENS = 2048  # tokens one engine step computes at most, unless a context is longer


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What one engine is started with."""

    model: str  # a Hugging Face model directory
    dtype: str = "float32"  # "float32" | "bfloat16"
    max_model_len: int = 2048
    seed: int = 0
    max_num_seqs: int = 256
    skip_tokenizer_init: bool = False  # token ids in and out only (a model without a matching tokenizer)


def context_length(model_dir: Path, default: int = 2048) -> int:
    """The model's context (`max_position_embeddings` of its config.json), or `default`."""
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError):
        return default
    return int(value) if isinstance(value, int) and value > 0 else default


def start_engine(settings: EngineSettings) -> Any:
    """A started `vllm.v1.engine.async_llm.AsyncLLM` (blocks until its engine core is up). Its
    output handler starts on the event loop of the first call that uses it."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        block_size=BLOCK_SIZE,
        distributed_executor_backend="uni",
        worker_extension_cls=WORKER_EXTENSION,
        max_num_seqs=settings.max_num_seqs,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(MIN_STEP_TOKENS, settings.max_model_len, settings.max_num_seqs),
        disable_log_stats=True,
        skip_tokenizer_init=settings.skip_tokenizer_init,
    )
    return AsyncLLM.from_engine_args(args)
