"""Collation: turn a planned micro-batch into the packed tensors a causal LM trains on.

Job: lay each row's segments (one prompt followed by the completions that share it, see
`relayrl.packing.segments`) side by side, pad the rows to a common length, and list the loss
tokens: for every completion token, the row position whose logits predict it.

Invariant: a packed forward pass gives every completion token exactly the log-prob one unpacked
forward pass of its own sequence gives. Positions restart at 0 at each segment's prompt and a
completion continues from the prompt's length. Who attends to whom (the prefix tree) is carried
compactly, per position: `segment_ids` and `branch_ids` (a completion's branch; -1 on a prompt
and on padding); the attention mask itself is built from them on the trainer's device at train
time (`relayrl.backends.local.attention`): a prompt token attends to earlier tokens of its prompt,
and a completion token to its segment's prompt and to earlier tokens of its own completion —
never to another completion or segment. Padding positions attend only to themselves (so softmax
stays defined and nothing becomes NaN) and are never attended to. The batch is O(tokens): no
(L × L) tensor is built here or shipped to the trainer.
The first completion token of every completion in a segment is predicted by the prompt's last
position (shared); completion token j > 0 by the completion's own token j − 1.

Multi-turn trajectories (`Trajectory.loss_mask`): observation tokens are laid out like any
completion token (later actions attend to them) but are no loss tokens: only the policy's tokens
are listed, so no observation token carries loss or log-probs. A trajectory with
`turn_advantages` (algorithm.turn_discount) gives each action token its turn's advantage (the
turn whose span [start, end) holds it); otherwise every token has the trajectory's `advantage`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch

from relayrl.packing import segment_tokens, segments
from relayrl.types import MicroBatch, Trajectory


@dataclass(slots=True)
class PackedBatch:
    """Tensors of one packed micro-batch.

    Per position, shape (B, L):
    - `input_ids`: token ids, `pad_token_id` on padding.
    - `position_ids`: 0.. along each segment's prompt, then prompt length.. along each completion;
      0 on padding.
    - `segment_ids`: the segment (numbered across the micro-batch) owning the position; -1 on pad.
    - `branch_ids`: on a completion token, its branch (the index of its trajectory in the
      micro-batch): it attends to its segment's prompt (branch -1) and its own branch only; -1 on
      prompt tokens and padding. The attention mask is built from `segment_ids` and `branch_ids`
      where the model runs (`relayrl.backends.local.attention.packed_attention`).
    Per loss token (one per policy token of a completion: every completion token, or those with
    `loss_mask` 1), shape (T,), in trajectory order and, within a trajectory, in completion order:
    - `source_index`: flat index into (B·L) of the position whose logits predict the token.
    - `target_ids`, `old_logprobs` (the sampler's log-prob), `advantages` (the trajectory's),
      `seq_index` (index into the micro-batch's `trajectories`).
    Counts: `num_real_tokens` (laid-out tokens, a shared prompt once; no padding),
    `num_loss_tokens` (= T), `num_sequences` (trajectories in the micro-batch).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    branch_ids: torch.Tensor
    source_index: torch.Tensor
    target_ids: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_index: torch.Tensor
    num_real_tokens: int
    num_loss_tokens: int
    num_sequences: int

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.input_ids.shape
        return int(rows), int(length)

    @property
    def loss_mask(self) -> torch.Tensor:
        """All ones over the loss tokens (every listed token is scored)."""
        return torch.ones(self.target_ids.shape, dtype=torch.float32, device=self.target_ids.device)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor moved to `device` (counts unchanged)."""
        moved: dict[str, torch.Tensor | int] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return PackedBatch(**moved)  # type: ignore[arg-type]

    def split_by_sequence(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per sequence (in `trajectories` order), the entries of a (T,) per-loss-token tensor, in
        completion order: entry j belongs to completion token j."""
        return [values[self.seq_index == i] for i in range(self.num_sequences)]


class TorchCollator:
    """Collator for the local torch trainer (see module docstring for the layout).

    `pad_rows_to="longest"` pads rows to the longest row of the micro-batch; an int pads every row
    to exactly that many tokens (a row longer than it is an error). The attention mask's form
    (boolean for sdpa, additive for eager, a FlexAttention block mask on CUDA) is chosen where the
    model runs, not here.
    """

    def __init__(self, pad_token_id: int, pad_rows_to: Literal["longest"] | int = "longest") -> None:
        if pad_rows_to != "longest" and (not isinstance(pad_rows_to, int) or pad_rows_to < 1):
            raise ValueError(f"TorchCollator: pad_rows_to must be 'longest' or a positive int, got {pad_rows_to!r}")
        self.pad_token_id = pad_token_id
        self.pad_rows_to: Literal["longest"] | int = pad_rows_to

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

        row_segments = [segments(trajectories, row, mb.share_prompt) for row in mb.rows]
        row_lengths = [sum(segment_tokens(trajectories, s) for s in segs) for segs in row_segments]
        longest = max(row_lengths, default=0)
        if self.pad_rows_to == "longest":
            length = max(longest, 1)
        else:
            length = self.pad_rows_to
            if longest > length:
                bad = row_lengths.index(longest)
                raise ValueError(
                    f"micro-batch step={mb.step} index={mb.index}: row {bad} holds {longest} tokens, over pad_rows_to={length}"
                )
        rows = max(len(mb.rows), 1)

        # per position (rows × length, flat) and per loss token, filled as Python lists
        input_ids = [self.pad_token_id] * (rows * length)
        position_ids = [0] * (rows * length)
        segment_ids = [-1] * (rows * length)
        branch_ids = [-1] * (rows * length)
        n_loss = sum(t.policy_tokens for t in trajectories)
        source = [0] * n_loss
        target = [0] * n_loss
        old = [0.0] * n_loss
        adv = [0.0] * n_loss
        seq = [0] * n_loss
        offsets = [0] * len(trajectories)  # first loss-token slot of each trajectory
        for i in range(1, len(trajectories)):
            offsets[i] = offsets[i - 1] + trajectories[i - 1].policy_tokens

        segment_id = 0
        for r, segs in enumerate(row_segments):
            p = r * length
            for seg in segs:
                prompt = trajectories[seg[0]].prompt_tokens
                n_prompt = len(prompt)
                input_ids[p : p + n_prompt] = prompt
                position_ids[p : p + n_prompt] = range(n_prompt)
                segment_ids[p : p + n_prompt] = [segment_id] * n_prompt
                last_prompt = p + n_prompt - 1
                p += n_prompt
                for i in seg:
                    traj = trajectories[i]
                    comp = traj.completion_tokens
                    n = len(comp)
                    input_ids[p : p + n] = comp
                    position_ids[p : p + n] = range(n_prompt, n_prompt + n)
                    segment_ids[p : p + n] = [segment_id] * n
                    branch_ids[p : p + n] = [i] * n
                    o = offsets[i]
                    if traj.loss_mask is None:
                        if n:
                            source[o] = last_prompt
                            source[o + 1 : o + n] = range(p, p + n - 1)
                        target[o : o + n] = comp
                        old[o : o + n] = traj.sampler_logprobs
                        k = n
                    else:  # only the policy's tokens: token j is predicted from position j - 1
                        picked = [j for j, m in enumerate(traj.loss_mask) if m]
                        k = len(picked)
                        source[o : o + k] = [last_prompt if j == 0 else p + j - 1 for j in picked]
                        target[o : o + k] = [comp[j] for j in picked]
                        old[o : o + k] = [traj.sampler_logprobs[j] for j in picked]
                    if traj.turn_advantages is None:
                        adv[o : o + k] = [traj.advantage] * k
                    else:
                        adv[o : o + k] = _turn_advantages(traj, picked if traj.loss_mask is not None else range(n))
                    seq[o : o + k] = [i] * k
                    p += n
                segment_id += 1

        shape = (rows, length)
        return PackedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long).view(shape),
            position_ids=torch.tensor(position_ids, dtype=torch.long).view(shape),
            segment_ids=torch.tensor(segment_ids, dtype=torch.long).view(shape),
            branch_ids=torch.tensor(branch_ids, dtype=torch.long).view(shape),
            source_index=torch.tensor(source, dtype=torch.long),
            target_ids=torch.tensor(target, dtype=torch.long),
            old_logprobs=torch.tensor(old, dtype=torch.float32),
            advantages=torch.tensor(adv, dtype=torch.float32),
            seq_index=torch.tensor(seq, dtype=torch.long),
            num_real_tokens=sum(row_lengths),
            num_loss_tokens=n_loss,
            num_sequences=len(trajectories),
        )


