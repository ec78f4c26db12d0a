"""The tests' one trajectory factory (and the micro-batch of a few of them): every field has a
default, so a test names only the fields it varies."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.packing import layout_tokens
from relayrl.types import MicroBatch, PaddingStats, Prompt, Trajectory, TrajectoryStatus, Turn


def trajectory(
    *,
    group: int = 0,
    sample: int = 0,
    prompt: Prompt | None = None,
    prompt_tokens: Sequence[int] = (1, 2),
    completion_tokens: Sequence[int] = (3,),
    sampler_logprobs: Sequence[float] | None = None,
    logprob: float = -0.5,
    text: str = "4",
    version: int = 0,
    replica: int = 0,
    reward: float = 0.0,
    advantage: float = 0.0,
    failed: bool = False,
    error: str | None = None,
    turns: Sequence[Turn] = (),
    loss_mask: list[int] | None = None,
) -> Trajectory:
    """A trajectory of group `group`, sample `sample`. Defaults: the prompt
    `Prompt(f"p{group}", "2+2=", "4")`, tokens [1, 2] then [3], text "4", each sampler log-prob
    `logprob` (unless `sampler_logprobs` lists them), status FAILED when `failed`."""
    return Trajectory(
        group_id=group,
        sample_index=sample,
        prompt=prompt if prompt is not None else Prompt(f"p{group}", "2+2=", "4"),
        prompt_tokens=list(prompt_tokens),
        completion_tokens=list(completion_tokens),
        sampler_logprobs=list(sampler_logprobs) if sampler_logprobs is not None else [logprob] * len(completion_tokens),
        completion_text=text,
        policy_version=version,
        replica=replica,
        reward=reward,
        advantage=advantage,
        status=TrajectoryStatus.FAILED if failed else TrajectoryStatus.OK,
        error=error,
        turns=turns,
        loss_mask=loss_mask,
    )


def make_microbatch(trajectories: list[Trajectory], rows: list[list[int]], share_prompt: bool = False) -> MicroBatch:
    """Step 0's only micro-batch: these trajectories packed into these rows (indices into them)."""
    lengths = [layout_tokens(trajectories, row, share_prompt) for row in rows]
    return MicroBatch(
        step=0,
        index=0,
        final=True,
        trajectories=trajectories,
        rows=rows,
        padding=PaddingStats(rows=len(rows), row_tokens=max(lengths), real_tokens=sum(lengths), sequences=len(trajectories)),
        num_tokens=sum(lengths),
        share_prompt=share_prompt,
    )
