"""Token-budget packing: first-fit-decreasing of trajectories into rows, rows into micro-batches.

Invariant: every trajectory of the step is placed in exactly one row, no row holds more tokens
than the budget, and every row belongs to exactly one micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.types import MicroBatch, PackPlan, PaddingStats, Trajectory


class PackingError(ValueError):
    pass


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins whose sums are ≤ budget (FFD order)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
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


def plan(trajectories: Sequence[Trajectory], row_budget: int, rows_per_microbatch: int) -> PackPlan:
    rows = first_fit_decreasing([t.num_tokens for t in trajectories], row_budget)
    microbatches = [list(range(i, min(i + rows_per_microbatch, len(rows)))) for i in range(0, len(rows), rows_per_microbatch)]
    return PackPlan(rows=rows, microbatches=microbatches, row_budget=row_budget)


def build_microbatch(step: int, index: int, trajectories: Sequence[Trajectory], pack_plan: PackPlan) -> MicroBatch:
    """The micro-batch `index` of a plan, with rows re-indexed into its own trajectory list."""
    mb_trajs: list[Trajectory] = []
    mb_rows: list[list[int]] = []
    longest = 0
    for row_index in pack_plan.microbatches[index]:
        row: list[int] = []
        row_len = 0
        for t_index in pack_plan.rows[row_index]:
            row.append(len(mb_trajs))
            mb_trajs.append(trajectories[t_index])
            row_len += trajectories[t_index].num_tokens
        mb_rows.append(row)
        longest = max(longest, row_len)
    real = sum(t.num_tokens for t in mb_trajs)
    return MicroBatch(
        step=step,
        index=index,
        final=index == len(pack_plan.microbatches) - 1,
        trajectories=mb_trajs,
        rows=mb_rows,
        padding=PaddingStats(rows=len(mb_rows), row_tokens=longest, real_tokens=real, sequences=len(mb_trajs)),
        num_tokens=real,
        step_completion_tokens=sum(len(t.completion_tokens) for t in trajectories),
        step_sequences=sum(1 for t in trajectories if t.completion_tokens),
    )
