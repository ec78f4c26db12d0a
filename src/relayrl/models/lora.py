"""LoRA adapters (`train.lora`, via peft): wrapping the trainer's model, the adapter-only weights
payload that travels to the samplers and into checkpoints, and a sampler's merge of it.

The payload of a LoRA run's version is a dict of tensors (so the Ray transport carries it as any
state dict), three per adapted linear layer NAME (its name in the plain model, e.g.
`model.layers.0.self_attn.q_proj`): `NAME.lora_A` (r × in), `NAME.lora_B` (out × r) and
`NAME.lora_scaling` (a 0-d tensor, alpha / r). A sampler holding the plain model in float32
merges it: W = W0 + scaling · B · A, computed in float32 from the base weights W0 it kept when the
first payload arrived, never onto an already merged weight; a sampler in bfloat16 (model.dtype
"bfloat16") applies it unmerged, W0 x + scaling · B (A x), so that a small update is not rounded
away (`AdapterMerger`).

Invariants: a payload's tensors are copies (the sender may go on training); a merge is all or
nothing (every name and shape is checked before any weight changes); peft is imported only when a
run uses LoRA.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from relayrl.config.schema import ConfigError, LoraConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SUFFIXES = (".lora_A", ".lora_B", ".lora_scaling")
ADAPTER = "default"  # the adapter's name inside the peft model


def is_peft_model(model: object) -> bool:
    """Whether `model` is a peft model (without importing peft)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def peft_base(peft_model: Any) -> PreTrainedModel:
    """The causal LM a peft model wraps, its adapters injected (they compute in its forward)."""
    model: PreTrainedModel = peft_model.get_base_model()
    return model


def is_adapter_payload(payload: object) -> bool:
    """Whether a weights payload is a LoRA adapter payload (see the module) rather than a state dict."""
    return isinstance(payload, Mapping) and bool(payload) and all(isinstance(k, str) and k.endswith(SUFFIXES) for k in payload)


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every linear layer of `model` (what target_modules names)."""
    return {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Refuse (ConfigError naming train.lora.target_modules) a name that is no linear layer of `model`."""
    known = linear_names(model)
    unknown = [n for n in cfg.target_modules if n not in known]
    if unknown:
        raise ConfigError(
            f"invalid config key 'train.lora.target_modules': {unknown[0]!r} is not a linear layer of the model "
            f"(its linear layers: {', '.join(sorted(known))})"
        )
    shared = {p.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in cfg.target_modules and m.weight.data_ptr() in shared:
            raise ConfigError(
                f"invalid config key 'train.lora.target_modules': {name.rpartition('.')[2]!r} shares its weight with the"
                " input embeddings (tied), so merging an adapter into it would change both: leave it out"
            )


def wrap(model: PreTrainedModel, cfg: LoraConfig, *, seed: int) -> Any:
    """`model` with LoRA adapters on `cfg.target_modules` (peft's `get_peft_model`, in place: the
    base weights are frozen, only the adapters require gradients); `check_targets` first. The
    adapters' initial values are drawn from torch's global RNG seeded with `seed` (run.seed) and
    put back after, so two runs (and every rank of one) start from the same adapters."""
    check_targets(model, cfg)
    import peft

    peft_cfg = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # (typed int; peft computes alpha / r as a float)
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with warnings.catch_warnings(), torch.random.fork_rng(devices=cuda):
        # (peft asks transformers' deprecated is_gradient_checkpointing: a FutureWarning)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_cfg, adapter_name=ADAPTER)


def _adapted(peft_model: Any) -> dict[str, Any]:
    """Plain-model name → peft LoRA layer, for every adapted layer of `peft_model`."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}


def adapter_payload(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapters of `peft_model` now, as a payload (copies; see the module)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, layer in _adapted(peft_model).items():
            out[f"{name}.lora_A"] = layer.lora_A[ADAPTER].weight.detach().clone()
            out[f"{name}.lora_B"] = layer.lora_B[ADAPTER].weight.detach().clone()
            out[f"{name}.lora_scaling"] = torch.tensor(float(layer.scaling[ADAPTER]))
    return out


def load_adapter_payload(peft_model: Any, payload: Mapping[str, torch.Tensor]) -> None:
    """Copy a payload's adapters into `peft_model` (a checkpoint's, on resume or export); a
    payload of other layers or shapes raises ValueError naming them, before anything is copied."""
    layers = _adapted(peft_model)
    expected = {f"{name}{s}" for name in layers for s in SUFFIXES}
    if set(payload) != expected:
        extra, missing = sorted(set(payload) - expected), sorted(expected - set(payload))
        raise ValueError(f"the adapters do not fit the model: unexpected {extra[:3]}, missing {missing[:3]}")
    with torch.no_grad():
        for name, layer in layers.items():
            for part, modules in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
                weight = modules[ADAPTER].weight
                src = payload[f"{name}.{part}"]
                if tuple(src.shape) != tuple(weight.shape):
                    raise ValueError(f"the adapter {name}.{part} has shape {tuple(src.shape)}, the model's {tuple(weight.shape)}")
            scaling = float(payload[f"{name}.lora_scaling"])
            if abs(scaling - float(layer.scaling[ADAPTER])) > 1e-6 * max(1.0, abs(scaling)):
                raise ValueError(f"the adapter {name} has scaling {scaling}, the model's (train.lora alpha / r) {layer.scaling[ADAPTER]}")
        for name, layer in layers.items():
            layer.lora_A[ADAPTER].weight.copy_(payload[f"{name}.lora_A"])
            layer.lora_B[ADAPTER].weight.copy_(payload[f"{name}.lora_B"])


def restore_adapter_dropout(peft_model: Any, p: float) -> None:
    """Set the adapters' dropout back to `p` after `disable_dropout` turned every dropout off
    (train.lora.dropout > 0 is allowed with algorithm.tis_cap only)."""
    for layer in _adapted(peft_model).values():
        dropout = layer.lora_dropout[ADAPTER]
        if isinstance(dropout, torch.nn.Dropout):
            dropout.p = p


def payload_bytes(payload: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a payload's tensors."""
    return sum(t.numel() * t.element_size() for t in payload.values())


