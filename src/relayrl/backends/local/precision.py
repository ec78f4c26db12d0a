"""Precision (`model.dtype`): the dtype each copy of the weights is kept in and the dtype that
computes, resolved for the devices a process computes on.

- "float32": everything in float32 (on CUDA, float32 matmuls use TF32: `cuda_precision_settings`).
- "bfloat16": bfloat16 compute with float32 master weights. The trainer keeps its parameters,
  gradients and AdamW moments in float32 and computes forward and backward in bfloat16 on
  bfloat16 casts of its parameters: `in_compute_dtype` in one process (around a micro-batch's
  forward and backward, so that activation checkpointing recomputes on the casts), FSDP2's
  `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` in the sharded trainer (the
  same computation). Its checkpoint holds float32, so a resume loses nothing. With LoRA only the
  adapters train: the frozen base is held in bfloat16. The samplers, the held-out engine and the
  KL reference hold bfloat16 copies, cast when they are made and at every weights load (a
  float32 payload is copied into bfloat16 parameters).
- "bfloat16-pure": everything in bfloat16, the trainer's parameters and AdamW moments too (half
  the trainer's memory, but an update below half a bfloat16 ulp of a weight rounds away: at lr
  1e-6 almost no weight moves). Only when asked for.
- "auto": "bfloat16" when every device the process computes on is a CUDA device that supports
  it, else "float32" (so "float32" on the CPU).

Log-probs are computed in float32 on both sides: the output projection (`Fp32Linear`, swapped in
by `fp32_head`) multiplies the compute dtype's weights in float32 arithmetic and returns float32
logits, in the trainer's packed forward and in the samplers' decode alike (a bfloat16 logit has
an ulp of 1/16 at 10). The trainer's and the samplers' log-probs still differ in bfloat16 (their
bodies round differently: packed forward against KV-cache decode), so the agreement bound
(`LOGPROB_DIFF_MEAN_BOUND`) knows the dtype, and `algorithm.tis_cap` unset means
`AUTO_TIS_CAP` when compute is bfloat16 (`effective_tis_cap`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.nn.functional as F

from relayrl.config.schema import ConfigError

__all__ = [
    "AUTO_TIS_CAP",
    "LOGPROB_DIFF_MEAN_BOUND",
    "PRECISIONS",
    "Fp32Linear",
    "Precision",
    "in_compute_dtype",
    "cuda_precision_settings",
    "effective_tis_cap",
    "fp32_head",
    "optimizer_options",
    "resolve_precision",
]

#: model.dtype's values (besides "auto"): (master dtype, compute dtype)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.float32, torch.bfloat16),
    "bfloat16-pure": (torch.bfloat16, torch.bfloat16),
}

#: The truncated-IS cap `algorithm.tis_cap` takes when unset and compute is bfloat16 (the cap of
#: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").
AUTO_TIS_CAP = 2.0

#: Bound on a step's on-policy `train/logprob_diff_mean` (staleness 0: the trainer's packed
#: forward against the sampler's KV-cache decode of the same weights), by compute dtype. Measured
#: on the CPU: float32 ≤ 2e-5 (max), bfloat16 mean 1.7-2.8e-3 (max 0.05-0.09).
LOGPROB_DIFF_MEAN_BOUND: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 1e-2}

_AUTOCAST_DEVICES = ("cpu", "cuda")

T = TypeVar("T")
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


@dataclass(frozen=True, slots=True)
class Precision:
    """A resolved `model.dtype`: `name` (one of PRECISIONS), the trainer's `master` dtype (its
    parameters, gradients, optimizer state, checkpoint) and the `compute` dtype (what the
    forward computes in; the samplers' weights)."""

    name: str
    master: torch.dtype
    compute: torch.dtype

    @classmethod
    def of(cls, name: str) -> Precision:
        if name not in PRECISIONS:
            raise ConfigError(f"invalid config key 'model.dtype': {name!r} is not one of {', '.join([*PRECISIONS, 'auto'])}")
        master, compute = PRECISIONS[name]
        return cls(name, master, compute)

    @property
    def mixed(self) -> bool:
        """Whether compute is in a lower precision than the master weights (autocast / FSDP2 policy)."""
        return self.master != self.compute


def resolve_precision(name: str, devices: Sequence[torch.device], bf16_supported: bool | None = None) -> Precision:
    """`model.dtype` for a process computing on `devices`: "auto" is "bfloat16" when they are all
    CUDA and support bfloat16 (`bf16_supported`, default: torch.cuda.is_bf16_supported()), else
    "float32"."""
    if name != "auto":
        return Precision.of(name)
    if not devices or any(d.type != "cuda" for d in devices):
        return Precision.of("float32")
    if bf16_supported is None:
        bf16_supported = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return Precision.of("bfloat16" if bf16_supported else "float32")


def effective_tis_cap(tis_cap: float | None, compute: torch.dtype, ratio_level: str = "token") -> float | None:
    """`algorithm.tis_cap` as the loss takes it: unset (None) = AUTO_TIS_CAP when compute is
    bfloat16 (token-level ratios only: GSPO clips against the sampler), else off; 0 = off."""
    if tis_cap is None:
        return AUTO_TIS_CAP if compute == torch.bfloat16 and ratio_level == "token" else None
    return tis_cap or None


class _Call(torch.nn.Module):
    """`fn(net)` as a module's forward (what `functional_call` reparametrizes)."""

    def __init__(self, net: torch.nn.Module, fn: Callable[[torch.nn.Module], T]) -> None:
        super().__init__()
        self.net = net
        self._fn = fn

    def forward(self) -> object:
        return self._fn(self.net)


def in_compute_dtype(model: torch.nn.Module, dtype: torch.dtype | None, fn: Callable[[torch.nn.Module], T]) -> T:
    """`fn(model)` with each floating parameter of `model` not in `dtype` replaced, for the call,
    by its cast to `dtype` (differentiable: backward brings the gradient to the master parameter,
    in its dtype; tied parameters stay tied): what FSDP2's `MixedPrecisionPolicy(param_dtype=...)`
    does, in one process. The forward then computes as a model held in `dtype` does (the
    samplers' bfloat16 copies), which autocast over float32 weights would not (its residual
    stream stays float32: on-policy log-prob differences ~4x larger, measured). None: `fn(model)`."""
    casts = (
        {}
        if dtype is None
        else {f"net.{n}": p.to(dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != dtype}
    )
    if not casts:
        return fn(model)
    return cast(T, torch.func.functional_call(_Call(model, fn), casts, ()))


def cuda_precision_settings(device: torch.device) -> bool:
    """On a CUDA `device`: float32 matmuls and convolutions in TF32, process-wide (the CUDA
    backends' `allow_tf32` flags only; `set_float32_matmul_precision` would change the CPU's
    float32 matmuls too). Returns whether it set them."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def optimizer_options(device: torch.device, fused_cpu: bool = True) -> dict[str, bool]:
    """AdamW's keyword options for parameters on `device`: the fused kernel on CUDA, and on the
    CPU unless `fused_cpu` is False (a sharded trainer's DTensor parameters). On the CPU the fused
    kernel is one pass over each parameter instead of ~10 (measured on SmolLM2-135M, one thread:
    0.50 s a step instead of 1.10 s); its update equals the default one up to float rounding."""
    return {"fused": True} if device.type == "cuda" or (device.type == "cpu" and fused_cpu) else {}


class Fp32Linear(torch.nn.Linear):
    """A linear layer (the output projection) computed in float32: the compute dtype's weights
    (the autocast dtype's under autocast, so that the trainer's master weights round as the
    samplers' copies do) times the input, both as float32, with autocast off. Its parameters and
    state dict are the `nn.Linear`'s."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        kind = input.device.type
        weight: torch.Tensor = self.weight
        bias: torch.Tensor | None = self.bias
        if kind not in _AUTOCAST_DEVICES:
            return F.linear(input.float(), weight.float(), None if bias is None else bias.float())
        if torch.is_autocast_enabled(kind):
            low = torch.get_autocast_dtype(kind)
            weight = weight.to(low)
            bias = None if bias is None else bias.to(low)
        with torch.autocast(device_type=kind, enabled=False):
            return F.linear(input.float(), weight.float(), None if bias is None else bias.float())


def fp32_head(model: ModuleT) -> ModuleT:
    """Make `model`'s output projection (`get_output_embeddings()`, a plain `nn.Linear`) an
    `Fp32Linear`, in place (its class only: parameters, tying and state dict unchanged); returns
    `model`. A model without such a head is left as it is."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is torch.nn.Linear:
        head.__class__ = Fp32Linear
    return model
