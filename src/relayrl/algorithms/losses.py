"""The policy loss the trainer minimises, on per-token tensors (pure torch, any shape).

Job: turn per-token log-probs of the current policy, the behaviour log-probs, advantages and a
loss mask into one scalar loss plus detached statistics.

Invariant: only positions with `loss_mask > 0` (completion tokens) contribute to the loss, its
gradient or any statistic — whatever finite or non-finite values the other positions hold — and
with explicit step normalisers (`num_tokens_in_step`, `num_seqs_in_step`) the sum of the losses
of a step's micro-batches equals the loss of the whole step computed at once, so accumulating
gradients over micro-batches is exact.

Per completion token t of sequence s, with advantage A, the current policy's log-prob logp and the
behaviour policy's `old_logp` (the sampler's, which drew the token), one objective in two modes:

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

In both modes `ratio_*` is exp(logp − old_logp), the current policy over the behaviour policy, and

    kl_t  = exp(ref − logp) − (ref − logp) − 1                            (k3; only if beta > 0)
    ℓ_t   = pg_t + beta·kl_t

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

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[Aggregation, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

# statistics a call reports only when they apply (see LossOutput)
OPTIONAL_STATS = (
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac_dual",
    "entropy_mean",
    "kl_mean",
    "tis_weight_mean",
    "tis_capped_frac",
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
    - `kl_beta`: weight of the k3 KL estimate to a frozen reference policy; 0 turns it off.
    - `tis_cap`: None = clipped PPO against the behaviour policy; a cap = decoupled PPO with a
      truncated importance weight min(π_prox / π_behaviour, tis_cap) (see the module docstring).
      Only the policy-gradient term is weighted, not the KL term.
    - `clip_ratio_c`: dual-clip bound c (> 1): a token with A < 0 loses at most −A·c; None = off.
      Applied to the PPO ratio in both modes (see the module docstring).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    aggregation: Aggregation = "token_mean"
    max_completion_tokens: int | None = None
    kl_beta: float = 0.0
    tis_cap: float | None = None
    clip_ratio_c: float | None = 3.0

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
    - `kl_mean`: mean k3 KL to the reference; None when no `ref_logprobs` were given.
    """

    loss: torch.Tensor
    num_tokens: int
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

    def metrics(self) -> dict[str, float]:
        """Flat metrics (detached floats); optional statistics only when present."""
        out: dict[str, float] = {
            "loss": float(self.loss.detach().item()),
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
    """The policy loss of one micro-batch (see the module docstring for both modes).

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

    mask = loss_mask > 0
    n_tokens = int(mask.sum().item())
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    behaviour = old_logprobs.detach().to(logprobs.dtype)
    decoupled = cfg.tis_cap is not None
    proximal = logprobs.detach() if prox_logprobs is None else prox_logprobs.detach().to(logprobs.dtype)
    anchor = proximal if decoupled else behaviour  # what the clipped ratio is taken against
    clip_stats = not decoupled or prox_logprobs is not None  # on the first update of decoupled PPO r = 1: no clip binds

    # Masked positions get log-ratio 0 *before* exp, so garbage there cannot become inf/NaN in
    # the forward pass nor in the backward pass.
    log_ratio = torch.where(mask, logprobs - anchor, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
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

    per_token = pg
    kl: torch.Tensor | None = None
    if ref_logprobs is not None:
        delta = torch.where(mask, ref_logprobs.detach().to(logprobs.dtype) - logprobs, zero)
        delta = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = torch.exp(delta) - delta - 1.0
        if cfg.kl_beta > 0:
            per_token = per_token + cfg.kl_beta * kl

    per_token = torch.where(mask, per_token, zero)
    loss = _aggregate(per_token, mask, seq_index, cfg, num_tokens_in_step, num_seqs_in_step)

    # ---- detached statistics, fetched with one device sync ----
    with torch.no_grad():
        denom = max(n_tokens, 1)
        delta_b = torch.where(mask, logprobs.detach() - behaviour, zero)
        diff = delta_b.abs()
        r = torch.exp(delta_b.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # current over behaviour, both modes
        one = torch.ones((), dtype=logprobs.dtype, device=logprobs.device)
        stats = [
            diff.sum() / denom,
            diff.max() if diff.numel() else zero,
            torch.where(mask, r, zero).sum() / denom if n_tokens else one,
            torch.where(mask, r, torch.full_like(r, torch.inf)).min() if n_tokens else one,
            torch.where(mask, r, torch.full_like(r, -torch.inf)).max() if n_tokens else one,
        ]
        rc = ratio.detach()  # the clipped ratio (= r without tis_cap)
        optional: list[torch.Tensor | None] = [
            None if not clip_stats else ((adv < 0) & (rc < 1.0 - cfg.clip_eps_low) & mask).sum() / denom,
            None if not clip_stats else ((adv > 0) & (rc > 1.0 + cfg.clip_eps_high) & mask).sum() / denom,
            None if not clip_stats or cfg.clip_ratio_c is None else ((adv < 0) & (rc > cfg.clip_ratio_c) & mask).sum() / denom,
            None if entropy is None else torch.where(mask, entropy.detach().to(logprobs.dtype), zero).sum() / denom,
            None if kl is None else kl.detach().sum() / denom,
            None if tis_weight is None else torch.where(mask, tis_weight, zero).sum() / denom,
            None if uncapped is None or cfg.tis_cap is None else ((uncapped > cfg.tis_cap) & mask).sum() / denom,
        ]
        present = [s for s in optional if s is not None]
        values = torch.stack([s.to(torch.float64) for s in stats + present]).tolist()
    fixed, rest = values[: len(stats)], iter(values[len(stats) :])
    opt = dict(zip(OPTIONAL_STATS, (None if s is None else next(rest) for s in optional), strict=True))
    return LossOutput(
        loss=loss,
        num_tokens=n_tokens,
        logprob_diff_mean=fixed[0],
        logprob_diff_max=fixed[1],
        ratio_mean=fixed[2],
        ratio_min=fixed[3],
        ratio_max=fixed[4],
        **opt,
    )


def _aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    cfg: LossConfig,
    num_tokens_in_step: float | None,
    num_seqs_in_step: float | None,
) -> torch.Tensor:
    """Reduce masked per-token losses (zero off the mask) to a scalar, per `cfg.aggregation`."""
    total = per_token.sum()
    if cfg.aggregation == "token_mean":
        n = float(mask.sum().item()) if num_tokens_in_step is None else float(num_tokens_in_step)
        return total / max(n, 1.0)

    seq = torch.where(mask, seq_index, torch.zeros_like(seq_index)).reshape(-1).long()
    if mask.any() and int(seq_index[mask].min().item()) < 0:
        raise ValueError("policy_loss: seq_index must be >= 0 on every loss token")
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
