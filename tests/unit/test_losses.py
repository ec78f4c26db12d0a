"""Behaviour of the policy loss: values, clipping sides, exact gradient accumulation, the
aggregation modes, the KL term and truncated importance sampling."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.losses import AGGREGATIONS, Aggregation, LossConfig, policy_loss

torch.set_num_threads(1)


def leaf(values: list[float] | list[list[float]] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32).clone().requires_grad_(True)


def test_ratio_one_gives_minus_mean_advantage() -> None:
    adv = torch.tensor([[1.0, 1.0, -0.5, 2.0, 0.0], [3.0, -1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    seq = torch.tensor([[0, 0, 0, 0, -1], [1, 1, -1, -1, -1]])
    logp = leaf(torch.randn(2, 5))
    out = policy_loss(logp, logp.detach(), adv, mask, seq, LossConfig())
    expected = -(adv * mask).sum() / mask.sum()
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert out.num_tokens == 5
    assert out.ratio_mean == pytest.approx(1.0) and out.ratio_min == pytest.approx(1.0)
    assert out.ratio_max == pytest.approx(1.0)
    assert out.clip_frac_low == 0.0 and out.clip_frac_high == 0.0
    assert out.logprob_diff_mean == pytest.approx(0.0) and out.logprob_diff_max == pytest.approx(0.0)
    assert out.kl_mean is None and out.entropy_mean is None and out.tis_weight_mean is None


def test_clipping_sides_with_asymmetric_eps() -> None:
    cfg = LossConfig(clip_eps_low=0.1, clip_eps_high=0.3)
    ratios = torch.tensor([1.35, 1.25, 0.80, 0.85, 0.95, 1.35])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    clipped = [True, False, False, True, False, False]
    old = torch.full((6,), -2.0)
    logp = leaf(old + ratios.log())
    out = policy_loss(logp, old, adv, torch.ones(6), torch.arange(6), cfg)
    out.loss.backward()
    assert logp.grad is not None
    for i in range(6):
        if clipped[i]:
            assert logp.grad[i].item() == 0.0, i
        else:  # d(−A·r)/d logp = −A·r, over 6 tokens
            assert logp.grad[i].item() == pytest.approx(-adv[i].item() * ratios[i].item() / 6, rel=1e-5), i
    assert out.clip_frac_high == pytest.approx(1 / 6)  # ratio 1.35 > 1.3 with A > 0
    assert out.clip_frac_low == pytest.approx(1 / 6)  # ratio 0.85 < 0.9 with A < 0
    # a ratio inside (1 + 0.1, 1 + 0.3] would have been clipped by a symmetric 0.1 clip
    sym = policy_loss(leaf(old + ratios.log()), old, adv, torch.ones(6), torch.arange(6), LossConfig(0.1, 0.1))
    assert sym.clip_frac_high == pytest.approx(2 / 6)
    expected = sum(-a * (min(r, 1.3) if a > 0 else max(r, 0.9)) for r, a in zip(ratios.tolist(), adv.tolist())) / 6
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.ratio_min == pytest.approx(0.8, rel=1e-5) and out.ratio_max == pytest.approx(1.35, rel=1e-5)


def _random_microbatch(gen: torch.Generator, lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    """One sequence per row, `lengths[i]` completion tokens then padding."""
    rows = len(lengths)
    mask = torch.zeros(rows, width)
    seq = torch.full((rows, width), -1)
    adv = torch.zeros(rows, width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
        seq[i, :n] = i
        adv[i, :n] = torch.randn(1, generator=gen).item()
    old = -torch.rand(rows, width, generator=gen) * 3
    logp = old + 0.3 * torch.randn(rows, width, generator=gen)  # some ratios get clipped
    ref = old + 0.2 * torch.randn(rows, width, generator=gen)
    sampler = old + 0.2 * torch.randn(rows, width, generator=gen)
    return {"logp": logp, "old": old, "adv": adv, "mask": mask, "seq": seq, "ref": ref, "sampler": sampler}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_accumulation_over_microbatches_equals_one_batch(aggregation: Aggregation) -> None:
    gen = torch.Generator().manual_seed(0)
    cfg = LossConfig(aggregation=aggregation, max_completion_tokens=8, kl_beta=0.1, tis_cap=2.0)
    a = _random_microbatch(gen, [3, 7], 8)
    b = _random_microbatch(gen, [1, 5, 8], 8)
    n_tokens = float(a["mask"].sum() + b["mask"].sum())
    n_seqs = 5

    whole = {k: torch.cat([a[k], b[k] + (2 if k == "seq" else 0) * (b[k] >= 0)]) for k in a}
    logp_whole = leaf(whole["logp"])
    policy_loss(
        logp_whole,
        whole["old"],
        whole["adv"],
        whole["mask"],
        whole["seq"],
        cfg,
        ref_logprobs=whole["ref"],
    ).loss.backward()

    params = leaf(whole["logp"])  # one parameter tensor, sliced into the two micro-batches
    total = 0.0
    for part, rows in ((a, slice(0, 2)), (b, slice(2, 5))):
        out = policy_loss(
            params[rows],
            part["old"],
            part["adv"],
            part["mask"],
            part["seq"],
            cfg,
            num_tokens_in_step=n_tokens,
            num_seqs_in_step=n_seqs,
            ref_logprobs=part["ref"],
        )
        out.loss.backward()
        total += out.loss.item()
    assert logp_whole.grad is not None and params.grad is not None
    torch.testing.assert_close(params.grad, logp_whole.grad, atol=1e-7, rtol=1e-5)
    whole_loss = policy_loss(
        whole["logp"],
        whole["old"],
        whole["adv"],
        whole["mask"],
        whole["seq"],
        cfg,
        ref_logprobs=whole["ref"],
    ).loss.item()
    assert total == pytest.approx(whole_loss, rel=1e-5)


def test_without_step_normaliser_microbatch_means_are_biased() -> None:
    """The reason for `num_tokens_in_step`: averaging per-micro-batch token means is not the step mean."""
    adv = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    seq = torch.tensor([[0, -1, -1, -1], [0, 0, 0, 0]])
    logp = torch.zeros(2, 4)
    cfg = LossConfig()
    local = [
        policy_loss(logp[i : i + 1], logp[i : i + 1], adv[i : i + 1], mask[i : i + 1], seq[i : i + 1], cfg).loss.item() for i in range(2)
    ]
    step = [
        policy_loss(
            logp[i : i + 1], logp[i : i + 1], adv[i : i + 1], mask[i : i + 1], seq[i : i + 1], cfg, num_tokens_in_step=5
        ).loss.item()
        for i in range(2)
    ]
    assert sum(local) / 2 == pytest.approx(-1.5)
    assert sum(step) == pytest.approx(-9 / 5)


def test_aggregation_modes_weigh_tokens_as_documented() -> None:
    """Two sequences, 1 and 3 completion tokens, ratio 1, same advantage A: the per-token
    gradient is −A/N_tokens (token_mean), −A/(N_seqs·len) (seq_mean_token_mean) and
    −A/(N_seqs·max_completion_tokens) (Dr.GRPO), and Dr.GRPO = token_mean·N_tok/(M·N_seqs)."""
    A, M = 1.5, 8
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    seq = torch.tensor([[0, -1, -1], [1, 1, 1]])
    adv = A * mask
    grads: dict[str, torch.Tensor] = {}
    losses: dict[str, float] = {}
    for agg in AGGREGATIONS:
        logp = leaf(torch.full((2, 3), -1.0))
        out = policy_loss(logp, logp.detach(), adv, mask, seq, LossConfig(aggregation=agg, max_completion_tokens=M))
        out.loss.backward()
        assert logp.grad is not None
        grads[agg], losses[agg] = logp.grad * mask, out.loss.item()
    torch.testing.assert_close(grads["token_mean"], -A / 4 * mask)
    torch.testing.assert_close(grads["seq_mean_token_mean"], -A * torch.tensor([[1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))
    torch.testing.assert_close(grads["seq_mean_token_sum_norm"], -A / (2 * M) * mask)
    assert losses["seq_mean_token_sum_norm"] == pytest.approx(losses["token_mean"] * 4 / (M * 2))
    assert losses["seq_mean_token_sum_norm"] != pytest.approx(losses["token_mean"])


def test_kl_term_is_zero_when_reference_equals_policy() -> None:
    gen = torch.Generator().manual_seed(1)
    mb = _random_microbatch(gen, [4, 2], 4)
    cfg_kl = LossConfig(kl_beta=0.5)
    logp_a, logp_b = leaf(mb["logp"]), leaf(mb["logp"])
    with_kl = policy_loss(logp_a, mb["old"], mb["adv"], mb["mask"], mb["seq"], cfg_kl, ref_logprobs=mb["logp"])
    without = policy_loss(logp_b, mb["old"], mb["adv"], mb["mask"], mb["seq"], LossConfig())
    with_kl.loss.backward()
    without.loss.backward()
    assert with_kl.kl_mean == pytest.approx(0.0, abs=1e-7)
    assert with_kl.loss.item() == pytest.approx(without.loss.item(), abs=1e-7)
    torch.testing.assert_close(logp_a.grad, logp_b.grad)
    # and positive, pulling towards the reference, when they differ
    other = policy_loss(leaf(mb["logp"]), mb["old"], mb["adv"], mb["mask"], mb["seq"], cfg_kl, ref_logprobs=mb["ref"])
    assert other.kl_mean is not None and other.kl_mean > 0
    assert other.loss.item() > without.loss.item()


def test_kl_k3_value_and_off_by_default() -> None:
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    mask = torch.ones(2)
    out = policy_loss(logp, logp, torch.zeros(2), mask, torch.arange(2), LossConfig(), ref_logprobs=ref)
    d = (ref - logp).tolist()
    assert out.kl_mean == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 2, rel=1e-6)
    assert out.loss.item() == pytest.approx(0.0)  # beta = 0: stat only
    with pytest.raises(ValueError, match="kl_beta > 0 needs ref_logprobs"):
        policy_loss(logp, logp, torch.zeros(2), mask, torch.arange(2), LossConfig(kl_beta=0.1))


def test_tis_cap_is_decoupled_ppo_with_a_truncated_weight_and_reports_what_it_did() -> None:
    cap = 2.0
    current = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    behaviour = torch.tensor([-1.0, -1.5, -4.0, -0.5])  # weights exp(current − behaviour): 1, 1.65, 20, 0.61
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0])
    mask = torch.ones(4)
    logp = leaf(current)
    out = policy_loss(logp, behaviour, adv, mask, torch.arange(4), LossConfig(tis_cap=cap))
    out.loss.backward()
    weights = torch.exp(current - behaviour).clamp(max=cap)
    assert weights[2].item() == cap
    assert out.loss.item() == pytest.approx(-(adv * weights).mean().item(), rel=1e-6)
    assert out.tis_weight_mean == pytest.approx(weights.mean().item(), rel=1e-6)
    assert out.tis_capped_frac == pytest.approx(0.25)  # only the third token's weight hit the cap
    assert logp.grad is not None  # the weight is detached: the gradient is the weighted PG gradient
    torch.testing.assert_close(logp.grad, -(adv * weights) / 4)
    # the ratio the metrics report is current over behaviour (uncapped), in both modes
    assert out.ratio_max == pytest.approx(math.exp(3.0), rel=1e-6)
    assert out.logprob_diff_max == pytest.approx(3.0)
    assert out.logprob_diff_mean == pytest.approx((0 + 0.5 + 3 + 0.5) / 4)
    # the clip never binds in this mode, so no clip fraction is reported (it would always read 0)
    assert out.clip_frac_low is None and out.clip_frac_high is None
    assert "clip_frac_high" not in out.metrics() and "tis_capped_frac" in out.metrics()
    # plain PPO on the same tokens clips the third (A > 0, r = 20 > 1 + ε_high): no gradient there
    ppo_logp = leaf(current)
    ppo = policy_loss(ppo_logp, behaviour, adv, mask, torch.arange(4), LossConfig())
    ppo.loss.backward()
    assert ppo_logp.grad is not None and ppo_logp.grad[2].item() == 0.0 and logp.grad[2].item() < 0.0
    assert ppo.clip_frac_high == pytest.approx(0.5)  # tokens 1 (r 1.65) and 2 (r 20)
    assert ppo.tis_weight_mean is None and ppo.tis_capped_frac is None


def test_masked_positions_cannot_poison_loss_or_gradient() -> None:
    logp = leaf([[-1.0, -1.0, 50.0, float("nan")]])
    old = torch.tensor([[-1.2, -0.9, -900.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    seq = torch.tensor([[0, 0, -1, -1]])
    for agg in AGGREGATIONS:
        logp.grad = None
        out = policy_loss(
            logp,
            old,
            adv,
            mask,
            seq,
            LossConfig(aggregation=agg, max_completion_tokens=4),
            ref_logprobs=old,
            entropy=torch.tensor([[1.0, 3.0, float("inf"), 0.0]]),
        )
        out.loss.backward()
        assert math.isfinite(out.loss.item())
        assert logp.grad is not None and torch.isfinite(logp.grad).all()
        assert (logp.grad[0, 2:] == 0).all()
        assert all(math.isfinite(v) for v in out.metrics().values())
        assert out.entropy_mean == pytest.approx(2.0)


def test_empty_microbatch_is_a_zero_loss_with_a_graph() -> None:
    logp = leaf(torch.zeros(1, 3))
    out = policy_loss(logp, logp.detach(), torch.zeros(1, 3), torch.zeros(1, 3), torch.full((1, 3), -1), LossConfig())
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.num_tokens == 0 and out.ratio_mean == 1.0


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="loss.max_completion_tokens"):
        LossConfig(aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="loss.aggregation"):
        LossConfig(aggregation="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss.tis_cap"):
        LossConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="loss.clip_eps_low"):
        LossConfig(clip_eps_low=1.0)
