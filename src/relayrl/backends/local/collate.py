"""Collation: turn a planned micro-batch into the packed tensors a causal LM trains on.

Job: lay each row's trajectories (prompt + completion tokens) side by side, pad the rows to a
common length, and build everything the loss needs per position.

Invariant: a packed forward pass sees each sequence exactly as an unpacked one would —
`position_ids` restart at 0 for every sequence and a 4D block-diagonal causal `attention_mask`
lets a token attend only to earlier tokens of its own sequence; padding positions attend only to
themselves (so softmax stays defined and nothing becomes NaN) and are never attended to by real
tokens. Position `p` carries the *prediction of token p+1*: `loss_mask[p] == 1` exactly when
token p+1 is a completion token of the same sequence, and then `target_ids[p]` is that token,
`old_logprobs[p]` its sampler log-prob and `advantages[p]` the sequence's advantage.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from relayrl.types import MicroBatch, Trajectory

MaskKind = Literal["bool", "float"]


@dataclass(slots=True)
class PackedBatch:
    """Tensors of one packed micro-batch; every per-token tensor has shape (B, L).

    - `input_ids`: token ids, `pad_token_id` on padding.
    - `position_ids`: restart at 0 for every packed sequence; 0 on padding.
    - `attention_mask`: (B, 1, L, L); bool (True = attend, for sdpa) or additive float
      (0 = attend, dtype min = blocked, for eager or sdpa).
    - `target_ids`: the token each position predicts (next token of the same sequence);
      `pad_token_id` where there is none (last token of a sequence, padding).
    - `loss_mask`: float 1.0 where `target_ids` is a completion token, else 0.0.
    - `advantages`: the owning trajectory's advantage on loss positions, 0 elsewhere.
    - `old_logprobs`: the sampler's log-prob of `target_ids` on loss positions, 0 elsewhere.
    - `seq_index`: index into the micro-batch's `trajectories` of the token's sequence; -1 on pad.
    - `num_real_tokens`: prompt + completion tokens of all sequences (no padding).
    - `num_loss_tokens`: completion tokens scored (== loss_mask.sum()).
    - `num_sequences`: trajectories in the micro-batch.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    seq_index: torch.Tensor
    num_real_tokens: int
    num_loss_tokens: int
    num_sequences: int

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.input_ids.shape
        return int(rows), int(length)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor moved to `device` (counts unchanged)."""
        moved: dict[str, torch.Tensor | int] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = (
                value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
            )
        return PackedBatch(**moved)  # type: ignore[arg-type]

    def split_by_sequence(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per sequence (in `trajectories` order), the entries of a (B, L) tensor on its loss
        positions, in completion order: entry j belongs to completion token j."""
        flat_seq = self.seq_index.reshape(-1)
        flat_mask = self.loss_mask.reshape(-1) > 0
        flat_values = values.reshape(-1)
        return [flat_values[(flat_seq == i) & flat_mask] for i in range(self.num_sequences)]


