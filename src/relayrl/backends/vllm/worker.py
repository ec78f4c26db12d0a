"""Runs inside vLLM's worker process (vLLM's `worker_extension_cls`): loads a policy version's
weights into the running model in place, from a safetensors file the sampler wrote.

Invariant: after `update_from_file` every weight of the model, a tied LM head included, is the
file's: vLLM's `reload_weights` re-packs (on CPU, into oneDNN handles) only the layers whose
weights it read, and a tied LM head reads none, so its packed copy of the old embedding is
rebuilt here. Imports only what the worker already has (torch, safetensors, vllm).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["WeightSync", "refresh_tied_lm_head"]


def refresh_tied_lm_head(model: Any) -> bool:
    """Re-pack a tied LM head from the (new) embedding; False when the model has none tied."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", None):
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False  # only the CPU build keeps a packed copy of the head (GPU: the same tensor)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
    return True


class WeightSync:
    """Mixed into vLLM's worker: `self.model_runner` is the worker's."""

    model_runner: Any

    def update_from_file(self, path: str) -> dict[str, float]:
        """Load every tensor of the safetensors file `path` into the model, then fix a tied LM head.
        Returns the tensors read and the seconds it took."""
        from safetensors.torch import load_file

        start = time.perf_counter()
        state = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        tied = refresh_tied_lm_head(self.model_runner.model)
        return {"tensors": float(len(state)), "tied_fixed": float(tied), "seconds": time.perf_counter() - start}
