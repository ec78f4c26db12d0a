"""Activation (gradient) checkpointing of a policy (`train.gradient_checkpointing`): its decoder
layers keep no activations for the backward pass and recompute them there, trading about a third
more compute for the activations' memory.

Invariant: non-reentrant checkpointing (`use_reentrant=False`), so a step's loss and gradients are
the un-checkpointed step's up to rounding, with frozen inputs (a LoRA base) as without it. It is
enabled where the policy trains: the one-process trainer's model, and each rank's own copy (a
hook it installs does not travel between processes, so a rank enables it itself).
"""

from __future__ import annotations

from typing import Any

from relayrl.config.schema import ConfigError
from relayrl.models.lora import is_peft_model, peft_base

__all__ = ["enable_gradient_checkpointing", "is_checkpointing"]

_KWARGS = {"use_reentrant": False}


def _net(model: Any) -> Any:
    """The causal LM itself (a peft model's wrapped model: its layers are the base's)."""
    return peft_base(model) if is_peft_model(model) else model


def enable_gradient_checkpointing(model: Any) -> None:
    """Turn on activation checkpointing for `model`'s decoder layers (see the module); a model
    that does not support it is refused naming the key."""
    net = _net(model)
    if not getattr(net, "supports_gradient_checkpointing", False):
        raise ConfigError(f"train.gradient_checkpointing: {type(net).__name__} does not support activation checkpointing")
    enable = getattr(net, "activation_checkpointing_enable", None)  # (transformers ≥ 5.20; before it, the older name)
    if enable is not None:
        enable(activation_checkpointing_kwargs=dict(_KWARGS))
    else:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(_KWARGS))


def is_checkpointing(model: Any) -> bool:
    """Whether `model`'s layers recompute their activations in the backward pass."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in _net(model).modules())
