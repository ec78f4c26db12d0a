"""Dual-clip PPO (`algorithm.clip_ratio_c`): a token with a negative advantage loses at most −A·c
however far its ratio has run away, with no gradient there; inside the band nothing changes;
`clip_frac_dual` counts the bound tokens; off (None / 0) is the plain clipped loss; the key is
validated and stays off across a run directory's config.toml."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from relayrl.algorithms.losses import LossConfig, LossOutput, policy_loss
from relayrl.config.schema import Config, ConfigError, load_config
from support.simutil import make_program, run_checked, sim_config

torch.set_num_threads(1)

EPS_LOW, EPS_HIGH, C = 0.2, 0.28, 3.0
# (advantage, log ratio) per token, on the loss mask; what each one exercises
TOKENS = [
    (-1.0, 15.0),  # runaway token, A < 0: the dual clip bounds it at −A·c
    (-2.0, math.log(2.0)),  # A < 0, 1 + ε_high < r < c: plain PPO, the dual clip does not bind
    (1.0, math.log(1.1)),  # inside the band
    (-1.0, math.log(0.9)),  # inside the band
    (1.5, 15.0),  # A > 0 and r huge: clipped at 1 + ε_high as before (not a dual-clip token)
    (-0.5, math.log(0.5)),  # A < 0, r < 1 − ε_low: clipped low as before
    (-1.0, math.log(3.5)),  # A < 0, r just above c: bound
]
DUAL = [0, 6]  # where the dual clip binds


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens above plus one masked token (A < 0, log ratio 15) that must count for nothing."""
    adv = torch.tensor([a for a, _ in TOKENS] + [-5.0])
    log_ratio = torch.tensor([lr for _, lr in TOKENS] + [15.0])
    old = torch.full_like(adv, -20.0)
    mask = torch.tensor([1.0] * len(TOKENS) + [0.0])
    seq = torch.tensor(list(range(len(TOKENS))) + [-1])
    return old + log_ratio, old, adv, mask, seq


def _loss(c: float | None, **kw: object) -> tuple[LossOutput, torch.Tensor]:
    logp0, old, adv, mask, seq = _batch()
    logp = logp0.clone().requires_grad_(True)
    out = policy_loss(logp, old, adv, mask, seq, LossConfig(EPS_LOW, EPS_HIGH, clip_ratio_c=c, **kw))  # type: ignore[arg-type]
    out.loss.backward()
    assert logp.grad is not None
    return out, logp.grad


def _plain_ppo(a: float, r: float) -> float:
    return max(-a * r, -a * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH))


def test_a_runaway_negative_advantage_token_contributes_exactly_minus_a_c_with_no_gradient() -> None:
    logp = torch.tensor([5.0], requires_grad=True)  # log ratio 15 against the sampler's -10
    out = policy_loss(logp, torch.tensor([-10.0]), torch.tensor([-1.0]), torch.ones(1), torch.zeros(1), LossConfig(clip_ratio_c=C))
    out.loss.backward()
    assert out.loss.item() == C  # −A·c, exactly
    assert logp.grad is not None and logp.grad.item() == 0.0
    assert out.clip_frac_dual == 1.0
    # without the bound the same token adds −A·e^15 ≈ 3.3e6 and a gradient as large
    plain = torch.tensor([5.0], requires_grad=True)
    off = policy_loss(plain, torch.tensor([-10.0]), torch.tensor([-1.0]), torch.ones(1), torch.zeros(1), LossConfig(clip_ratio_c=None))
    off.loss.backward()
    assert off.loss.item() == pytest.approx(math.exp(15.0), rel=1e-5) and plain.grad is not None and plain.grad.item() > 3e6


def test_dual_clip_on_a_hand_made_batch() -> None:
    out, grad = _loss(C)
    n = len(TOKENS)
    per_token = []
    for i, (a, lr) in enumerate(TOKENS):
        r = math.exp(lr)
        per_token.append(-a * C if i in DUAL else _plain_ppo(a, r))
    assert out.loss.item() == pytest.approx(sum(per_token) / n, rel=1e-6)
    for i, (a, lr) in enumerate(TOKENS):
        r = math.exp(lr)
        bound_or_clipped = i in DUAL or _plain_ppo(a, r) != -a * r
        expected = 0.0 if bound_or_clipped else -a * r / n
        assert grad[i].item() == pytest.approx(expected, rel=1e-5, abs=1e-12), i
    assert grad[-1].item() == 0.0  # masked
    assert out.clip_frac_dual == pytest.approx(len(DUAL) / n)  # over the loss tokens, as the others
    assert out.clip_frac_low == pytest.approx(1 / n) and out.clip_frac_high == pytest.approx(1 / n)
    assert out.metrics()["clip_frac_dual"] == out.clip_frac_dual


