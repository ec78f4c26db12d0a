"""Batched sampling with a KV cache for Hugging Face causal LMs (Qwen2, Llama, ...), on torch.

Job: given a batch of prompts and how many samples each needs, return every sample's tokens and
the log-probability of each token under the policy that drew it.

Invariants:
- each distinct prompt is prefilled exactly once; its KV-cache rows are then copied to its G
  sample rows, so a group's samples share one prefill;
- prompts of different lengths are left-padded, with an attention mask and position ids that
  make every row compute what it would compute alone (padding never changes a result);
- a row stops at its first EOS token, which is kept; nothing is sampled after it, and finished
  rows leave the batch so later steps do not compute them;
- `logprobs[i]` is log p(tokens[i]) under the POLICY's distribution, softmax(logits /
  temperature), the one the trainer scores: with `top_p < 1` the token is drawn from the nucleus
  (truncated, renormalised) but its log-prob is not renormalised, so at staleness 0 the training
  ratio is exactly 1 and clipping / truncated IS act only on policy change (as TRL and verl,
  which recompute "old" log-probs with the full softmax). In greedy mode it is the log-prob of
  the argmax under the plain temperature-1 softmax, which is what the policy assigns it.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

__all__ = ["SampledSequence", "SamplingAborted", "SamplingParams", "pick_tokens", "sample"]

# Finished rows leave the batch once they are at least 1/_PRUNE_FRACTION of it.
_PRUNE_FRACTION = 8


class SamplingAborted(Exception):
    """Sampling stopped between decode steps because its abort flag was set."""


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to sample. `temperature <= 0` is treated as greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    greedy: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature <= 0.0


@dataclass(slots=True)
class SampledSequence:
    """One sampled completion: its tokens (EOS included when sampled), their sampling log-probs,
    and why it stopped ("stop": EOS sampled, "length": `max_new_tokens` reached)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


