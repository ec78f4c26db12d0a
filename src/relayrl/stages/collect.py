"""Collect: a sampler's result for one request → its group of trajectories (single completions;
multi-turn episodes are grouped by stages/episodes.py).

Invariant: a group holds exactly the completions of one request, each trajectory tagged with the
version and replica that sampled it.
"""

from __future__ import annotations

from relayrl.types import GenerateResult, Group, Trajectory


def to_group(result: GenerateResult) -> Group:
    req = result.request
    return Group(
        group_id=req.group_id,
        trajectories=[
            Trajectory(
                group_id=req.group_id,
                sample_index=i,
                prompt=req.prompt,
                prompt_tokens=req.prompt_tokens,
                completion_tokens=c.tokens,
                sampler_logprobs=c.logprobs,
                completion_text=c.text,
                policy_version=result.policy_version,
                replica=result.replica,
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(result.completions)
        ],
    )
