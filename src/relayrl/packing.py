"""Token-budget packing: first-fit-decreasing of segments into rows, rows into micro-batches.

A row is laid out as *segments*: one prompt followed by one or more completions of it. Without
prompt sharing every trajectory is its own segment (prompt + completion). With prompt sharing the
trajectories of one group that carry the same prompt tokens share one copy of the prompt: a group
of G completions of c tokens costs P + G·c tokens instead of G·(P + c). The collator's attention
mask lets each completion see the shared prompt and its own earlier tokens only, so the
per-token log-probs (and their gradients) are those of G separate sequences.

With several minibatches per step (`train.minibatches_per_step` = m > 1) the step's groups, in
order, go to minibatch k = (their position) mod m, each minibatch is planned on its own and its
micro-batches follow the previous one's: a micro-batch holds one minibatch's trajectories only, a
group is never split, and each micro-batch carries its minibatch's loss normalisers (policy
tokens, sequences with a policy token) instead of the step's.

Invariant: every trajectory of the step is placed in exactly one row, no row's laid-out length
(`layout_tokens`) exceeds the budget, every row belongs to exactly one micro-batch, and every
micro-batch to exactly one minibatch.
"""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.errors import RunFailed
from relayrl.types import MicroBatch, PackPlan, PaddingStats, Trajectory


class PackingError(RunFailed, ValueError):
    """A trajectory longer than a packed row (`train.row_tokens`); resuming with the same
    config would meet it again."""

    resumable = False


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins whose sums are ≤ budget (FFD order)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)  # ties keep index order (stable)
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        if n > budget:
            raise PackingError(f"a trajectory of {n} tokens exceeds the row budget of {budget} tokens (train.row_tokens)")
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] = room - n
                break
        else:
            bins.append([i])
            free.append(budget - n)
    return bins


def segments(trajectories: Sequence[Trajectory], indices: Sequence[int], share_prompt: bool) -> list[list[int]]:
    """`indices` as segments (lists of trajectory indices laid out behind one prompt copy), in
    order of first appearance: with `share_prompt`, one segment per (group, prompt tokens);
    otherwise one segment per trajectory."""
    if not share_prompt:
        return [[i] for i in indices]
    by_key: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    tokens: list[int] | None = None
    group = -1
    segment: list[int] = []
    for i in indices:
        t = trajectories[i]
        if t.prompt_tokens is not tokens or t.group_id != group:  # a group's trajectories share one list: one key
            tokens, group = t.prompt_tokens, t.group_id
            segment = by_key.setdefault((group, tuple(tokens)), [])
        segment.append(i)
    return list(by_key.values())


def segment_tokens(trajectories: Sequence[Trajectory], segment: Sequence[int]) -> int:
    """Tokens a segment occupies: its prompt once, then every completion."""
    return len(trajectories[segment[0]].prompt_tokens) + sum([len(trajectories[i].completion_tokens) for i in segment])


def layout_tokens(trajectories: Sequence[Trajectory], indices: Sequence[int], share_prompt: bool) -> int:
    """Tokens a row holding `indices` occupies once laid out as segments."""
    return sum(segment_tokens(trajectories, s) for s in segments(trajectories, indices, share_prompt))


def _units(trajectories: Sequence[Trajectory], budget: int, share_prompt: bool) -> list[list[int]]:
    """Packing units: segments split (FFD of their completions) so that each fits the budget."""
    units: list[list[int]] = []
    for seg in segments(trajectories, range(len(trajectories)), share_prompt):
        if len(seg) == 1:
            units.append(seg)
            continue
        prompt = len(trajectories[seg[0]].prompt_tokens)
        lengths = [len(trajectories[i].completion_tokens) for i in seg]
        longest = max(lengths)
        if prompt + longest > budget:
            raise PackingError(f"a trajectory of {prompt + longest} tokens exceeds the row budget of {budget} tokens (train.row_tokens)")
        units.extend([seg[k] for k in sorted(chunk)] for chunk in first_fit_decreasing(lengths, budget - prompt))
    return units


