"""The objective's options (algorithms/losses.py), each against a batch computed by hand: GSPO's
sequence-level ratio, the entropy bonus and entropy-quantile masking, the KL estimators and the KL
as a per-token reward penalty; and the config's refusals of bad combinations."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from relayrl.algorithms.losses import LossConfig, policy_loss
from relayrl.config.schema import AlgorithmConfig, Config

torch.set_num_threads(1)


def leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


# ---- GSPO -------------------------------------------------------------------------------------


def _gspo_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sequences: 0 has log-ratios [0.2, -0.1] (s_0 = e^0.05), 1 has [0.3, 0.3, 0.3] (s_1 = e^0.3)."""
    old = torch.tensor([-1.0, -2.0, -1.5, -0.5, -3.0])
    logp = leaf((old + torch.tensor([0.2, -0.1, 0.3, 0.3, 0.3])).tolist())
    seq = torch.tensor([0, 0, 1, 1, 1])
    return logp, old, seq, torch.ones(5)


def test_gspo_sequence_ratio_value_gradient_and_clip_by_hand() -> None:
    cfg = LossConfig(clip_eps_low=0.1, clip_eps_high=0.2, aggregation="seq_mean_token_mean", ratio_level="sequence")
    s0, s1 = math.exp(0.05), math.exp(0.3)  # 1.0513 (inside [0.9, 1.2]), 1.3499 (above 1.2)

    # A_0 = 1, A_1 = -1: seq 1's loss max(1.35, 1.2) = 1.35 is not clipped (A < 0, s above the range)
    logp, old, seq, mask = _gspo_batch()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    out = policy_loss(logp, old, adv, mask, seq, cfg)
    assert out.loss.item() == pytest.approx((-s0 + s1) / 2, rel=1e-5)
    out.loss.backward()
    assert logp.grad is not None  # d/dlogp_t of (1/G)(1/|y_i|)·(−A_i·s_i·π_t/sg[π_t]) = −A_i·s_i/(G·|y_i|)
    expected = [-s0 / 4, -s0 / 4, s1 / 6, s1 / 6, s1 / 6]
    assert logp.grad.tolist() == pytest.approx(expected, rel=1e-5)
    assert out.seq_ratio_min == pytest.approx(s0, rel=1e-6) and out.seq_ratio_max == pytest.approx(s1, rel=1e-6)
    assert out.clip_frac_high == 0.0 and out.clip_frac_low == 0.0
    # token-level ratios are still reported as they are: exp(0.3) is the largest, exp(-0.1) the smallest
    assert out.ratio_max == pytest.approx(math.exp(0.3), rel=1e-6) and out.ratio_min == pytest.approx(math.exp(-0.1), rel=1e-6)

    # A_1 = +1: s_1 = 1.35 > 1.2 is clipped for the whole sequence (no gradient on any of its tokens)
    logp, old, seq, mask = _gspo_batch()
    out = policy_loss(logp, old, torch.ones(5), mask, seq, cfg)
    assert out.loss.item() == pytest.approx((-s0 - 1.2) / 2, rel=1e-5)
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0, 0.0, 0.0], rel=1e-5, abs=1e-8)
    assert out.clip_frac_high == pytest.approx(3 / 5)  # the tokens of the clipped sequence


