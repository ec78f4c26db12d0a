"""Tied weights in a state dict: one tensor per distinct parameter storage.

A tied model (e.g. `lm_head.weight` is `model.embed_tokens.weight`) lists the shared tensor
under each of its names. An exported version keeps every name (the samplers load it by name)
but holds each distinct storage once, so its bytes are the model's unique parameter bytes.

Invariants: `clone_once(s)` has the keys of `s` and the same values; two names share one clone
exactly when their tensors are the same view of one storage. `retie(s, model)` makes the names
tied in `model` share the tensor of the first such name in `s`. `unique_bytes` counts each
storage once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["clone_once", "distinct_storages", "retie", "tied_names", "unique_bytes"]


def _storage_id(t: torch.Tensor) -> int:
    """The identity of `t`'s storage (its C object: also distinct on the meta device, where every
    data pointer is 0)."""
    return int(t.untyped_storage()._cdata)


def _view_key(t: torch.Tensor) -> tuple[object, ...]:
    """Equal for two tensors that are the same view of the same storage."""
    return (_storage_id(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def clone_once(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` detached and cloned, each distinct view once (tied names share the clone)."""
    clones: dict[tuple[object, ...], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in state.items():
            key = _view_key(tensor)
            if key not in clones:
                clones[key] = tensor.detach().clone()
            out[name] = clones[key]
    return out


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that is an alias of an earlier one -> that earlier name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def retie(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """`state` with each alias of `tied_names(model)` holding its target's tensor (in place)."""
    for alias, target in tied_names(model).items():
        if alias in state and target in state and state[alias] is not state[target]:
            state[alias] = state[target]
    return state


def distinct_storages(state: Mapping[str, torch.Tensor]) -> int:
    """How many distinct storages the tensors of `state` use."""
    return len({_storage_id(t) for t in state.values()})


def unique_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The bytes of the distinct storages of `state` (each counted once)."""
    sizes: dict[int, int] = {}
    for t in state.values():
        sizes[_storage_id(t)] = t.untyped_storage().nbytes()
    return sum(sizes.values())