def test_off_reproduces_the_plain_clipped_loss_and_inside_the_band_nothing_changes() -> None:
    on, grad_on = _loss(C)
    off, grad_off = _loss(None)
    n = len(TOKENS)
    expected_off = sum(_plain_ppo(a, math.exp(lr)) for a, lr in TOKENS) / n
    assert off.loss.item() == pytest.approx(expected_off, rel=1e-6)
    assert off.clip_frac_dual is None and "clip_frac_dual" not in off.metrics()
    assert off.clip_frac_low == on.clip_frac_low and off.clip_frac_high == on.clip_frac_high
    inside = [i for i in range(n) if i not in DUAL]
    assert torch.equal(grad_on[inside], grad_off[inside])  # tokens the bound does not touch: unchanged
    assert grad_off[DUAL[0]].item() > 1e5  # the runaway token's gradient without the bound
    # a batch where no negative-advantage ratio exceeds c: identical with and without it
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 16, generator=gen) * 3
    logp = old + 0.4 * torch.randn(4, 16, generator=gen)
    adv = torch.randn(4, 16, generator=gen)
    mask, seq = torch.ones(4, 16), torch.arange(4).repeat_interleave(16).reshape(4, 16)
    a = policy_loss(logp, old, adv, mask, seq, LossConfig(clip_ratio_c=C))
    b = policy_loss(logp, old, adv, mask, seq, LossConfig(clip_ratio_c=None))
    assert torch.exp(logp - old)[adv < 0].max() < C
    assert a.loss.item() == b.loss.item() and a.clip_frac_dual == 0.0


def test_decoupled_mode_applies_it_to_the_ppo_ratio_where_it_never_binds() -> None:
    """With tis_cap the PPO ratio is current / proximal (1 in value): the dual clip is applied to
    it and never binds; the truncated IS weight is what bounds the runaway token."""
    on, grad_on = _loss(C, tis_cap=2.0)
    off, grad_off = _loss(None, tis_cap=2.0)
    assert on.loss.item() == off.loss.item() and torch.equal(grad_on, grad_off)
    assert on.clip_frac_dual is None and on.clip_frac_low is None  # clip fractions are not reported in this mode
    weights = [min(math.exp(lr), 2.0) for _, lr in TOKENS]
    assert on.loss.item() == pytest.approx(sum(-a * w for (a, _), w in zip(TOKENS, weights, strict=True)) / len(TOKENS), rel=1e-6)


def test_loss_config_validates_the_bound() -> None:
    for bad in (1.0, 0.5, 0.0, -3.0):
        with pytest.raises(ValueError, match="loss.clip_ratio_c must be > 1"):
            LossConfig(clip_ratio_c=bad)
    assert LossConfig().clip_ratio_c == 3.0 and LossConfig(clip_ratio_c=None).clip_ratio_c is None


@pytest.mark.parametrize("value", ["1", "1.0", "0.5", "-2"])
def test_a_bound_of_at_most_one_is_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid config key 'algorithm.clip_ratio_c' \(from --set\): must be > 1"):
        load_config(None, [f"algorithm.clip_ratio_c={value}"])


def test_zero_and_none_turn_it_off() -> None:
    assert load_config(None, []).algorithm.clip_ratio_c == 3.0  # on by default, as verl
    assert load_config(None, ["algorithm.clip_ratio_c=0"]).algorithm.clip_ratio_c == 0.0
    assert load_config(None, ["algorithm.clip_ratio_c=5"]).algorithm.clip_ratio_c == 5.0
    assert Config.model_validate({"algorithm": {"clip_ratio_c": None}}).algorithm.clip_ratio_c == 0.0
    from relayrl.backends.local.build import make_trainer
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir

    model, _ = load_model_and_tokenizer(shipped_model_dir())
    for overrides, expected in ((["algorithm.clip_ratio_c=0"], None), ([], 3.0)):
        cfg = load_config(None, ["run.backend=local", *overrides])
        assert make_trainer(cfg, model, 1).settings.loss.clip_ratio_c == expected


def test_off_survives_the_run_directory_config_toml(tmp_path: Path) -> None:
    """config.toml has no null (config_to_toml drops None values): off is written as 0.0 and a
    resume, which reads config.toml, gets it off again, not back at the default."""
    cfg = sim_config("run.steps=1")
    cfg.algorithm.clip_ratio_c = None  # the Python API's "off"
    assert cfg.algorithm.clip_ratio_c == 0.0
    run_checked(make_program(cfg, tmp_path))
    text = (tmp_path / "run" / "config.toml").read_text()
    assert "clip_ratio_c = 0.0" in text
    assert load_config(tmp_path / "run" / "config.toml").algorithm.clip_ratio_c == 0.0