def test_gspo_gradient_equals_the_sequence_level_objective() -> None:
    """The token-level form has GSPO's gradient: that of (1/G)Σ_i −min(s_i·A_i, clip(s_i)·A_i) with
    s_i = exp(mean(logp − old)) differentiated as a whole."""
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 1, 4]
    seq = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    old = -torch.rand(8, generator=gen) * 2
    start = old + 0.002 * torch.randn(8, generator=gen)
    adv_seq = [0.7, -1.3, 0.4]
    adv = torch.tensor([adv_seq[i] for i in seq.tolist()])
    cfg = LossConfig(clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq_mean_token_mean", ratio_level="sequence")
    logp = start.clone().requires_grad_(True)
    policy_loss(logp, old, adv, torch.ones(8), seq, cfg).loss.backward()

    ref = start.clone().requires_grad_(True)
    terms = []
    for i in range(3):
        s = torch.exp((ref[seq == i] - old[seq == i]).mean())
        a = adv_seq[i]
        terms.append(-torch.minimum(s * a, s.clamp(1 - 3e-4, 1 + 4e-4) * a))
    torch.stack(terms).mean().backward()
    assert logp.grad is not None and ref.grad is not None
    assert torch.allclose(logp.grad, ref.grad, rtol=1e-5, atol=1e-7)


def test_gspo_refuses_tis_cap_and_other_aggregations() -> None:
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(aggregation="seq_mean_token_mean", ratio_level="sequence", tis_cap=2.0)
    with pytest.raises(ValueError, match="seq_mean_token_mean"):
        LossConfig(ratio_level="sequence")


# ---- entropy ----------------------------------------------------------------------------------


def test_entropy_bonus_on_policy_tokens_only() -> None:
    logp = leaf([-1.0, -2.0, -0.5, 7.0])
    entropy = leaf([0.4, 1.0, 0.1, 50.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last position is no policy token
    adv = torch.tensor([1.0, -1.0, 2.0, 9.0])
    out = policy_loss(logp, logp.detach(), adv, mask, torch.tensor([0, 0, 0, -1]), LossConfig(entropy_coef=0.1), entropy=entropy)
    # ratio 1: pg = −A; token mean over 3 tokens, minus 0.1 × the mean entropy of the 3 policy tokens
    assert out.loss.item() == pytest.approx(-(1 - 1 + 2) / 3 - 0.1 * (0.4 + 1.0 + 0.1) / 3, rel=1e-6)
    out.loss.backward()
    assert entropy.grad is not None
    assert entropy.grad.tolist() == pytest.approx([-0.1 / 3, -0.1 / 3, -0.1 / 3, 0.0])
    assert out.entropy_mean == pytest.approx(0.5)
    # off (the default): the entropy is a statistic, no term
    off = policy_loss(logp, logp.detach(), adv, mask, torch.tensor([0, 0, 0, -1]), LossConfig(), entropy=entropy)
    assert off.loss.item() == pytest.approx(-2 / 3, rel=1e-6)


def test_top_entropy_quantile_keeps_the_high_entropy_tokens() -> None:
    entropy = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7, 5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    logp = leaf([-1.0] * 6)
    cfg = LossConfig(top_entropy_quantile=0.4)
    out = policy_loss(logp, logp.detach(), adv, mask, torch.zeros(6, dtype=torch.long), cfg, entropy=entropy)
    # threshold = the 0.6-quantile of [0.1, 0.3, 0.5, 0.7, 0.9] (linear) = 0.58: tokens 2 and 4 keep pg
    assert out.loss.item() == pytest.approx(-(3.0 + 5.0) / 5, rel=1e-6)  # the normaliser keeps all 5
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -3 / 5, 0.0, -5 / 5, 0.0])
    assert out.entropy_masked_frac == pytest.approx(3 / 5)
    everything = policy_loss(logp, logp.detach(), adv, mask, torch.zeros(6, dtype=torch.long), LossConfig(), entropy=entropy)
    assert everything.entropy_masked_frac is None and everything.loss.item() == pytest.approx(-3.0)


# ---- KL ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", (0.5 - 0.2) / 2),
        ("k2", (0.5 * 0.25 + 0.5 * 0.04) / 2),
        ("k3", (math.exp(-0.5) + 0.5 - 1 + math.exp(0.2) - 0.2 - 1) / 2),
    ],
)
def test_kl_estimators(estimator: str, expected: float) -> None:
    logp = leaf([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.8])  # d = logp − ref = [0.5, −0.2]
    cfg = LossConfig(kl_beta=0.1, kl_estimator=estimator)  # type: ignore[arg-type]
    out = policy_loss(logp, logp.detach(), torch.zeros(2), torch.ones(2), torch.tensor([0, 0]), cfg, ref_logprobs=ref)
    assert out.kl_mean == pytest.approx(expected, rel=1e-5)
    assert out.loss.item() == pytest.approx(0.1 * expected, rel=1e-5)


