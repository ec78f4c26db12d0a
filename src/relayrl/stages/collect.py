"""Collect: finished rollouts → groups of trajectories (one group per request).

Invariant: a group holds exactly the completions of one request, each trajectory tagged with the
version and replica that sampled it.
"""

from __future__ import annotations

import asyncio

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


async def collect_stage(
    inbox: asyncio.Queue[list[GenerateResult]],
    outbox: asyncio.Queue[list[Group]],
) -> None:
    while True:
        results = await inbox.get()
        await outbox.put([to_group(r) for r in results])
