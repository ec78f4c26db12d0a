"""The control plane's per-trajectory fast paths give exactly what their general paths give
(issue 17: made cheaper, not different): packing's segments and first-fit-decreasing order, the
scorer settling a batch a column at a time, the advantages' finite-sum shortcut, `to_group`'s
positional construction."""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Sequence
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algorithms.advantages import AdvantageKind, group_advantages
from relayrl.orchestrator.stages.collect import to_group
from relayrl.packing import first_fit_decreasing, segments
from relayrl.rewards import scoring
from relayrl.rewards.registry import Placement, ResolvedReward
from relayrl.rewards.scoring import Failure, Outcome, Scorer, ScorerSettings
from relayrl.threads import OrchestratorThreads
from relayrl.types import Completion, GenerateResult, Prompt, RewardFailure, SampleRequest, Trajectory, TrajectoryStatus
from support.trajectories import trajectory

PROMPT = Prompt("p", "1+1=", "2")


def _traj(group_id: int, index: int, prompt_tokens: list[int], completion: int = 1) -> Trajectory:
    return trajectory(
        group=group_id, sample=index, prompt=PROMPT, prompt_tokens=prompt_tokens, completion_tokens=[3] * completion, text="2"
    )


# -- packing -----------------------------------------------------------------------------------


def _reference_segments(trajectories: Sequence[Trajectory], indices: Sequence[int], share_prompt: bool) -> list[list[int]]:
    if not share_prompt:
        return [[i] for i in indices]
    by_key: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i in indices:
        t = trajectories[i]
        by_key.setdefault((t.group_id, tuple(t.prompt_tokens)), []).append(i)
    return list(by_key.values())


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_segments_group_by_group_and_prompt_tokens_whatever_list_objects_hold_them(data: st.DataObject) -> None:
    prompts = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=4))
    trajectories = []
    for j in range(data.draw(st.integers(0, 30))):
        shared = prompts[data.draw(st.integers(0, len(prompts) - 1))]
        # the same list object (a group's trajectories), an equal copy, across groups too
        tokens = shared if data.draw(st.booleans()) else list(shared)
        trajectories.append(_traj(data.draw(st.integers(0, 3)), j, tokens))
    indices = data.draw(st.permutations(range(len(trajectories))))
    for share in (True, False):
        assert segments(trajectories, indices, share) == _reference_segments(trajectories, indices, share)


@given(st.lists(st.integers(0, 9), max_size=30), st.integers(9, 30))
def test_ffd_takes_lengths_longest_first_and_ties_in_index_order(lengths: list[int], budget: int) -> None:
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] = room - lengths[i]
                break
        else:
            bins.append([i])
            free.append(budget - lengths[i])
    assert first_fit_decreasing(lengths, budget) == bins


# -- scoring -----------------------------------------------------------------------------------

VALUES = st.one_of(
    st.floats(-10.0, 10.0),
    st.sampled_from([0.0, -0.0, 1e6, -1e6, 1e6 + 1.0, -2e6, 1e300, math.nan, math.inf, -math.inf]),
    st.just(Failure(RewardFailure.RAISED, "ValueError: boom")),
)


def _settled(rewards: list[ResolvedReward], clip: float, grid: list[list[Outcome]]) -> list[object]:
    trajectories = [_traj(0, j, [1]) for j in range(len(grid))]
    scorer = Scorer(rewards, ScorerSettings(clip=clip), OrchestratorThreads(()))
    failed = scorer._settle(trajectories, copy.deepcopy(grid))
    return [(repr(t.reward), t.status, t.error) for t in trajectories] + [
        (f.function, f.reason, f.detail, f.trajectory.sample_index) for f in failed
    ]


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_settling_a_column_at_a_time_gives_what_settling_row_by_row_gives(data: st.DataObject) -> None:
    k = data.draw(st.integers(1, 3))
    weights = data.draw(st.lists(st.sampled_from([1.0, 0.5, -2.0, 0.0, 1e300]), min_size=k, max_size=k))
    rewards = [ResolvedReward(f"f{i}", lambda t: 0.0, w, Placement.INLINE) for i, w in enumerate(weights)]
    clip = data.draw(st.sampled_from([0.0, 0.75, 3.0]))
    grid = data.draw(st.lists(st.lists(VALUES, min_size=k, max_size=k), max_size=6))
    fast = _settled(rewards, clip, grid)
    with mock.patch.object(scoring, "_taken_totals", lambda *args: None):  # every batch row by row
        slow = _settled(rewards, clip, grid)
    assert fast == slow


