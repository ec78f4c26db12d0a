"""Step-level advantages and their keys: GRPO with batch std scaling (TRL's scale_rewards =
"batch"), no std scaling ("none" = Dr. GRPO's advantage), REINFORCE++ (OpenRLHF: the step's rewards
whitened, no group baseline); failed members keep 0 and take no part; combinations of
algorithm.advantage and algorithm.scale_rewards that mean nothing are refused naming both keys;
train.minibatches_per_step beyond rollout.groups_per_step is refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from relayrl.algorithms.advantages import group_advantages, needs_step, stage_kind, step_advantages
from relayrl.config.schema import ConfigError, config_to_toml, load_config
from relayrl.orchestrator.stages.advantage import finish_step_advantages
from relayrl.types import Group
from support.trajectories import trajectory

A = [1.0, 0.0, 0.0, 0.0]  # group A: centred [0.75, -0.25, -0.25, -0.25]
B = [1.0, 1.0, 1.0, 0.0]  # group B: centred [0.25, 0.25, 0.25, -0.75]
STD = math.sqrt(8 * 0.25 / 7)  # the step's 8 rewards: mean 0.5, each ±0.5 from it, n − 1 = 7


def _groups(failed: tuple[int, ...] = ()) -> list[Group]:
    groups = []
    for g, rewards in enumerate((A, B)):
        trajs = [trajectory(group=g, sample=i, reward=r, failed=(g * 4 + i) in failed) for i, r in enumerate(rewards)]
        groups.append(Group(g, trajs))
    return groups


def _stage(groups: list[Group], kind: str, scale: str) -> list[float]:
    """The advantage stage per group, then the train loop over the step (what a run does)."""
    for g in groups:
        flags = [t.status.value != "failed" for t in g.trajectories]
        for t, a in zip(g.trajectories, group_advantages([t.reward for t in g.trajectories], stage_kind(kind, scale), flags)):  # type: ignore[arg-type]
            t.advantage = a
    if needs_step(kind, scale):  # type: ignore[arg-type]
        finish_step_advantages(groups, kind=kind)  # type: ignore[arg-type]
    return [t.advantage for g in groups for t in g.trajectories]


def test_batch_std_scaling_divides_group_centred_rewards_by_the_step_std() -> None:
    expected = [a / (STD + 1e-6) for a in (0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75)]
    assert _stage(_groups(), "grpo", "batch") == pytest.approx(expected, rel=1e-9)
    # group scaling (today's GRPO) differs: each group by its own std
    group = _stage(_groups(), "grpo", "group")
    assert group[0] == pytest.approx(0.75 / (0.5 + 1e-6)) and group[0] != pytest.approx(expected[0])


def test_no_std_scaling_is_dr_grpo_s_advantage() -> None:
    centred = [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]
    assert _stage(_groups(), "grpo", "none") == pytest.approx(centred)
    assert _stage(_groups(), "drgrpo", "none") == pytest.approx(centred)


def test_reinforce_pp_whitens_the_step_s_rewards_without_a_group_baseline() -> None:
    expected = [(r - 0.5) / (STD + 1e-6) for r in A + B]
    assert _stage(_groups(), "reinforce_pp", "batch") == pytest.approx(expected, rel=1e-9)
    # group A's winner and group B's losers get what their rewards say, whatever their group
    out = _stage(_groups(), "reinforce_pp", "batch")
    assert out[0] == out[4] and out[1] == out[7]


def test_a_failed_member_keeps_zero_and_takes_no_part_in_the_step_statistics() -> None:
    out = _stage(_groups(failed=(7,)), "reinforce_pp", "batch")  # B's 0 failed: rewards 1,0,0,0,1,1,1
    scored = A + B[:3]
    mean = sum(scored) / 7
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / 6)
    assert out[7] == 0.0
    assert out[:7] == pytest.approx([(r - mean) / (std + 1e-6) for r in scored], rel=1e-9)
    batch = _stage(_groups(failed=(7,)), "grpo", "batch")
    assert batch[7] == 0.0 and batch[4] == pytest.approx(0.0)  # B's scored members tie: centred 0
    assert batch[0] == pytest.approx(0.75 / (std + 1e-6), rel=1e-9)


def test_a_step_with_fewer_than_two_scored_rewards_gets_zero() -> None:
    assert step_advantages([1.0, 5.0], [0.0, 0.0], [True, False], "reinforce_pp") == [0.0, 0.0]
    assert step_advantages([math.nan, 1.0, 2.0], [0.0, -0.5, 0.5], [True, True, True], "grpo")[0] == 0.0


@pytest.mark.parametrize(
    ("advantage", "scale"), [("drgrpo", "batch"), ("drgrpo", "group"), ("rloo", "batch"), ("rloo", "group"), ("reinforce_pp", "none")]
)
def test_a_scaling_that_contradicts_the_estimator_is_refused_naming_both_keys(advantage: str, scale: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"algorithm.advantage={advantage}", f"algorithm.scale_rewards={scale}"])
    message = str(err.value)
    assert "algorithm.scale_rewards" in message and "algorithm.advantage" in message and "\n" not in message


@pytest.mark.parametrize(("advantage", "scale"), [("grpo", "group"), ("drgrpo", "none"), ("rloo", "none"), ("reinforce_pp", "batch")])
def test_unset_scaling_follows_the_estimator_and_survives_config_toml(advantage: str, scale: str, tmp_path: Path) -> None:
    cfg = load_config(None, [f"algorithm.advantage={advantage}"])
    assert cfg.algorithm.scale_rewards == scale
    written = tmp_path / "config.toml"
    written.write_text(config_to_toml(cfg))
    assert load_config(written).algorithm == cfg.algorithm


def test_minibatches_beyond_the_groups_of_a_step_are_refused() -> None:
    assert load_config(None, ["rollout.groups_per_step=4", "train.minibatches_per_step=4"]).train.minibatches_per_step == 4
    with pytest.raises(ConfigError, match=r"train.minibatches_per_step = 5 exceeds rollout.groups_per_step = 4"):
        load_config(None, ["rollout.groups_per_step=4", "train.minibatches_per_step=5"])
    for key in ("train.ppo_epochs=0", "train.minibatches_per_step=0"):
        with pytest.raises(ConfigError, match=key.split("=")[0]):
            load_config(None, [key])


def _masked_whiten(values: list[list[float]]) -> list[list[float]]:
    """verl's masked_whiten (core_algos / torch_functional), in float64 on lists: the mean and the
    unbiased variance over every token, whitened = (x − mean) · rsqrt(var + 1e-8)."""
    flat = [v for row in values for v in row]
    n = len(flat)
    mean = sum(flat) / n
    var = sum((v - mean) ** 2 for v in flat) / n * (n / (n - 1))
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def test_reinforce_pp_whitens_per_token_as_verl_and_openrlhf_do_by_default() -> None:
    """Short right and long wrong answers: relayrl whitened per sequence, so the token-weighted
    mean advantage was −0.47 where verl and OpenRLHF (per-token whitening) give 0."""
    rewards = [1.0, 1.0, 0.0, 0.0]
    lengths = [2, 3, 12, 15]
    groups = [
        Group(0, [trajectory(group=0, sample=i, reward=r, completion_tokens=[5] * n) for i, (r, n) in enumerate(zip(rewards, lengths))])
    ]
    assert load_config(None, ["algorithm.advantage=reinforce_pp"]).algorithm.whiten == "token"
    finish_step_advantages(groups, kind="reinforce_pp", token_whiten=True)
    token = [t.advantage for t in groups[0].trajectories]
    reference = _masked_whiten([[r] * n for r, n in zip(rewards, lengths)])  # per-token returns: the reward, γ = 1, no KL
    assert token == pytest.approx([row[0] for row in reference], rel=1e-5)
    assert sum(a * n for a, n in zip(token, lengths)) / sum(lengths) == pytest.approx(0.0, abs=1e-9)
    sequence = step_advantages(rewards, [0.0] * 4, [True] * 4, "reinforce_pp")  # algorithm.whiten = "sequence"
    assert sum(a * n for a, n in zip(sequence, lengths)) / sum(lengths) < -0.4  # the long wrong answers dominate
    assert load_config(None, ["algorithm.advantage=reinforce_pp", "algorithm.whiten=sequence"]).algorithm.whiten == "sequence"
