"""The policy loss the trainer minimises, on per-token tensors (pure torch, any shape).

Job: turn per-token log-probs of the current policy, the behaviour log-probs, advantages and a
loss mask into one scalar loss plus detached statistics.

Invariant: only positions with `loss_mask > 0` (completion tokens) contribute to the loss, its
gradient or any statistic — whatever finite or non-finite values the other positions hold — and
with explicit step normalisers (`num_tokens_in_step`, `num_seqs_in_step`) the sum of the losses
of a step's micro-batches equals the loss of the whole step computed at once, so accumulating
gradients over micro-batches is exact (per-sequence quantities are exact too: a sequence's tokens
are always in one call) — except under `top_entropy_quantile` < 1, whose threshold is each call's
own (TRL's is its forward batch's).

Per completion token t of sequence s, with advantage A, the current policy's log-prob logp and the
behaviour policy's `old_logp` (the sampler's, which drew the token), one objective in three modes:

- `tis_cap` unset — clipped PPO against the behaviour policy (DAPO clip-higher), dual-clipped:
      r_t   = exp(logp − old_logp)
      pg_t  = max(−A·r_t, −A·clip(r_t, 1 − ε_low, 1 + ε_high))
      pg_t  = min(pg_t, −A·c)   where A < 0                    (dual-clip; `clip_ratio_c` = c > 1)
  The trust region is around the policy that sampled: staleness and any sampler/trainer mismatch
  both move r away from 1, and the clip acts on them. For A > 0 the clip bounds the loss (r is
  capped at 1 + ε_high), but for A < 0 nothing bounds r from above: one token the policy now finds
  e^15 times likelier than the sampler did would add −A·e^15 and, after gradient-norm clipping,
  set the direction of the whole step. Dual-clip PPO (Ye et al., 2020; verl's `clip_ratio_c`)
  caps a negative-advantage token's loss at −A·c: beyond r = c it is constant, with zero
  gradient (`clip_frac_dual` counts such tokens). c = None turns it off.
- `tis_cap` set — decoupled PPO (Hilton et al., 2021) with the proximal policy π_prox = the
  trainer's policy at the start of the step (logp, detached) and a truncated importance weight
  from the behaviour policy to it:
      r_t   = exp(logp − logp.detach())            (1 in value; its gradient is ∇logp)
      w_t   = min(exp(logp.detach() − old_logp), tis_cap), detached
      pg_t  = max(−A·r_t, −A·clip(r_t, 1 − ε_low, 1 + ε_high))
      pg_t  = min(pg_t, −A·c)   where A < 0                    (dual-clip, on the PPO ratio r_t)
      pg_t  = pg_t · w_t
  On a step's first update r_t = 1 where the gradient is taken and neither clip binds: the
  gradient is the truncated-IS policy gradient −A·w_t·∇logp, correcting staleness and the
  sampler/trainer mismatch with a bounded weight (≤ tis_cap) instead of a clip — the weight is
  what bounds a wild token here. Clip fractions (dual-clip's too) are therefore not reported in
  this mode (they would read 0); `tis_weight_mean` and `tis_capped_frac` say what the weight did.
  With several updates per step (`train.ppo_epochs`, `train.minibatches_per_step`) the updates
  after the first pass `prox_logprobs`, the policy's log-probs before the step's first update:
  logp.detach() above is replaced by them, so r_t moves away from 1, the clip binds and its
  fractions are reported (against π_prox).
- `ratio_level = "sequence"` — GSPO (Zheng et al., 2025; verl's `loss_mode = "gspo"`, TRL's
  `importance_sampling_level = "sequence"`): one length-normalised importance ratio per sequence,
  clipped per sequence, in the token-level gradient form of the paper's GSPO-token:
      s_i   = exp((1/|y_i|)·Σ_{t∈i} (logp_t − old_logp_t))          (eq. for s_i(θ))
      r_t   = sg[s_i] · π_t / sg[π_t]                               (value s_i, gradient s_i·∇logp_t)
      pg_t  = max(−A·r_t, −A·clip(r_t, 1 − ε_low, 1 + ε_high)), dual-clip as above
  with `clip_eps_low` / `clip_eps_high` (and `clip_ratio_c`) acting on s_i: GSPO's ranges are
  tiny (the paper: 3e-4 / 4e-4), because s_i is a geometric mean over the sequence. With the
  "seq_mean_token_mean" aggregation (required) and one advantage per sequence this is exactly
  GSPO's objective (1/G)Σ_i min(s_i·A_i, clip(s_i)·A_i) and its gradient; a sequence's tokens are
  always in one call (`seq_index`; the packer never splits a trajectory across micro-batches).
  Only against the behaviour policy: `tis_cap` is refused with it. `seq_ratio_min` / `_max`
  report s_i; the clip fractions are then shares of tokens whose sequence was clipped. Where A
  varies within a sequence (kl_in_reward, per-turn credit) this is GSPO-token with per-token A_t.

In every mode `ratio_*` is exp(logp − old_logp), the current policy over the behaviour policy.

Entropy-quantile masking (`top_entropy_quantile` = ρ < 1; TRL's option, Wang et al. 2025 "Beyond
the 80/20 rule"): only the tokens whose entropy H_t is at least the (1 − ρ)-quantile of the
entropies of this call's (the micro-batch's) loss tokens keep pg_t (TRL takes the quantile over
the whole forward batch's completion tokens, as here; `torch.quantile`, linear interpolation);
the others get pg_t = 0 but still count in the normaliser and keep their KL and entropy terms.
`entropy_masked_frac` is the share of loss tokens masked.

KL to the frozen reference (`kl_beta` = β > 0), with d_t = logp − ref and one of Schulman's
estimators (`kl_estimator`; "Approximating KL divergence", 2020):

    k1_t = d_t        k2_t = ½·d_t²        k3_t = exp(−d_t) + d_t − 1 (default)

each clamped to [−kl_clamp, kl_clamp] (`kl_clamp`, default 10, as verl's low_var_kl and
OpenRLHF's compute_approx_kl; TRL does not clamp; None = off): unclamped, k3 reaches e^20 ≈ 4.9e8
at d = −20 and one outlier token dominates a step. A clamped token's KL has no gradient.

and either a loss term (default) or, with `kl_in_reward`, a per-token reward penalty (OpenRLHF's
and verl's `use_kl_in_reward`): the advantage becomes the undiscounted return-to-go of the
detached penalty,

    A_t ← A_t − β·Σ_{t' ≥ t, t' ∈ s} sg[kl_t']                         (no KL loss term)

over the sequence's loss tokens, in their order in the call (completion order), with kl_t' taken
at the step's proximal policy (the current one on the step's first update; with several updates
per step the policy before the first, so the penalty, like a reward, stays fixed across the
step's updates). `kl_reward_penalty_mean` is the mean of β·Σ_{t'≥t} kl_t' subtracted. With
advantage = "reinforce_pp" this is REINFORCE++'s penalty, with one difference from OpenRLHF:
the rewards are whitened over the step per sequence before the penalty is taken off, where
OpenRLHF whitens the per-token returns after it (the KL part is left unnormalised here).

    ℓ_t   = pg_t + β·kl_t·[not kl_in_reward] − c_H·H_t                     (c_H = `entropy_coef`)

The entropy bonus −c_H·H_t needs an `entropy` tensor that carries the gradient (the trainer
computes one when `entropy_coef` > 0; otherwise its entropy is a detached statistic).

Aggregation (`LossConfig.aggregation`):
- "token_mean" (default): Σ_t ℓ_t / num_tokens_in_step — every completion token of the step
  weighs the same (DAPO token-level loss).
- "seq_mean_token_mean": Σ_s (mean of ℓ_t over s's tokens) / num_seqs_in_step — every sequence
  weighs the same, so a token of a short sequence weighs more (original GRPO).
- "seq_mean_token_sum_norm": Σ_t ℓ_t / (max_completion_tokens · num_seqs_in_step) — Dr.GRPO:
  a constant normaliser, so every token weighs the same whatever its sequence's length, and the
  loss equals token_mean × num_tokens / (max_completion_tokens · num_seqs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[Aggregation, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS: tuple[RatioLevel, ...] = ("token", "sequence")
KlEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[KlEstimator, ...] = ("k1", "k2", "k3")

# statistics a call reports only when they apply (see LossOutput)
OPTIONAL_STATS = (
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac_dual",
    "entropy_mean",
    "kl_mean",
    "tis_weight_mean",
    "tis_capped_frac",
    "seq_ratio_min",
    "seq_ratio_max",
    "entropy_masked_frac",
    "kl_reward_penalty_mean",
)
# |log ratio| beyond this is clamped before exp so a wild token cannot overflow to inf.
MAX_LOG_RATIO = 20.0


@dataclass(slots=True)
class LossConfig:
    """Policy-loss settings.

    - `clip_eps_low` / `clip_eps_high`: the ratio is clipped to [1 − low, 1 + high]; a larger
      `high` (DAPO clip-higher) lets unlikely tokens with positive advantage grow faster.
    - `aggregation`: see the module docstring.
    - `max_completion_tokens`: the constant normaliser of "seq_mean_token_sum_norm" (required
      there; usually the sampler's max new tokens).
    - `kl_beta`: weight of the KL estimate to a frozen reference policy; 0 turns it off.
    - `kl_estimator`: "k1", "k2" or "k3" (default); `kl_in_reward`: the KL as a per-token reward
      penalty folded into the advantage (return-to-go) instead of a loss term (needs kl_beta > 0);
      `kl_clamp`: each token's estimate is clamped to ±kl_clamp (default 10; None = off).
    - `tis_cap`: None = clipped PPO against the behaviour policy; a cap = decoupled PPO with a
      truncated importance weight min(π_prox / π_behaviour, tis_cap) (see the module docstring).
      Only the policy-gradient term is weighted, not the KL term.
    - `clip_ratio_c`: dual-clip bound c (> 1): a token with A < 0 loses at most −A·c; None = off.
      Applied to the PPO ratio in both modes (see the module docstring).
    - `ratio_level`: "token" (PPO) or "sequence" (GSPO: needs aggregation "seq_mean_token_mean"
      and no `tis_cap`).
    - `entropy_coef`: weight c_H >= 0 of the entropy bonus −c_H·H_t; 0 = off.
    - `top_entropy_quantile`: ρ in (0, 1]: only the loss tokens in the top-ρ entropy quantile of
      the call keep their policy-gradient term; 1 = off.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    aggregation: Aggregation = "token_mean"
    max_completion_tokens: int | None = None
    kl_beta: float = 0.0
    tis_cap: float | None = None
    clip_ratio_c: float | None = 3.0
    ratio_level: RatioLevel = "token"
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    kl_estimator: KlEstimator = "k3"
    kl_in_reward: bool = False
    kl_clamp: float | None = 10.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise ValueError(f"loss.clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high < 0.0:
            raise ValueError(f"loss.clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.aggregation == "seq_mean_token_sum_norm" and (self.max_completion_tokens is None or self.max_completion_tokens < 1):
            raise ValueError(
                "loss.max_completion_tokens must be a positive int with "
                f"aggregation='seq_mean_token_sum_norm', got {self.max_completion_tokens}"
            )
        if self.kl_beta < 0.0:
            raise ValueError(f"loss.kl_beta must be >= 0, got {self.kl_beta}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"loss.tis_cap must be > 0 or unset, got {self.tis_cap}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"loss.clip_ratio_c must be > 1 or unset (dual-clip off), got {self.clip_ratio_c}")
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"loss.ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        if self.ratio_level == "sequence" and self.tis_cap is not None:
            raise ValueError("loss.ratio_level = 'sequence' (GSPO) clips against the behaviour policy: loss.tis_cap must be unset")
        if self.ratio_level == "sequence" and self.aggregation != "seq_mean_token_mean":
            raise ValueError(f"loss.ratio_level = 'sequence' (GSPO) needs aggregation 'seq_mean_token_mean', got {self.aggregation!r}")
        if not self.entropy_coef >= 0.0:
            raise ValueError(f"loss.entropy_coef must be >= 0, got {self.entropy_coef}")
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"loss.top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_clamp is not None and not self.kl_clamp > 0.0:
            raise ValueError(f"loss.kl_clamp must be > 0 or unset (no clamp), got {self.kl_clamp}")
        if self.kl_in_reward and not self.kl_beta > 0.0:
            raise ValueError(f"loss.kl_in_reward needs loss.kl_beta > 0, got {self.kl_beta}")


@dataclass(slots=True)
class LossOutput:
    """The scalar loss (with graph) and detached statistics over this call's loss tokens.

    Means are over `num_tokens` tokens: to combine micro-batches, weight them by `num_tokens`;
    combine `*_min` / `*_max` with min / max. With no loss token, ratios read 1 and diffs 0.
    - `logprob_diff_mean` / `_max`: |current trainer log-prob − behaviour (sampler) log-prob|.
    - `ratio_*`: exp(logp − old_logp), the current policy over the behaviour policy.
    - `clip_frac_low`: share of tokens with A < 0 and r < 1 − ε_low (clipped: no gradient);
      `clip_frac_high`: A > 0 and r > 1 + ε_high, r the clipped ratio. PPO mode, or with
      `tis_cap` given `prox_logprobs` (else None: r = 1 there).
    - `clip_frac_dual`: share of tokens with A < 0 and r > c, where the dual clip bounds the loss
      at −A·c (no gradient). With `clip_ratio_c`, where clip fractions are reported (else None).
    - `tis_weight_mean`: mean truncated-IS weight; `tis_capped_frac`: share of tokens whose
      weight the cap bound. With `tis_cap` only (else None).
    - `entropy_mean`: mean of the given per-token entropy; None when not given.
    - `kl_mean`: mean KL estimate (`kl_estimator`) to the reference; None when no `ref_logprobs`
      were given.
    - `seq_ratio_min` / `_max`: GSPO's per-sequence ratio s_i (ratio_level "sequence" only).
    - `entropy_masked_frac`: share of loss tokens whose policy-gradient term the entropy quantile
      masked (top_entropy_quantile < 1 only).
    - `kl_reward_penalty_mean`: mean β·Σ_{t'≥t} kl_t' taken off the advantages (kl_in_reward only).
    """

    loss: torch.Tensor
    num_tokens: int
    loss_value: float  # `loss` as a float, read with the statistics
    logprob_diff_mean: float
    logprob_diff_max: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    clip_frac_low: float | None = None
    clip_frac_high: float | None = None
    clip_frac_dual: float | None = None
    entropy_mean: float | None = None
    kl_mean: float | None = None
    tis_weight_mean: float | None = None
    tis_capped_frac: float | None = None
    seq_ratio_min: float | None = None
    seq_ratio_max: float | None = None
    entropy_masked_frac: float | None = None
    kl_reward_penalty_mean: float | None = None

    def metrics(self) -> dict[str, float]:
        """Flat metrics (detached floats); optional statistics only when present."""
        out: dict[str, float] = {
            "loss": self.loss_value,
            "num_loss_tokens": float(self.num_tokens),
            "logprob_diff_mean": self.logprob_diff_mean,
            "logprob_diff_max": self.logprob_diff_max,
            "ratio_mean": self.ratio_mean,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
        }
        for name in OPTIONAL_STATS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    cfg: LossConfig,
    *,
    num_tokens_in_step: float | None = None,
    num_seqs_in_step: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    prox_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """The policy loss of one micro-batch and its statistics, read from the device at once
    (`deferred_policy_loss(...).fetch()`; see there for the arguments)."""
    return deferred_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        seq_index,
        cfg,
        num_tokens_in_step=num_tokens_in_step,
        num_seqs_in_step=num_seqs_in_step,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        prox_logprobs=prox_logprobs,
    ).fetch()


@dataclass(slots=True)
class DeferredLoss:
    """A micro-batch's loss (with graph) whose statistics are still on the device: queue the
    backward pass of `loss` first, then `fetch()` reads the loss and every statistic with one host
    sync (so the device never idles waiting for the host between the forward and the backward)."""

    loss: torch.Tensor
    values: torch.Tensor  # float64: loss tokens, the five fixed statistics, the present optional ones
    present: tuple[bool, ...]  # per OPTIONAL_STATS: whether `values` holds it

    def fetch(self) -> LossOutput:
        """The statistics as floats; the loss read is `loss` as it is now (what was backpropagated)."""
        return self.fetch_with(())[0]

    def fetch_with(self, extra: Sequence[torch.Tensor]) -> tuple[LossOutput, list[float]]:
        """`fetch()` and the caller's own scalar tensors `extra` (on the loss's device), read in the
        same host sync."""
        parts = [self.loss.detach().reshape(1).to(torch.float64), *(t.detach().reshape(1).to(torch.float64) for t in extra)]
        values = torch.cat([*parts, self.values]).tolist()
        k = 1 + len(extra)
        own = values[k:]
        loss, n_tokens, fixed, rest = values[0], own[0], own[1:6], iter(own[6:])
        opt = {name: next(rest) if here else None for name, here in zip(OPTIONAL_STATS, self.present, strict=True)}
        out = LossOutput(
            loss=self.loss,
            num_tokens=int(n_tokens),
            loss_value=loss,
            logprob_diff_mean=fixed[0],
            logprob_diff_max=fixed[1],
            ratio_mean=fixed[2],
            ratio_min=fixed[3],
            ratio_max=fixed[4],
            **opt,
        )
        return out, values[1:k]


def deferred_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    cfg: LossConfig,
    *,
    num_tokens_in_step: float | None = None,
    num_seqs_in_step: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    prox_logprobs: torch.Tensor | None = None,
) -> DeferredLoss:
    """The policy loss of one micro-batch (see the module docstring for both modes), its
    statistics left on the device (`DeferredLoss`): in the default configuration nothing here
    reads the device (per-sequence aggregation, GSPO, an entropy quantile read it once or twice).

    All tensors share one shape. `logprobs` carries the gradient; `old_logprobs` are the
    behaviour policy's (the sampler's log-probs of the tokens it drew); `seq_index` names each
    token's sequence (>= 0 on loss tokens, unique per sequence within this call).
    `num_tokens_in_step` / `num_seqs_in_step` are the step-wide normalisers (completion tokens /
    sequences with at least one completion token, over all micro-batches of the step); when None
    this call's own counts are used, i.e. the micro-batch is the whole step. `prox_logprobs`
    (decoupled mode only): the proximal policy's log-probs when it is not the current policy (an
    update after the step's first); None = logprobs.detach().
    """
    shape = logprobs.shape
    for name, t in (
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
        ("seq_index", seq_index),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
        ("prox_logprobs", prox_logprobs),
    ):
        if t is not None and t.shape != shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")
    if cfg.kl_beta > 0 and ref_logprobs is None:
        raise ValueError("policy_loss: loss.kl_beta > 0 needs ref_logprobs")
    if cfg.top_entropy_quantile < 1.0 and entropy is None:
        raise ValueError("policy_loss: loss.top_entropy_quantile < 1 needs the per-token entropy")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("policy_loss: loss.entropy_coef > 0 needs the per-token entropy (with its gradient)")

    mask = loss_mask > 0
    n_tokens = mask.sum()  # on the device: read with the statistics
    any_tokens = n_tokens > 0
    per_sequence = cfg.aggregation != "token_mean" or cfg.ratio_level == "sequence" or cfg.kl_in_reward
    if per_sequence and bool((mask & (seq_index < 0)).any()):
        raise ValueError("policy_loss: seq_index must be >= 0 on every loss token")
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    behaviour = old_logprobs.detach().to(logprobs.dtype)
    decoupled = cfg.tis_cap is not None
    proximal = logprobs.detach() if prox_logprobs is None else prox_logprobs.detach().to(logprobs.dtype)
    anchor = proximal if decoupled else behaviour  # what the clipped ratio is taken against
    clip_stats = not decoupled or prox_logprobs is not None  # on the first update of decoupled PPO r = 1: no clip binds
    seq = torch.where(mask, seq_index, torch.zeros_like(seq_index)).reshape(-1).long()

    kl: torch.Tensor | None = None
    penalty: torch.Tensor | None = None
    if ref_logprobs is not None:
        d = torch.where(mask, logprobs - ref_logprobs.detach().to(logprobs.dtype), zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = _kl_estimate(d, cfg.kl_estimator, cfg.kl_clamp)
        if cfg.kl_in_reward:  # the KL of the step's proximal policy as a per-token reward: its return-to-go leaves the advantage
            kl_prox = kl.detach()  # the proximal policy is the current one (the step's first update)
            if prox_logprobs is not None:
                d_prox = torch.where(mask, proximal - ref_logprobs.detach().to(logprobs.dtype), zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
                kl_prox = _kl_estimate(d_prox, cfg.kl_estimator, cfg.kl_clamp)
            penalty = cfg.kl_beta * _suffix_sums(torch.where(mask, kl_prox, zero), seq).view(adv.shape)
            adv = torch.where(mask, adv - penalty, zero)

    # Masked positions get log-ratio 0 *before* exp, so garbage there cannot become inf/NaN in
    # the forward pass nor in the backward pass.
    log_ratio = torch.where(mask, logprobs - anchor, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_log_ratio: torch.Tensor | None = None
    if cfg.ratio_level == "sequence":  # GSPO: value sg[s_i], gradient s_i·∇logp_t
        seq_log_ratio = _seq_means(log_ratio.detach(), mask, seq).view(adv.shape)
        log_ratio = torch.where(mask, seq_log_ratio + (logprobs - logprobs.detach()), zero)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped_ratio)
    if cfg.clip_ratio_c is not None:  # dual-clip: for A < 0 the loss is at most −A·c
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.clip_ratio_c), pg)

    tis_weight: torch.Tensor | None = None
    uncapped: torch.Tensor | None = None
    if cfg.tis_cap is not None:
        log_w = torch.where(mask, anchor - behaviour, zero)
        uncapped = torch.exp(log_w.clamp(max=MAX_LOG_RATIO))
        tis_weight = uncapped.clamp(max=cfg.tis_cap).detach()
        pg = pg * tis_weight

    entropy_kept: torch.Tensor | None = None
    if cfg.top_entropy_quantile < 1.0 and entropy is not None:  # TRL: the top-ρ entropy tokens keep pg
        h = entropy.detach().to(torch.float32)
        entropy_kept = mask
        if bool(any_tokens):
            threshold = torch.quantile(h[mask], 1.0 - cfg.top_entropy_quantile)
            entropy_kept = mask & (h >= threshold)
        pg = torch.where(entropy_kept, pg, zero)

    per_token = pg
    if kl is not None and cfg.kl_beta > 0 and not cfg.kl_in_reward:
        per_token = per_token + cfg.kl_beta * kl
    if cfg.entropy_coef > 0 and entropy is not None:
        per_token = per_token - cfg.entropy_coef * torch.where(mask, entropy.to(logprobs.dtype), zero)

    per_token = torch.where(mask, per_token, zero)
    loss = _aggregate(per_token, mask, seq, cfg, num_tokens_in_step, num_seqs_in_step)

    # ---- detached statistics, fetched with one device sync ----
    with torch.no_grad():
        denom = n_tokens.clamp(min=1).to(logprobs.dtype)
        delta_b = torch.where(mask, logprobs.detach() - behaviour, zero)
        diff = delta_b.abs()
        r = torch.exp(delta_b.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # current over behaviour, both modes
        rc = ratio.detach()  # the ratio the clips acted on (= r per token; s_i under GSPO)
        one = torch.ones((), dtype=logprobs.dtype, device=logprobs.device)
        stats = [
            diff.sum() / denom,
            diff.max() if diff.numel() else zero,
            torch.where(any_tokens, torch.where(mask, r, zero).sum() / denom, one),
            torch.where(any_tokens, torch.where(mask, r, torch.full_like(r, torch.inf)).min(), one) if r.numel() else one,
            torch.where(any_tokens, torch.where(mask, r, torch.full_like(r, -torch.inf)).max(), one) if r.numel() else one,
        ]
        s_ratio = None if seq_log_ratio is None else torch.exp(seq_log_ratio)
        optional: list[torch.Tensor | None] = [
            None if not clip_stats else ((adv < 0) & (rc < 1.0 - cfg.clip_eps_low) & mask).sum() / denom,
            None if not clip_stats else ((adv > 0) & (rc > 1.0 + cfg.clip_eps_high) & mask).sum() / denom,
            None if not clip_stats or cfg.clip_ratio_c is None else ((adv < 0) & (rc > cfg.clip_ratio_c) & mask).sum() / denom,
            None if entropy is None else torch.where(mask, entropy.detach().to(logprobs.dtype), zero).sum() / denom,
            None if kl is None else torch.where(mask, kl.detach(), zero).sum() / denom,
            None if tis_weight is None else torch.where(mask, tis_weight, zero).sum() / denom,
            None if uncapped is None or cfg.tis_cap is None else ((uncapped > cfg.tis_cap) & mask).sum() / denom,
            None
            if s_ratio is None
            else torch.where(any_tokens, torch.where(mask, s_ratio, torch.full_like(s_ratio, torch.inf)).min(), one),
            None
            if s_ratio is None
            else torch.where(any_tokens, torch.where(mask, s_ratio, torch.full_like(s_ratio, -torch.inf)).max(), one),
            None if entropy_kept is None else (mask & ~entropy_kept).sum() / denom,
            None if penalty is None else torch.where(mask, penalty, zero).sum() / denom,
        ]
        present = [s for s in optional if s is not None]
        values = torch.stack([s.to(torch.float64) for s in [n_tokens, *stats, *present]])
    return DeferredLoss(loss=loss, values=values, present=tuple(s is not None for s in optional))


def _kl_estimate(d: torch.Tensor, estimator: KlEstimator, clamp: float | None = None) -> torch.Tensor:
    """Schulman's estimator of KL(π‖π_ref) per token from d = logp − ref, clamped to ±`clamp`
    (see the module docstring)."""
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.exp(-d) + d - 1.0
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def _seq_means(values: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Per position (flat), the mean of `values` over the loss tokens of its sequence (`seq`: the
    flat sequence index, 0 off the mask); 0 where the sequence has no loss token."""
    flat_mask = mask.reshape(-1).to(values.dtype)
    size = int(seq.max().item()) + 1 if seq.numel() else 1
    counts = torch.zeros(size, dtype=values.dtype, device=values.device).scatter_add_(0, seq, flat_mask)
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).scatter_add_(0, seq, values.reshape(-1) * flat_mask)
    return (sums / counts.clamp(min=1.0)).gather(0, seq)


def _suffix_sums(values: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Per position (flat), Σ of `values` (0 off the mask) over its own and its sequence's later
    positions, in flat order: the undiscounted return-to-go within each sequence."""
    flat = values.reshape(-1)
    if not flat.numel():
        return flat
    order = torch.sort(seq, stable=True).indices  # each sequence contiguous, its tokens in order
    ordered = flat[order]
    size = int(seq.max().item()) + 1
    totals = torch.zeros(size, dtype=flat.dtype, device=flat.device).scatter_add_(0, seq, flat)
    before = torch.cumsum(totals, 0) - totals  # Σ of the earlier sequences (in sorted order)
    prefix = torch.cumsum(ordered, 0) - ordered - before[seq[order]]  # within the sequence, exclusive
    out = torch.empty_like(flat)
    out[order] = totals[seq[order]] - prefix
    return out


def _aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    seq: torch.Tensor,
    cfg: LossConfig,
    num_tokens_in_step: float | None,
    num_seqs_in_step: float | None,
) -> torch.Tensor:
    """Reduce masked per-token losses (zero off the mask) to a scalar, per `cfg.aggregation`
    (`seq`: the flat sequence index, 0 off the mask)."""
    total = per_token.sum()
    if cfg.aggregation == "token_mean":
        n = float(mask.sum().item()) if num_tokens_in_step is None else float(num_tokens_in_step)
        return total / max(n, 1.0)

    size = int(seq.max().item()) + 1 if seq.numel() else 1
    counts = torch.zeros(size, dtype=per_token.dtype, device=per_token.device)
    counts.scatter_add_(0, seq, mask.reshape(-1).to(per_token.dtype))
    n_seqs = float((counts > 0).sum().item()) if num_seqs_in_step is None else float(num_seqs_in_step)
    n_seqs = max(n_seqs, 1.0)

    if cfg.aggregation == "seq_mean_token_sum_norm":
        assert cfg.max_completion_tokens is not None
        return total / (cfg.max_completion_tokens * n_seqs)

    sums = torch.zeros(size, dtype=per_token.dtype, device=per_token.device)
    sums = sums.scatter_add(0, seq, per_token.reshape(-1))
    seq_means = sums / counts.clamp(min=1.0)
    return seq_means.sum() / n_seqs