class AdaptedLinear(torch.nn.Linear):
    """A sampler's linear layer with its LoRA adapter applied unmerged, in the layer's dtype:
    W0 x + scaling · B (A x), as peft computes it in the trainer (whose forward runs on bfloat16
    casts of its adapters too). Its parameters and state dict are the `nn.Linear`'s."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    lora_scaling: float

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = super().forward(input)
        return out + torch.nn.functional.linear(torch.nn.functional.linear(input, self.lora_a), self.lora_b) * self.lora_scaling


class AdapterMerger:
    """A sampler's merge of adapter payloads into its plain model. Float32 weights: W = W0 +
    scaling · B · A, computed in float32 from the base weights W0 of the adapted layers, kept
    (copied) at the first merge. Weights in a lower precision (bfloat16 samplers): the adapters
    are applied unmerged (`AdaptedLinear`), since a merged update smaller than half a bfloat16
    ulp of W0 (most of them early in training: B starts at 0) would round away."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._base: dict[str, torch.Tensor] = {}

    def merge(self, payload: Mapping[str, torch.Tensor], where: str) -> None:
        """Set every adapted layer's weight to its base plus the payload's delta; checks first
        (ValueError naming `where` and the first bad entry), so a bad payload changes nothing."""
        names = sorted({k.rpartition(".")[0] for k in payload})
        for name in names:
            linear = self._linears.get(name)
            if linear is None:
                raise ValueError(f"{where}: the adapter {name!r} names no linear layer of the model")
            if self._base and name not in self._base:
                raise ValueError(f"{where}: the adapter {name!r} was not in the first version's adapters")
            a, b, s = (payload.get(f"{name}{suffix}") for suffix in SUFFIXES)
            if a is None or b is None or s is None:
                raise ValueError(f"{where}: the adapter {name!r} lacks lora_A, lora_B or lora_scaling")
            out_f, in_f = linear.weight.shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1] or s.numel() != 1:
                raise ValueError(
                    f"{where}: the adapter {name!r} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}; the layer is {out_f} × {in_f}"
                )
        if self._base and set(names) != set(self._base):
            raise ValueError(f"{where}: the adapters name other layers than the first version's")
        with torch.no_grad():
            if any(self._linears[name].weight.dtype != torch.float32 for name in names):
                self._attach(payload, names)
                return
            if not self._base:
                self._base = {name: self._linears[name].weight.detach().clone() for name in names}
            for name in names:
                weight = self._linears[name].weight
                a = payload[f"{name}.lora_A"].to(weight.device, torch.float32)
                b = payload[f"{name}.lora_B"].to(weight.device, torch.float32)
                scaling = float(payload[f"{name}.lora_scaling"])
                delta = (b @ a) * scaling
                weight.copy_((self._base[name].to(torch.float32) + delta).to(weight.dtype))

    def _attach(self, payload: Mapping[str, torch.Tensor], names: list[str]) -> None:
        """Set each adapted layer's adapter (unmerged, in the layer's dtype; see the class)."""
        if not self._base:
            self._base = {name: self._linears[name].weight for name in names}  # (the names: W0 stays in place)
        for name in names:
            linear = self._linears[name]
            weight = linear.weight
            linear.__class__ = AdaptedLinear
            adapted = cast(AdaptedLinear, linear)
            adapted.lora_a = payload[f"{name}.lora_A"].to(weight.device, weight.dtype, copy=True)
            adapted.lora_b = payload[f"{name}.lora_B"].to(weight.device, weight.dtype, copy=True)
            adapted.lora_scaling = float(payload[f"{name}.lora_scaling"])