def block_causal_mask(seq_index: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, L, L) mask, True = attend: causal within each sequence id, nothing across
    sequences; a padding position (id < 0) attends only to itself."""
    rows, length = seq_index.shape
    same = seq_index[:, :, None] == seq_index[:, None, :]
    real = (seq_index >= 0)[:, :, None]
    causal = torch.ones(length, length, dtype=torch.bool, device=seq_index.device).tril_()
    eye = torch.eye(length, dtype=torch.bool, device=seq_index.device)
    mask = (same & real & causal) | eye
    return mask.unsqueeze(1)


def to_additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean attend-mask to an additive one: 0 where attended, the dtype's minimum elsewhere."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


class TorchCollator:
    """Collator for the local torch trainer (see module docstring for the layout).

    `pad_rows_to="longest"` pads rows to the longest row of the micro-batch; an int pads every row
    to exactly that many tokens (a row longer than it is an error). `mask_kind="bool"` suits sdpa;
    `"float"` (additive, `float_dtype`) suits eager and sdpa — eager misreads a boolean mask.
    """

    def __init__(
        self,
        pad_token_id: int,
        mask_kind: MaskKind = "bool",
        pad_rows_to: Literal["longest"] | int = "longest",
        float_dtype: torch.dtype = torch.float32,
    ) -> None:
        if mask_kind not in ("bool", "float"):
            raise ValueError(f"TorchCollator: mask_kind must be 'bool' or 'float', got {mask_kind!r}")
        if pad_rows_to != "longest" and (not isinstance(pad_rows_to, int) or pad_rows_to < 1):
            raise ValueError(
                f"TorchCollator: pad_rows_to must be 'longest' or a positive int, got {pad_rows_to!r}"
            )
        if not float_dtype.is_floating_point:
            raise ValueError(f"TorchCollator: float_dtype must be a floating dtype, got {float_dtype}")
        self.pad_token_id = pad_token_id
        self.mask_kind: MaskKind = mask_kind
        self.pad_rows_to: Literal["longest"] | int = pad_rows_to
        self.float_dtype = float_dtype

    def collate(self, mb: MicroBatch) -> PackedBatch:
        trajectories = mb.trajectories
        placed = [i for row in mb.rows for i in row]
        if sorted(placed) != list(range(len(trajectories))):
            raise ValueError(
                f"micro-batch step={mb.step} index={mb.index}: rows must place every trajectory "
                f"exactly once (0..{len(trajectories) - 1}), got {mb.rows}"
            )
        for i, traj in enumerate(trajectories):
            _check_trajectory(traj, i, mb)

        row_lengths = [sum(trajectories[i].num_tokens for i in row) for row in mb.rows]
        longest = max(row_lengths, default=0)
        if self.pad_rows_to == "longest":
            length = max(longest, 1)
        else:
            length = self.pad_rows_to
            if longest > length:
                bad = row_lengths.index(longest)
                raise ValueError(
                    f"micro-batch step={mb.step} index={mb.index}: row {bad} holds {longest} tokens, "
                    f"over pad_rows_to={length}"
                )
        rows = max(len(mb.rows), 1)

        input_ids = torch.full((rows, length), self.pad_token_id, dtype=torch.long)
        target_ids = torch.full((rows, length), self.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((rows, length), dtype=torch.long)
        seq_index = torch.full((rows, length), -1, dtype=torch.long)
        loss_mask = torch.zeros((rows, length), dtype=torch.float32)
        advantages = torch.zeros((rows, length), dtype=torch.float32)
        old_logprobs = torch.zeros((rows, length), dtype=torch.float32)

        num_loss_tokens = 0
        for r, row in enumerate(mb.rows):
            start = 0
            for i in row:
                traj = trajectories[i]
                n_prompt, n_comp = len(traj.prompt_tokens), len(traj.completion_tokens)
                n = n_prompt + n_comp
                end = start + n
                tokens = torch.tensor(traj.prompt_tokens + traj.completion_tokens, dtype=torch.long)
                input_ids[r, start:end] = tokens
                target_ids[r, start : end - 1] = tokens[1:]
                position_ids[r, start:end] = torch.arange(n)
                seq_index[r, start:end] = i
                if n_comp:
                    # positions predicting completion token j sit at start + n_prompt - 1 + j
                    first = start + n_prompt - 1
                    loss_mask[r, first : first + n_comp] = 1.0
                    advantages[r, first : first + n_comp] = traj.advantage
                    old_logprobs[r, first : first + n_comp] = torch.tensor(
                        traj.sampler_logprobs, dtype=torch.float32
                    )
                num_loss_tokens += n_comp
                start = end

        mask = block_causal_mask(seq_index)
        attention_mask = mask if self.mask_kind == "bool" else to_additive_mask(mask, self.float_dtype)
        return PackedBatch(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            target_ids=target_ids,
            loss_mask=loss_mask,
            advantages=advantages,
            old_logprobs=old_logprobs,
            seq_index=seq_index,
            num_real_tokens=sum(row_lengths),
            num_loss_tokens=num_loss_tokens,
            num_sequences=len(trajectories),
        )


def _check_trajectory(traj: Trajectory, i: int, mb: MicroBatch) -> None:
    where = (
        f"micro-batch step={mb.step} index={mb.index}, trajectory {i} "
        f"(group_id={traj.group_id}, sample_index={traj.sample_index})"
    )
    if len(traj.sampler_logprobs) != len(traj.completion_tokens):
        raise ValueError(
            f"{where}: {len(traj.sampler_logprobs)} sampler_logprobs for "
            f"{len(traj.completion_tokens)} completion tokens"
        )
    if traj.completion_tokens and not traj.prompt_tokens:
        raise ValueError(f"{where}: empty prompt_tokens; the first completion token has no predictor")
