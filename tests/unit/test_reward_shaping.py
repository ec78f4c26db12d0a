"""Reward shaping before advantages (algorithms/shaping.py, orchestrator/stages/advantage.py): DAPO's
soft overlong penalty, mask_truncated's filtering and packing, and per-turn discounted credit
down to the collated per-token advantages — each against values computed by hand."""

from __future__ import annotations

import pytest

from relayrl.algorithms.shaping import discounted_returns, overlong_penalty, turn_advantages, turn_rewards
from relayrl.backends.local.collate import TorchCollator
from relayrl.orchestrator.stages.advantage import Shaping, filter_reason, scored, set_advantages, shape_rewards, trainable
from relayrl.packing import build_microbatch, plan
from relayrl.types import FilterReason, Group, Trajectory, Turn
from support.trajectories import trajectory


def test_overlong_penalty_dapo_eq_13() -> None:
    # L_max = 16, buffer 4: no penalty up to 12, then linear to −penalty at 16
    assert [overlong_penalty(n, 16, 4, 1.0) for n in (5, 12, 13, 14, 16)] == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    assert overlong_penalty(14, 16, 4, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(16, 16, 0, 1.0) == 0.0  # buffer 0: off


def _with_length(n: int, reward: float, *, finish: str = "stop", failed: bool = False, sample: int = 0) -> Trajectory:
    t = trajectory(sample=sample, completion_tokens=[5] * n, reward=reward, failed=failed)
    t.finish_reason = finish
    return t


def test_overlong_penalty_enters_the_reward_before_advantages() -> None:
    group = Group(0, [_with_length(4, 1.0), _with_length(7, 1.0, sample=1), _with_length(8, 1.0, failed=True, sample=2)])
    shaping = Shaping(max_policy_tokens=8, overlong_buffer=2, overlong_penalty=1.0)
    flags = scored(group.trajectories)
    shape_rewards(group, shaping, flags)
    # 7 tokens, L_max − buffer = 6: −1·(7 − 6)/2; the failed member is not scored: untouched
    assert [t.reward for t in group.trajectories] == pytest.approx([1.0, 0.5, 1.0])
    assert [t.overlong_penalty for t in group.trajectories] == pytest.approx([0.0, -0.5, 0.0])
    set_advantages(group, flags, kind="drgrpo")
    assert [t.advantage for t in group.trajectories] == pytest.approx([0.25, -0.25, 0.0])  # the tie is broken
    # dynamic sampling sees the shaped rewards: the group no longer ties
    assert filter_reason(group, dynamic_sampling=True, counted=flags) is None


def test_mask_truncated_keeps_truncated_in_the_baseline_but_not_in_the_loss() -> None:
    members = [_with_length(3, 1.0), _with_length(8, 0.0, finish="length", sample=1), _with_length(2, 0.5, sample=2)]
    group = Group(0, members)
    flags = scored(members)
    set_advantages(group, flags, kind="drgrpo")
    # the group's mean is over all three rewards (DAPO keeps truncated samples in the group statistics)
    assert [t.advantage for t in members] == pytest.approx([0.5, -0.5, 0.0])
    assert trainable(members, mask_truncated=True) == [members[0], members[2]]
    assert trainable(members) == members
    assert filter_reason(group, dynamic_sampling=False, counted=flags, mask_truncated=True) is None
    all_cut = Group(1, [_with_length(8, 0.0, finish="length"), _with_length(8, 1.0, finish="length", sample=1)])
    assert filter_reason(all_cut, dynamic_sampling=False, mask_truncated=True) is FilterReason.ALL_TRUNCATED
    assert filter_reason(all_cut, dynamic_sampling=False) is None


def _episode(parts: list[float], reward: float, sample: int) -> Trajectory:
    """An episode with one 1-token action per turn, each followed by a 1-token observation."""
    k = len(parts)
    turns = [Turn(start=2 * i, end=2 * i + 1, policy_version=0, replica=0, action="a", reward=r) for i, r in enumerate(parts)]
    return trajectory(
        sample=sample,
        completion_tokens=[7] * (2 * k - 1),
        sampler_logprobs=[-0.5 if i % 2 == 0 else 0.0 for i in range(2 * k - 1)],
        reward=reward,
        turns=turns,
        loss_mask=[1 if i % 2 == 0 else 0 for i in range(2 * k - 1)],
    )


def test_discounted_returns_and_turn_rewards() -> None:
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == pytest.approx([0.25, 0.5, 1.0])
    assert discounted_returns([1.0, 2.0], 1.0) == pytest.approx([3.0, 2.0])
    # a reward function besides the environment's adds 0.5: credited to the last action
    assert turn_rewards(_episode([0.0, 1.0], 1.5, 0)) == pytest.approx([0.0, 1.5])
    assert turn_rewards(trajectory(reward=2.0)) == [2.0]


def test_turn_advantages_by_hand() -> None:
    # γ = 0.5; G: ep0 [0.5, 1], ep1 [0], ep2 [0.25, 0.5, 1]; first-turn returns [0.5, 0, 0.25]:
    # mean 0.25, sample std 0.25
    group = Group(0, [_episode([0.0, 1.0], 1.0, 0), _episode([0.0], 0.0, 1), _episode([0.0, 0.0, 1.0], 1.0, 2)])
    flags = scored(group.trajectories)
    set_advantages(group, flags, kind="grpo", turn_discount=0.5)
    got = [t.turn_advantages for t in group.trajectories]
    expected = [[1.0, 3.0], [-1.0], [0.0, 1.0, 3.0]]
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, rel=1e-4)
    assert [t.advantage for t in group.trajectories] == pytest.approx([1.0, -1.0, 0.0], rel=1e-4)  # the first turn's
    set_advantages(group, flags, kind="drgrpo", turn_discount=0.5)
    assert [t.turn_advantages for t in group.trajectories] == [
        pytest.approx([0.25, 0.75]),
        pytest.approx([-0.25]),
        pytest.approx([0.0, 0.25, 0.75]),
    ]
    set_advantages(group, flags, kind="rloo", turn_discount=0.5)  # baseline: the mean of the others' G_0
    assert group.trajectories[0].turn_advantages == pytest.approx([0.5 - 0.125, 1.0 - 0.125])


