"""The policy loss the trainer minimises, on per-token tensors (pure torch, any shape).

Job: turn per-token log-probs of the current policy, the behaviour log-probs, advantages and a
loss mask into one scalar loss plus detached statistics.

Invariant: only positions with `loss_mask > 0` (completion tokens) contribute to the loss, its
gradient or any statistic — whatever finite or non-finite values the other positions hold — and
with explicit step normalisers (`num_tokens_in_step`, `num_seqs_in_step`) the sum of the losses
of a step's micro-batches equals the loss of the whole step computed at once, so accumulating
gradients over micro-batches is exact.

Per completion token t of sequence s (advantage A, ratio r = exp(logp − old_logp)):

    pg_t  = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) · w_t          (PPO / DAPO clip-higher)
    w_t   = min(exp(old_logp − sampler_logp), tis_cap), detached          (only if tis_cap is set)
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
    - `tis_cap`: truncated importance sampling. When set, each token's policy-gradient term is
      multiplied by min(exp(old_logprobs − sampler_logprobs), tis_cap), detached. It corrects for
      the sampler (inference engine) and the trainer assigning different probabilities to the
      same token under the same weights: `old_logprobs` must then be the trainer's recomputed
      log-probs of the sampling policy and `sampler_logprobs` the engine's. Only the
      policy-gradient term is weighted, not the KL term. None turns it off.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    aggregation: Aggregation = "token_mean"
    max_completion_tokens: int | None = None
    kl_beta: float = 0.0
    tis_cap: float | None = None

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


@dataclass(slots=True)
class LossOutput:
    """The scalar loss (with graph) and detached statistics over this call's loss tokens.

    Means are over `num_tokens` tokens: to combine micro-batches, weight them by `num_tokens`;
    combine `*_min` / `*_max` with min / max. With no loss token, ratios read 1 and diffs 0.
    - `clip_frac_low`: share of tokens with A < 0 and r < 1 − ε_low (clipped: no gradient).
    - `clip_frac_high`: share of tokens with A > 0 and r > 1 + ε_high (clipped: no gradient).
    - `logprob_diff_mean` / `_max`: |current trainer log-prob − sampler log-prob| (sampler
      log-probs are `sampler_logprobs`, or `old_logprobs` when those are not given).
    - `ratio_*`: r = exp(logp − old_logp).
    - `entropy_mean`: mean of the given per-token entropy; None when not given.
    - `kl_mean`: mean k3 KL to the reference; None when no `ref_logprobs` were given.
    - `tis_weight_mean`: mean truncated-IS weight; None when `tis_cap` is unset.
    """

    loss: torch.Tensor
    num_tokens: int
    clip_frac_low: float
    clip_frac_high: float
    logprob_diff_mean: float
    logprob_diff_max: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    entropy_mean: float | None = None
    kl_mean: float | None = None
    tis_weight_mean: float | None = None

    def metrics(self) -> dict[str, float]:
        """Flat metrics (detached floats); optional statistics only when present."""
        out: dict[str, float] = {
            "loss": float(self.loss.detach().item()),
            "num_loss_tokens": float(self.num_tokens),
            "clip_frac_low": self.clip_frac_low,
            "clip_frac_high": self.clip_frac_high,
            "logprob_diff_mean": self.logprob_diff_mean,
            "logprob_diff_max": self.logprob_diff_max,
            "ratio_mean": self.ratio_mean,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
        }
        for name in ("entropy_mean", "kl_mean", "tis_weight_mean"):
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
    sampler_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossOutput:
    """Clipped policy-gradient loss of one micro-batch (see module docstring for the formula).

    All tensors share one shape. `logprobs` carries the gradient; `old_logprobs` are the
    behaviour log-probs the ratio is taken against (the sampler's, or the trainer's recomputed
    ones); `seq_index` names each token's sequence (>= 0 on loss tokens, unique per sequence
    within this call). `num_tokens_in_step` / `num_seqs_in_step` are the step-wide normalisers
    (completion tokens / sequences with at least one completion token, over all micro-batches of
    the step); when None this call's own counts are used, i.e. the micro-batch is the whole step.
    """
    shape = logprobs.shape
    for name, t in (
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
        ("seq_index", seq_index),
        ("ref_logprobs", ref_logprobs),
        ("sampler_logprobs", sampler_logprobs),
        ("entropy", entropy),
    ):
        if t is not None and t.shape != shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")
    if cfg.kl_beta > 0 and ref_logprobs is None:
        raise ValueError("policy_loss: loss.kl_beta > 0 needs ref_logprobs")
    if cfg.tis_cap is not None and sampler_logprobs is None:
        raise ValueError("policy_loss: loss.tis_cap is set but no sampler_logprobs were given")

    mask = loss_mask > 0
    n_tokens = int(mask.sum().item())
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    old = old_logprobs.detach().to(logprobs.dtype)

    # Masked positions get log-ratio 0 *before* exp, so garbage there cannot become inf/NaN in
    # the forward pass nor in the backward pass.
    log_ratio = torch.where(mask, logprobs - old, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped_ratio)

    tis_weight: torch.Tensor | None = None
    if cfg.tis_cap is not None:
        assert sampler_logprobs is not None
        log_w = torch.where(mask, old - sampler_logprobs.detach().to(logprobs.dtype), zero)
        tis_weight = torch.exp(log_w.clamp(max=MAX_LOG_RATIO)).clamp(max=cfg.tis_cap).detach()
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
        sampler = (sampler_logprobs if sampler_logprobs is not None else old_logprobs).detach()
        diff = torch.where(mask, (logprobs.detach() - sampler.to(logprobs.dtype)).abs(), zero)
        one = torch.ones((), dtype=logprobs.dtype, device=logprobs.device)
        r = ratio.detach()
        stats = [
            ((adv < 0) & (r < 1.0 - cfg.clip_eps_low) & mask).sum() / denom,
            ((adv > 0) & (r > 1.0 + cfg.clip_eps_high) & mask).sum() / denom,
            diff.sum() / denom,
            diff.max() if diff.numel() else zero,
            torch.where(mask, r, zero).sum() / denom if n_tokens else one,
            torch.where(mask, r, torch.full_like(r, torch.inf)).min() if n_tokens else one,
            torch.where(mask, r, torch.full_like(r, -torch.inf)).max() if n_tokens else one,
        ]
        optional: list[torch.Tensor | None] = [
            None if entropy is None else torch.where(mask, entropy.detach().to(logprobs.dtype), zero).sum() / denom,
            None if kl is None else kl.detach().sum() / denom,
            None if tis_weight is None else torch.where(mask, tis_weight, zero).sum() / denom,
        ]
        present = [s for s in optional if s is not None]
        values = torch.stack([s.to(torch.float64) for s in stats + present]).tolist()
    fixed, rest = values[: len(stats)], iter(values[len(stats) :])
    opt = [None if s is None else next(rest) for s in optional]
    return LossOutput(
        loss=loss,
        num_tokens=n_tokens,
        clip_frac_low=fixed[0],
        clip_frac_high=fixed[1],
        logprob_diff_mean=fixed[2],
        logprob_diff_max=fixed[3],
        ratio_mean=fixed[4],
        ratio_min=fixed[5],
        ratio_max=fixed[6],
        entropy_mean=opt[0],
        kl_mean=opt[1],
        tis_weight_mean=opt[2],
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