def _turn_advantages(traj: Trajectory, positions: Sequence[int]) -> list[float]:
    """Per policy token (its completion position), the advantage of the turn whose span holds it
    (a position before the first turn's start: the first turn's; after the last's end: the last's)."""
    assert traj.turn_advantages is not None
    starts = [turn.start for turn in traj.turns]
    per_turn = traj.turn_advantages
    return [per_turn[max(0, bisect.bisect_right(starts, j) - 1)] for j in positions]


def _check_trajectory(traj: Trajectory, i: int, mb: MicroBatch) -> None:
    where = f"micro-batch step={mb.step} index={mb.index}, trajectory {i} (group_id={traj.group_id}, sample_index={traj.sample_index})"
    if len(traj.sampler_logprobs) != len(traj.completion_tokens):
        raise ValueError(f"{where}: {len(traj.sampler_logprobs)} sampler_logprobs for {len(traj.completion_tokens)} completion tokens")
    if traj.loss_mask is not None and len(traj.loss_mask) != len(traj.completion_tokens):
        raise ValueError(f"{where}: {len(traj.loss_mask)} loss_mask entries for {len(traj.completion_tokens)} completion tokens")
    if traj.turn_advantages is not None and (len(traj.turn_advantages) != len(traj.turns) or not traj.turns):
        raise ValueError(f"{where}: {len(traj.turn_advantages)} turn_advantages for {len(traj.turns)} turns")
    if traj.completion_tokens and not traj.prompt_tokens:
        raise ValueError(f"{where}: empty prompt_tokens; the first completion token has no predictor")
