"""rollout.interruptible in agent rollouts: a weight load lands in the middle of an agent's call
(forced without timing: tests/support/interrupt.py), and the agent's trajectory records the
per-token versions as a multi-turn episode's does (agents/transcript.py)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest

from relayrl.agents.context import AgentContext
from relayrl.backends.local.generation import SamplingParams
from relayrl.backends.local.sampler import LocalSampler
from relayrl.types import Prompt, SampleRequest, TrajectoryStatus, Weights, token_versions
from support.agentutil import make_rollout, run_rollout
from support.interrupt import (
    NEW_TOKENS,
    PROMPT,
    SWAP_AFTER,
    interrupted_logprobs,
    load_after_pass,
    qwen2,
    reread_logprobs,
    word_tokenizer,
)

OBSERVATION = [9, 10, 11]  # what the agent appends before its second call


async def two_calls(ctx: AgentContext) -> float:
    """Completes the prompt (as token ids), appends an observation to what it got and completes that."""
    headers = {"Authorization": f"Bearer {ctx.api_key}"}
    async with httpx.AsyncClient(base_url=ctx.base_url, headers=headers, timeout=60) as client:
        ids: list[int] = list(PROMPT)
        for _ in range(2):
            response = await client.post("/completions", json={"model": ctx.model, "prompt": ids, "max_tokens": NEW_TOKENS})
            response.raise_for_status()
            ids = ids + list(response.json()["choices"][0]["token_ids"]) + OBSERVATION
    return 1.0


def test_a_load_in_the_middle_of_an_agent_call_gives_its_trajectory_both_versions() -> None:
    old, new = qwen2(0), qwen2(1)
    tok = word_tokenizer()
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, eos_token_ids=(999,))  # no EOS: every call runs its budget
    sampler = LocalSampler(copy.deepcopy(old), tok, params, seed=3, interruptible=True, torch_threads=1)
    loaders = load_after_pass(sampler.compute, Weights(version=1, payload=new.state_dict()), SWAP_AFTER)
    rollout = make_rollout(tok, two_calls, max_new_tokens=NEW_TOKENS, max_total_tokens=64)
    request = SampleRequest(0, Prompt("p0", "t5 t6 t7 t8", "0"), list(PROMPT), 1, "0:p0")

    async def main() -> Any:
        try:
            return await run_rollout(rollout, sampler, [request])
        finally:
            await sampler.close()

    [group] = asyncio.run(main())
    for loader in loaders:
        loader.join()
    assert sampler.compute.version == 1
    [t] = group.trajectories
    assert t.status is TrajectoryStatus.OK and t.agent_reward == 1.0
    first, second = t.turns
    assert (first.start, first.end) == (0, NEW_TOKENS) and second.start == NEW_TOKENS + len(OBSERVATION)
    # the first call's tokens 0..3 are version 0's, the rest (its last 6, the observation, the second call) version 1's
    assert t.versions == [(0, 0), (SWAP_AFTER, 1)]
    assert token_versions(t.versions, len(t.completion_tokens)) == [0] * SWAP_AFTER + [1] * (len(t.completion_tokens) - SWAP_AFTER)
    assert (first.policy_version, second.policy_version) == (0, 1)
    assert t.policy_version == 0 and group.min_version == 0  # staleness (the stale filter, check-trace) counts the oldest token
    assert t.loss_mask == [1] * NEW_TOKENS + [0] * len(OBSERVATION) + [1] * NEW_TOKENS
    p = len(PROMPT)
    sequence = PROMPT + t.completion_tokens
    lp = t.sampler_logprobs
    # before the load the old weights' log-probs; after it the new weights' over the old ones' cache
    assert lp[:SWAP_AFTER] == pytest.approx(reread_logprobs(old, sequence[: p + NEW_TOKENS], p)[:SWAP_AFTER], abs=1e-4)
    after = interrupted_logprobs(old, new, sequence[: p + NEW_TOKENS], p + SWAP_AFTER - 1, p + SWAP_AFTER)
    assert lp[SWAP_AFTER:NEW_TOKENS] == pytest.approx(after, abs=1e-4)
    assert lp[SWAP_AFTER:NEW_TOKENS] != pytest.approx(reread_logprobs(old, sequence[: p + NEW_TOKENS], p + SWAP_AFTER), abs=1e-4)
    # the second call continued the episode's kept cache, all with the new weights
    kept = interrupted_logprobs(old, new, sequence, p + SWAP_AFTER - 1, p + second.start)
    assert lp[second.start :] == pytest.approx(kept, abs=1e-4)