def plan(
    trajectories: Sequence[Trajectory], row_budget: int, rows_per_microbatch: int, share_prompt: bool = False, minibatches: int = 1
) -> PackPlan:
    """Rows and micro-batches of a step's trajectories (listed group by group); with
    `minibatches` > 1, one plan per minibatch of groups, in minibatch order (module docstring)."""
    if minibatches > 1:
        return _plan_minibatches(trajectories, row_budget, rows_per_microbatch, share_prompt, minibatches)
    units = _units(trajectories, row_budget, share_prompt)
    unit_rows = first_fit_decreasing([segment_tokens(trajectories, u) for u in units], row_budget)
    rows = [[i for u in unit_row for i in units[u]] for unit_row in unit_rows]
    microbatches = [list(range(i, min(i + rows_per_microbatch, len(rows)))) for i in range(0, len(rows), rows_per_microbatch)]
    return PackPlan(rows=rows, microbatches=microbatches, row_budget=row_budget, share_prompt=share_prompt)


def minibatch_slices(trajectories: Sequence[Trajectory], minibatches: int) -> list[list[int]]:
    """Indices of `trajectories` per minibatch: the groups, in order of first appearance, go to
    minibatch (position mod `minibatches`); empty minibatches are dropped."""
    order: dict[int, int] = {}
    slices: list[list[int]] = [[] for _ in range(minibatches)]
    for i, t in enumerate(trajectories):
        slices[order.setdefault(t.group_id, len(order)) % minibatches].append(i)
    return [s for s in slices if s]


def _plan_minibatches(
    trajectories: Sequence[Trajectory], row_budget: int, rows_per_microbatch: int, share_prompt: bool, minibatches: int
) -> PackPlan:
    rows: list[list[int]] = []
    microbatches: list[list[int]] = []
    minibatch: list[int] = []
    tokens: list[int] = []
    sequences: list[int] = []
    for k, members in enumerate(minibatch_slices(trajectories, minibatches)):
        sub = plan([trajectories[i] for i in members], row_budget, rows_per_microbatch, share_prompt)
        offset = len(rows)
        rows.extend([members[i] for i in row] for row in sub.rows)
        microbatches.extend([r + offset for r in mb] for mb in sub.microbatches)
        minibatch.extend([k] * len(sub.microbatches))
        policy = [trajectories[i].policy_tokens for i in members]
        tokens.append(sum(policy))
        sequences.append(len(policy) - policy.count(0))
    return PackPlan(
        rows=rows,
        microbatches=microbatches,
        row_budget=row_budget,
        share_prompt=share_prompt,
        minibatch=minibatch,
        minibatch_tokens=tokens,
        minibatch_sequences=sequences,
    )


def build_microbatch(step: int, index: int, trajectories: Sequence[Trajectory], pack_plan: PackPlan) -> MicroBatch:
    """The micro-batch `index` of a plan, with rows re-indexed into its own trajectory list."""
    mb_trajs: list[Trajectory] = []
    mb_rows: list[list[int]] = []
    for row_index in pack_plan.microbatches[index]:
        row = pack_plan.rows[row_index]
        mb_rows.append(list(range(len(mb_trajs), len(mb_trajs) + len(row))))
        mb_trajs.extend([trajectories[t] for t in row])
    row_lengths = [layout_tokens(mb_trajs, row, pack_plan.share_prompt) for row in mb_rows]
    real = sum(row_lengths)
    minibatch = pack_plan.minibatch[index] if pack_plan.minibatch else 0
    if pack_plan.minibatch:  # its minibatch's normalisers
        norm_tokens, norm_sequences = pack_plan.minibatch_tokens[minibatch], pack_plan.minibatch_sequences[minibatch]
    else:
        policy = [t.policy_tokens for t in trajectories]  # the step's, once
        norm_tokens, norm_sequences = sum(policy), len(policy) - policy.count(0)
    return MicroBatch(
        step=step,
        index=index,
        final=index == len(pack_plan.microbatches) - 1,
        trajectories=mb_trajs,
        rows=mb_rows,
        padding=PaddingStats(
            rows=len(mb_rows),
            row_tokens=max(row_lengths, default=0),
            real_tokens=real,
            sequences=len(mb_trajs),
            sequence_tokens=sum([t.num_tokens for t in mb_trajs]),
        ),
        num_tokens=real,
        step_completion_tokens=norm_tokens,
        step_sequences=norm_sequences,
        share_prompt=pack_plan.share_prompt,
        minibatch=minibatch,
    )
