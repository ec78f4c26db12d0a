"""The attention mask of a packed batch, built on the device the model runs on, at train time.

Job: from a `PackedBatch`'s per-position `segment_ids` and `branch_ids` (the compact description
of its prefix tree, O(tokens), see `relayrl.backends.local.collate`), build the mask the model's
attention needs, on the batch's device, in the form that device and attention implementation
take:
- "bool": a dense boolean (B, 1, L, L) mask, True = attend (sdpa; the CPU's path);
- "float": the same as an additive mask in the model's dtype, 0 = attend, the dtype's minimum =
  blocked (eager attention, which misreads a boolean mask);
- "block": a FlexAttention `BlockMask` (torch.nn.attention.flex_attention): on CUDA the train
  forward of an sdpa (or flex_attention) model runs transformers' flex_attention with it, and the
  kernel skips the blocks the mask leaves empty — no (L × L) tensor exists anywhere. Flex attention
  runs on the CPU too, but compiles (tens of seconds) and is slow there, so the CPU builds the dense
  mask.

Rule (the prefix tree): query position q attends to key position k iff both belong to the same
segment, k <= q, and k is a prompt position (branch -1) or on q's own branch. A padding position
(segment -1) attends only to itself, so softmax stays defined, and is never attended to. Every
form encodes exactly this rule (`prefix_tree_mask` is the reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch

from relayrl.models.checkpointing import is_checkpointing

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

MaskForm = Literal["bool", "float", "block"]


def _own_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """`segment_ids` with each padding position given a segment of its own (-1 - its column),
    so that "same segment and causal" leaves a padding position only itself."""
    columns = torch.arange(segment_ids.shape[-1], device=segment_ids.device)
    return torch.where(segment_ids >= 0, segment_ids, -1 - columns)


def prefix_tree_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, L, L) mask, True = attend, on the ids' device (see the module's rule),
    elementwise over all (L × L) pairs; no host sync."""
    length = segment_ids.shape[-1]
    seg = _own_segments(segment_ids)
    mask = seg[:, :, None] == seg[:, None, :]
    mask &= torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril_()
    mask &= (branch_ids[:, None, :] < 0) | (branch_ids[:, :, None] == branch_ids[:, None, :])
    return mask.unsqueeze(1)


def to_additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean attend-mask to an additive one: 0 where attended, the dtype's minimum elsewhere."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


def prefix_tree_block_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor) -> BlockMask:
    """The same rule as a FlexAttention `BlockMask` (B rows, heads broadcast), on the ids' device
    (flex attention: torch >= 2.5, imported only here)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, length = segment_ids.shape
    seg = _own_segments(segment_ids)
    branch = branch_ids

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        on_branch = (branch[b, k] < 0) | (branch[b, q] == branch[b, k])
        return (seg[b, q] == seg[b, k]) & (k <= q) & on_branch

    return create_block_mask(mask_mod, rows, None, length, length, device=segment_ids.device)


def mask_form(attn_implementation: str | None, device: torch.device, *, switch_allowed: bool = True) -> MaskForm:
    """The form of mask a model with this attention implementation takes on `device`: a block
    mask for flex_attention, and for sdpa on CUDA (run as flex_attention, see `packed_attention`)
    when `switch_allowed`; an additive one for eager; a boolean one otherwise (sdpa on the CPU).
    Not `switch_allowed` (the model recomputes layers in its backward pass, which would run them
    with sdpa again, or deterministic algorithms are on, for which flex attention's backward is
    not known to be deterministic): sdpa keeps a boolean mask on CUDA too."""
    if attn_implementation == "flex_attention" or (attn_implementation == "sdpa" and device.type == "cuda" and switch_allowed):
        return "block"
    if attn_implementation == "eager":
        return "float"
    return "bool"


@contextmanager
def _attention_implementation(config: Any, implementation: str) -> Iterator[None]:
    """`config._attn_implementation` set to `implementation` for the block (transformers' attention
    layers read it at each forward), then restored."""
    before = getattr(config, "_attn_implementation", None)
    if before == implementation:
        yield
        return
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = before


@contextmanager
def packed_attention(model: object, segment_ids: torch.Tensor, branch_ids: torch.Tensor) -> Iterator[torch.Tensor | BlockMask]:
    """The attention mask to pass as `attention_mask` for a forward pass of `model` over a packed
    batch, built on the ids' device in the form `mask_form` picks; inside the block a model whose
    mask is a block mask runs transformers' flex_attention. The model's forward (not its
    backward, which reuses the saved attention) must run inside the block."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    name = implementation if isinstance(implementation, str) else None
    form = mask_form(name, segment_ids.device)
    if form == "block" and name != "flex_attention" and (torch.are_deterministic_algorithms_enabled() or is_checkpointing(model)):
        form = mask_form(name, segment_ids.device, switch_allowed=False)
    if form == "block":
        block = prefix_tree_block_mask(segment_ids, branch_ids)
        with _attention_implementation(config, "flex_attention"):
            yield block
        return
    mask = prefix_tree_mask(segment_ids, branch_ids)
    if form == "float":
        dtype = getattr(model, "dtype", None)
        yield to_additive_mask(mask, dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32)
        return
    yield mask
