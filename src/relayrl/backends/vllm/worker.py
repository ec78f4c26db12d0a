"""Runs inside vLLM's worker process (vLLM's `worker_extension_cls`): loads a policy version's
weights into the running model in place, from a safetensors file the sampler wrote; and registers
relayrl's weight-transfer engine (`relayrl.backends.vllm.transfer`) with this process's vLLM.

Invariant: after `update_from_file` every weight of the model, a tied LM head included, is the
file's: vLLM's `reload_weights` re-packs (on CPU, into oneDNN handles) only the layers whose
weights it read, and a tied LM head reads none, so its packed copy of the old embedding is
rebuilt here. Imports only what the worker already has (torch, safetensors, vllm) and relayrl's
engine module (no more).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from relayrl.backends.transports import STAGED
from relayrl.backends.vllm.engine import quiet_shutdown, register_transfer_engine

__all__ = ["WeightSync", "expected_misses", "refresh_tied_lm_head"]

quiet_shutdown()  # the worker's process imports libtriton too: no nanobind "leaked" report at its exit
register_transfer_engine()  # this process's vLLM can make relayrl's weight-transfer engine (collective transport)


# vLLM's layer-wise reload warns "<layer>: Failed to load weights" for every layer the checkpoint
# has no weights for; on every load that is the rotary embedding's cache (never in a checkpoint)
# and a tied LM head (re-packed below), which would print two lines per version
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _ExpectedMisses(logging.Filter):
    def __init__(self, layers: set[str]) -> None:
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and args[0] in self.layers)


@contextmanager
def expected_misses(model: Any) -> Iterator[None]:
    """While a reload runs: vLLM's layer-wise reload logs no miss for the layers no version has
    weights for (see `_RELOAD_LOGGER`)."""
    expected = _ExpectedMisses({"RotaryEmbedding", *(["ParallelLMHead"] if _tied(model) else [])})
    logger = logging.getLogger(_RELOAD_LOGGER)
    logger.addFilter(expected)
    try:
        yield
    finally:
        logger.removeFilter(expected)


def _tied(model: Any) -> bool:
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is getattr(embed, "weight", None)


def refresh_tied_lm_head(model: Any) -> bool:
    """Re-pack a tied LM head from the (new) embedding; False when the model has none tied."""
    if not _tied(model):
        return False
    lm_head = model.lm_head
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False  # only the CPU build keeps a packed copy of the head (GPU: the same tensor)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
    return True


class WeightSync:
    """Mixed into vLLM's worker: `self.model_runner` is the worker's."""

    model_runner: Any

    def staged_bytes(self) -> int:
        """The bytes this worker's process staged in host memory so far (benchmarks)."""
        return STAGED.read()

    def received_version(self) -> int | None:
        """The version of the last round relayrl's weight-transfer engine received (None: none)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return getattr(engine, "received_version", None)

    def update_from_file(self, path: str) -> dict[str, float]:
        """Load every tensor of the safetensors file `path` into the model, then fix a tied LM head.
        Returns the tensors read and the seconds it took."""
        from safetensors.torch import load_file

        start = time.perf_counter()
        state = load_file(path)
        STAGED.add(sum(t.numel() * t.element_size() for t in state.values()))  # read into host memory
        model = self.model_runner.model
        with expected_misses(model):
            self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        tied = refresh_tied_lm_head(model)
        return {"tensors": float(len(state)), "tied_fixed": float(tied), "seconds": time.perf_counter() - start}