def test_kl_in_reward_is_a_return_to_go_penalty_on_the_advantage() -> None:
    # k1 = d: seq 0 has [0.1, 0.2, 0.3], seq 1 [0.4, -0.2]; β = 0.5
    logp = leaf([-1.0, -1.0, -1.0, -1.0, -1.0, 3.0])
    ref = logp.detach() - torch.tensor([0.1, 0.2, 0.3, 0.4, -0.2, 0.0])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    seq = torch.tensor([0, 0, 0, 1, 1, -1])
    cfg = LossConfig(kl_beta=0.5, kl_estimator="k1", kl_in_reward=True)
    out = policy_loss(logp, logp.detach(), adv, mask, seq, cfg, ref_logprobs=ref)
    # A' = A − β·Σ_{t'≥t} kl: seq 0: 1 − 0.5·[0.6, 0.5, 0.3]; seq 1: −1 − 0.5·[0.2, −0.2]
    shaped = [0.7, 0.75, 0.85, -1.1, -0.9]
    assert out.loss.item() == pytest.approx(-sum(shaped) / 5, rel=1e-5)  # ratio 1, no KL loss term
    out.loss.backward()
    assert logp.grad is not None  # the KL is detached: the gradient is −A'/n
    assert logp.grad.tolist() == pytest.approx([-a / 5 for a in shaped] + [0.0], rel=1e-5)
    assert out.kl_reward_penalty_mean == pytest.approx(0.5 * (0.6 + 0.5 + 0.3 + 0.2 - 0.2) / 5, rel=1e-5)
    # the same batch with the KL as a loss term instead: −mean(A) + β·mean(k1)
    as_loss = policy_loss(logp, logp.detach(), adv, mask, seq, LossConfig(kl_beta=0.5, kl_estimator="k1"), ref_logprobs=ref)
    assert as_loss.loss.item() == pytest.approx(-1 / 5 + 0.5 * 0.8 / 5, rel=1e-5)


