"""Collect: a sampler's result for one request → its group of trajectories (single completions;
multi-turn episodes are grouped by orchestrator/stages/episodes.py).

Invariant: a group holds exactly the completions of one request, each trajectory tagged with the
version and replica that sampled it (with rollout.interruptible: the oldest version that sampled
one of its tokens, and the per-token segments).
"""

from __future__ import annotations

from relayrl.types import GenerateResult, Group, Trajectory


def to_group(result: GenerateResult) -> Group:
    req = result.request
    group_id, prompt, prompt_tokens, version, replica = req.group_id, req.prompt, req.prompt_tokens, result.policy_version, result.replica
    # positional, in Trajectory's field order (group_id, sample_index, prompt, prompt_tokens,
    # completion_tokens, sampler_logprobs, completion_text, policy_version, replica): nine
    # keywords more would cost about a third of this function, run for every trajectory
    return Group(
        group_id,
        [
            Trajectory(
                group_id,
                i,
                prompt,
                prompt_tokens,
                c.tokens,
                c.logprobs,
                c.text,
                version,
                replica,
                finish_reason=c.finish_reason,
                versions=c.versions,
            )
            for i, c in enumerate(result.completions)
        ],
    )