def test_turn_advantages_tie_and_failed_members_are_zero() -> None:
    # the first-turn returns tie: no signal, whatever the later turns' returns
    assert turn_advantages([[1.0, 1.0], [1.0]], "grpo", [True, True]) == [[0.0, 0.0], [0.0]]
    # a failed member gets 0 and is left out: the others' statistics are as if it were absent
    out = turn_advantages([[1.0, 2.0], [0.0], [9.0, 9.0]], "drgrpo", [True, True, False])
    assert out == [pytest.approx([0.5, 1.5]), pytest.approx([-0.5]), [0.0, 0.0]]


def test_no_turn_discount_keeps_one_advantage_per_trajectory() -> None:
    group = Group(0, [_episode([0.0, 1.0], 1.0, 0), _episode([0.0], 0.0, 1)])
    set_advantages(group, scored(group.trajectories), kind="drgrpo")
    assert [t.advantage for t in group.trajectories] == pytest.approx([0.5, -0.5])
    assert all(t.turn_advantages is None for t in group.trajectories)


def test_collate_gives_each_action_token_its_turn_advantage() -> None:
    first = _episode([0.0, 0.0, 1.0], 1.0, 0)  # actions at completion positions 0, 2, 4
    first.advantage, first.turn_advantages = 0.3, [0.3, -0.7, 1.1]
    plain = _episode([1.0], 1.0, 1)
    plain.advantage = -2.0
    trajs = [first, plain]
    mb = build_microbatch(0, 0, trajs, plan(trajs, 64, 4, share_prompt=True))
    batch = TorchCollator(pad_token_id=0).collate(mb)
    assert batch.advantages.tolist() == pytest.approx([0.3, -0.7, 1.1, -2.0])
    assert batch.seq_index.tolist() == [0, 0, 0, 1]