def test_kl_in_reward_sequences_interleaved_in_two_rows() -> None:
    """The return-to-go follows each sequence's own tokens, in order, wherever they lie."""
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    kl = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 0.0]])
    seq = torch.tensor([[1, 0, 1], [0, 1, -1]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    cfg = LossConfig(kl_beta=1.0, kl_estimator="k1", kl_in_reward=True, kl_clamp=None)  # (16 > the default clamp)
    out = policy_loss(logp, logp.detach(), torch.zeros(2, 3), mask, seq, cfg, ref_logprobs=logp.detach() - kl)
    out.loss.backward()
    # seq 1's tokens in flat order: 1, 4, 16 → to go 21, 20, 16; seq 0's: 2, 8 → 10, 8
    assert logp.grad is not None
    assert (logp.grad * 5).reshape(-1).tolist() == pytest.approx([21.0, 10.0, 20.0, 8.0, 16.0, 0.0])


def test_kl_in_reward_needs_beta() -> None:
    with pytest.raises(ValueError, match="kl_beta"):
        LossConfig(kl_in_reward=True)


# ---- config -----------------------------------------------------------------------------------


def _error(**algorithm: object) -> str:
    with pytest.raises(ValidationError) as info:
        Config.model_validate({"algorithm": algorithm})
    return str(info.value)


def test_config_refuses_bad_combinations_naming_the_keys() -> None:
    assert "algorithm.tis_cap" in _error(ratio_level="sequence", tis_cap=2.0)
    assert "algorithm.loss_aggregation" in _error(ratio_level="sequence", loss_aggregation="token_mean")
    assert "algorithm.kl_beta" in _error(kl_in_reward=True)
    assert "algorithm.overlong_buffer" in _error(overlong_buffer=9)  # > rollout.max_new_tokens = 8
    assert "top_entropy_quantile" in _error(top_entropy_quantile=0.0)
    assert "entropy_coef" in _error(entropy_coef=-0.1)
    assert "algorithm.ratio_level" in _error(ratio_level="sequence", advantage="drgrpo")


def test_gspo_brings_its_aggregation() -> None:
    assert AlgorithmConfig(ratio_level="sequence").loss_aggregation == "seq_mean_token_mean"
    assert AlgorithmConfig(advantage="drgrpo").loss_aggregation == "seq_mean_token_sum_norm"
    assert AlgorithmConfig().loss_aggregation == "token_mean"


def test_reinforce_pp_brings_its_per_token_kl_penalty() -> None:
    assert AlgorithmConfig(advantage="reinforce_pp", kl_beta=0.01).kl_in_reward
    assert not AlgorithmConfig(advantage="reinforce_pp", kl_beta=0.01, kl_in_reward=False).kl_in_reward
    assert not AlgorithmConfig(advantage="reinforce_pp").kl_in_reward  # no KL at all
    assert not AlgorithmConfig(kl_beta=0.01).kl_in_reward


def test_turn_discount_refuses_step_level_advantages() -> None:
    with pytest.raises(ValidationError, match="algorithm.turn_discount"):
        Config.model_validate(
            {"task": {"environment": "arithmetic_feedback"}, "algorithm": {"turn_discount": 0.9, "scale_rewards": "batch"}}
        )


def test_the_k3_estimate_is_clamped_to_kl_clamp_by_default_as_verl_and_openrlhf() -> None:
    """Unclamped, k3 reached e^20 ≈ 4.9e8 per token at log-ratio −20: one outlier token dominated."""
    logp = leaf([-21.0, -1.0])
    ref = torch.tensor([-1.0, -1.5])  # d = [−20, 0.5]
    k3 = [min(math.exp(20) - 20 - 1, 10.0), math.exp(-0.5) + 0.5 - 1]
    out = policy_loss(logp, logp.detach(), torch.zeros(2), torch.ones(2), torch.tensor([0, 0]), LossConfig(kl_beta=0.1), ref_logprobs=ref)
    assert out.kl_mean == pytest.approx(sum(k3) / 2, rel=1e-5)  # the outlier counts 10
    out.loss.backward()
    assert logp.grad is not None and logp.grad[0].item() == 0.0  # a clamped token's KL has no gradient
    free = LossConfig(kl_beta=0.1, kl_clamp=None)
    unclamped = policy_loss(logp, logp.detach(), torch.zeros(2), torch.ones(2), torch.tensor([0, 0]), free, ref_logprobs=ref)
    assert unclamped.kl_mean == pytest.approx((math.exp(20) - 21 + k3[1]) / 2, rel=1e-5)
    assert AlgorithmConfig().kl_clamp == 10.0 and LossConfig().kl_clamp == 10.0
    with pytest.raises(ValueError, match="kl_clamp"):
        LossConfig(kl_clamp=0.0)


def test_the_docs_of_kl_in_reward_and_entropy_coef_say_what_runs() -> None:
    """kl_in_reward claimed to match verl's use_kl_in_reward, which with grpo adds the summed KL to
    the score before group normalisation; entropy_coef said "mean entropy" whatever the aggregation."""
    fields = AlgorithmConfig.model_fields
    kl = " ".join((fields["kl_in_reward"].description or "").split())
    assert "Not verl's use_kl_in_reward" in kl and "before group normalisation" in kl
    entropy = " ".join((fields["entropy_coef"].description or "").split())
    assert all(mode in entropy for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"))
    # what runs: the group statistics see the score alone, the penalty comes off per token afterwards
    logp = leaf([-1.0, -1.0, -1.0, -1.0])
    ref = logp.detach() - torch.tensor([0.4, 0.2, 0.0, 0.0])  # k1: seq 0's KL sums to 0.6, seq 1's to 0
    a = 0.5 / math.sqrt(0.5)  # scores 1 and 0, group-normalised (std n − 1): ±0.707
    adv = torch.tensor([a, a, -a, -a])
    cfg = LossConfig(kl_beta=1.0, kl_estimator="k1", kl_in_reward=True)
    out = policy_loss(logp, logp.detach(), adv, torch.ones(4), torch.tensor([0, 0, 1, 1]), cfg, ref_logprobs=ref)
    out.loss.backward()
    assert logp.grad is not None
    ours = [-g * 4 for g in logp.grad.tolist()]
    assert ours == pytest.approx([a - 0.6, a - 0.2, -a, -a], rel=1e-5)
    # verl: normalise(1 − 0.6, 0 − 0) = ±0.707 again, one value for all of a sequence's tokens
    assert ours != pytest.approx([a, a, -a, -a], rel=1e-3)