def pick_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    per_group: Sequence[tuple[torch.Generator, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row of `logits` ([B, V]); return (tokens [B], logprobs [B]).

    With `per_group`, (generator, row indices) pairs, each group's rows are drawn, in order, from
    its own generator, and rows in no group (finished ones riding along) get the argmax, drawing
    nothing; otherwise every row draws from `generator`. Greedy draws from no generator, so
    evaluation does not shift a sampling RNG stream.
    """
    logits = logits.float()
    if params.is_greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)  # the policy's: what the token's log-prob is reported under
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p (the top one never is).
        outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(outside).scatter_(-1, order, outside)
        probs = probs.masked_fill(drop, 0.0)  # multinomial renormalises the nucleus
    if per_group is None:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    else:
        tokens = probs.argmax(dim=-1)
        for group_generator, index in per_group:
            if index.numel():
                tokens[index] = torch.multinomial(probs[index], 1, generator=group_generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers 5.x names the cache argument `cache`; 4.x named it `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model: PreTrainedModel) -> DynamicCache:
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56
        return DynamicCache()


def sample(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    num_samples: int | Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    *,
    share_prefill: bool = True,
    pad_token_id: int = 0,
    abort: threading.Event | None = None,
    generators: Sequence[torch.Generator] | None = None,
) -> list[list[SampledSequence]]:
    """Sample `num_samples` completions of every prompt; result[i][j] is prompt i's j-th sample.

    `generators` (one per prompt) draws each prompt's samples from its own generator, only for
    its rows still sampling: what a prompt samples then depends on its generator's seed and the
    weights only, not on the other prompts of the batch or when rows are pruned (`generator` is
    then unused). Otherwise every row draws from `generator`.

    `num_samples` is one count for all prompts or one per prompt. Identical prompts are prefilled
    once. `share_prefill=False` prefills one copy per sample instead (for benchmarks and tests:
    with the same generator state it yields the same samples, only slower). `abort` is checked
    before every forward pass; once set, `SamplingAborted` is raised.
    """
    counts = [num_samples] * len(prompts) if isinstance(num_samples, int) else list(num_samples)
    if len(counts) != len(prompts):
        raise ValueError(f"num_samples has {len(counts)} counts for {len(prompts)} prompts")
    if any(c < 0 for c in counts):
        raise ValueError(f"num_samples must be >= 0, got {counts}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token; got an empty prompt")
    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"{len(generators)} generators for {len(prompts)} prompts")
    total = sum(counts)
    if total == 0:
        return [[] for _ in prompts]

    # Rows to prefill, and which prefilled row each sample row copies its cache from.
    if share_prefill:
        unique: dict[tuple[int, ...], int] = {}
        prefill_rows: list[Sequence[int]] = []
        source: list[int] = []
        for prompt, count in zip(prompts, counts):
            key = tuple(prompt)
            if count == 0:
                continue
            if key not in unique:
                unique[key] = len(prefill_rows)
                prefill_rows.append(prompt)
            source.extend([unique[key]] * count)
    else:
        prefill_rows = [p for p, c in zip(prompts, counts) for _ in range(c)]
        source = list(range(total))

    device = model.device
    width = max(len(p) for p in prefill_rows)
    input_ids = torch.full((len(prefill_rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(prefill_rows), width), dtype=torch.long)
    for i, prompt in enumerate(prefill_rows):
        input_ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention[i, width - len(prompt) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(dim=-1) - 1).clamp_(min=0)

    eos = torch.tensor(sorted(set(params.eos_token_ids)), dtype=torch.long, device=device)
    out_tokens = torch.zeros((total, params.max_new_tokens), dtype=torch.long, device=device)
    out_logprobs = torch.zeros((total, params.max_new_tokens), dtype=torch.float32, device=device)
    lengths = [params.max_new_tokens] * total
    stopped = [False] * total

    def check_abort() -> None:
        if abort is not None and abort.is_set():
            raise SamplingAborted("sampling aborted: the awaiting call was cancelled")

    check_abort()
    cache_arg = _cache_kwarg(model)
    cache = _new_cache(model)
    with torch.inference_mode():
        out = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{cache_arg: cache},
        )
        logits = out.logits[:, -1, :]
        index = torch.tensor(source, dtype=torch.long, device=device)
        if source != list(range(len(prefill_rows))):
            cache.batch_select_indices(index)
            logits, attention = logits[index], attention[index]
        next_pos = attention.sum(dim=-1)  # position of the token about to be fed
        rows = torch.arange(total, device=device)  # sample row of each batch row
        alive = torch.ones(total, dtype=torch.bool, device=device)  # batch rows still sampling
        prompt_of = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)], dtype=torch.long, device=device)
        for step in range(params.max_new_tokens):
            per_group = None
            if generators is not None and not params.is_greedy:
                owner = prompt_of[rows]  # the prompt of each batch row
                per_group = [(g, ((owner == i) & alive).nonzero().squeeze(-1)) for i, g in enumerate(generators) if counts[i]]
            tokens, logprobs = pick_tokens(logits, params, generator, per_group)
            # Rows that already stopped still ride along until pruned; their writes land past
            # their length and are cut off below.
            out_tokens[rows, step] = tokens
            out_logprobs[rows, step] = logprobs
            last = step == params.max_new_tokens - 1
            if eos.numel():
                done = torch.isin(tokens, eos) & alive
                if bool(done.any()):
                    for r in rows[done].tolist():
                        lengths[r], stopped[r] = step + 1, True
                    alive &= ~done
                    live = int(alive.sum())
                    if last or live == 0:
                        break
                    # Copying the cache rows costs ~1/10 of a decode step: prune once enough
                    # rows are dead to pay for it.
                    if (alive.numel() - live) * _PRUNE_FRACTION >= alive.numel():
                        keep = alive.nonzero().squeeze(-1)
                        cache.batch_select_indices(keep)
                        rows, tokens, alive = rows[keep], tokens[keep], alive[keep]
                        attention, next_pos = attention[keep], next_pos[keep]
            if last:
                break
            check_abort()
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=-1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=attention,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{cache_arg: cache},
            )
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

    token_lists = out_tokens.cpu().tolist()
    logprob_lists = out_logprobs.cpu().tolist()
    results: list[list[SampledSequence]] = []
    row = 0
    for count in counts:
        group: list[SampledSequence] = []
        for _ in range(count):
            n = lengths[row]
            group.append(
                SampledSequence(
                    tokens=token_lists[row][:n],
                    logprobs=logprob_lists[row][:n],
                    finish_reason="stop" if stopped[row] else "length",
                )
            )
            row += 1
        results.append(group)
    return results