def test_an_all_inline_batch_is_scored_from_columns_with_the_row_by_row_failures() -> None:
    values = {0: 1.0, 1: math.nan, 2: 2e6, 3: 0.25}

    def reward(t: Trajectory) -> float:
        if t.sample_index == 4:
            raise ValueError("boom")
        return values[t.sample_index]

    workers = OrchestratorThreads(("score",))
    try:
        scorer = Scorer([ResolvedReward("r", reward, 2.0, Placement.INLINE)], ScorerSettings(), workers)
        trajectories = [_traj(0, j, [1]) for j in range(5)]
        failed = asyncio.run(scorer.score(trajectories))
    finally:
        workers.shutdown()
    assert [t.reward for t in trajectories] == [2.0, 0.0, 0.0, 0.5, 0.0]
    assert [t.status for t in trajectories] == [
        TrajectoryStatus.OK,
        *[TrajectoryStatus.FAILED] * 2,
        TrajectoryStatus.OK,
        TrajectoryStatus.FAILED,
    ]
    assert [(f.trajectory.sample_index, f.reason) for f in failed] == [
        (1, RewardFailure.NON_FINITE),
        (2, RewardFailure.NON_FINITE),
        (4, RewardFailure.RAISED),
    ]


# -- advantages --------------------------------------------------------------------------------


def _reference_advantages(rewards: Sequence[float], kind: AdvantageKind, scored: Sequence[bool] | None = None) -> list[float]:
    if scored is not None and not all(scored):
        inner = iter(_reference_advantages([r for r, s in zip(rewards, scored) if s], kind))
        return [next(inner) if s else 0.0 for s in scored]
    finite = [r for r in rewards if math.isfinite(r)]
    if len(finite) < len(rewards):
        inner = iter(_reference_advantages(finite, kind))
        return [next(inner) if math.isfinite(r) else 0.0 for r in rewards]
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    if kind == "drgrpo":
        out = [r - mean for r in rewards]
    elif kind == "rloo":
        total = sum(rewards)
        out = [r - (total - r) / (n - 1) for r in rewards]
    else:
        std = math.sqrt(sum((r - mean) * (r - mean) for r in rewards) / (n - 1))
        out = [(r - mean) / (std + 1e-6) for r in rewards]
    return out if all(math.isfinite(a) for a in out) else [0.0] * n


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.one_of(st.floats(-5.0, 5.0), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 0.0])), max_size=8),
    st.sampled_from(["grpo", "drgrpo", "rloo"]),
    st.data(),
)
def test_advantages_equal_the_general_computation(rewards: list[float], kind: AdvantageKind, data: st.DataObject) -> None:
    scored = data.draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=len(rewards), max_size=len(rewards))))
    assert group_advantages(rewards, kind, scored) == _reference_advantages(rewards, kind, scored)


# -- collect -----------------------------------------------------------------------------------


def test_to_group_puts_every_field_where_it_belongs() -> None:
    request = SampleRequest(7, PROMPT, [1, 2, 3], 2)
    completions = [Completion([4, 5], [-0.1, -0.2], "2", "stop"), Completion([6], [-0.3], "3", "length")]
    group = to_group(GenerateResult(request, completions, policy_version=5, replica=3))
    assert group.group_id == 7
    for i, (t, c) in enumerate(zip(group.trajectories, completions)):
        assert (t.group_id, t.sample_index, t.prompt, t.prompt_tokens) == (7, i, PROMPT, [1, 2, 3])
        assert (t.completion_tokens, t.sampler_logprobs, t.completion_text, t.finish_reason) == (
            c.tokens,
            c.logprobs,
            c.text,
            c.finish_reason,
        )
        assert (t.policy_version, t.replica, t.reward, t.advantage, t.status, t.turns) == (5, 3, 0.0, 0.0, TrajectoryStatus.OK, ())
