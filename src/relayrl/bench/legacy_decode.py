"""The hf engine's decode loop as it was at 8202bc9, kept only as `relayrl bench engines`'
same-run baseline ("hf-before"): a `nonzero()` and a `torch.multinomial` (each a host sync) per
prompt per decode step, `bool(done.any())` per step, transformers' 2D mask (its padding check
reads the device every forward) and a `DynamicCache` that concatenates the whole KV every step.
Nothing else imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from relayrl.backends.local.gate import WeightGate
from relayrl.backends.local.generation import (
    _PRUNE_FRACTION,
    SampledSequence,
    SamplingParams,
    _cache_kwarg,
    _check_abort,
    _left_padded,
    _one_pass,
)

__all__ = ["legacy_sample"]


def _dynamic_cache(model: PreTrainedModel) -> DynamicCache:
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56
        return DynamicCache()


def _pick_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    per_group: Sequence[tuple[torch.Generator | None, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row of `logits` ([B, V]); return (tokens [B], logprobs [B]).

    With `per_group`, (generator, row indices) pairs, each group's rows are drawn, in order, from
    its own generator (None: torch's default one), and rows in no group (finished ones riding
    along) get the argmax, drawing nothing; otherwise every row draws from `generator`. Greedy draws from no generator, so
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


def legacy_sample(
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
    gate: WeightGate | None = None,
) -> list[list[SampledSequence]]:
    """`relayrl.backends.local.generation.sample` as it was before its decode loop stopped
    reading the device per token (git 8202bc9): same arguments, same results (the same
    generator states give the same tokens), slower. Kept only as `bench engines`' baseline."""
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
    input_ids, attention = _left_padded(prefill_rows, pad_token_id, device)
    positions = (attention.cumsum(dim=-1) - 1).clamp_(min=0)

    eos = torch.tensor(sorted(set(params.eos_token_ids)), dtype=torch.long, device=device)
    out_tokens = torch.zeros((total, params.max_new_tokens), dtype=torch.long, device=device)
    out_logprobs = torch.zeros((total, params.max_new_tokens), dtype=torch.float32, device=device)
    lengths = [params.max_new_tokens] * total
    stopped = [False] * total

    def check_abort() -> None:
        _check_abort(abort)

    check_abort()
    cache_arg = _cache_kwarg(model)
    cache = _dynamic_cache(model)
    changes: list[tuple[int, int]] = []  # (first step, version) of the passes that drew each run of steps
    with torch.inference_mode():
        with _one_pass(gate) as version:
            out = model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{cache_arg: cache},
            )
        changes.append((0, version))
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
            tokens, logprobs = _pick_tokens(logits, params, generator, per_group)
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
            with _one_pass(gate) as version:
                out = model(
                    input_ids=tokens[:, None],
                    attention_mask=attention,
                    position_ids=next_pos[:, None],
                    use_cache=True,
                    **{cache_arg: cache},
                )
            if version != changes[-1][1]:
                changes.append((step + 1, version))  # these logits draw the next step's tokens
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
                    versions=[c for c in changes if c[0] < n] if gate is not None else [],
                )
            )
            row += 1
        results.append(group)
    return results
