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
  the argmax under the plain temperature-1 softmax, which is what the policy assigns it;
- a decode step reads the device at most once (`sample`: only with EOS ids, which rows drew one
  and a NaN check; `sample_turns`: the step's tokens and log-probs); which rows still sample is
  kept on the host, every row's token is drawn in one batched pick (`pick_tokens`, equal to one
  `torch.multinomial` per generator), decode steps pass a prepared 4D mask (sdpa, eager), and
  the cache's full-attention layers write into buffers kept across steps (`_PreallocatedLayer`:
  the call's whole length on CUDA, doubling on the CPU): a step copies its own keys and values,
  not the whole cache;
- with a `WeightGate` (rollout.interruptible), a weight load lands only between two forward
  passes; a token's log-prob is under the weights of the pass that produced its logits, and its
  sequence's `versions` records that version (the KV cache of earlier tokens is kept, computed
  with the weights of their own passes).

`sample_turns` samples one policy turn per row of multi-turn episodes (the local sampler's
`generate_turns`). A row starts from nothing (its whole context is prefilled; identical contexts
once) or from its episode's saved `RowCache` plus the context tokens after what it covers. Its
invariants, besides the ones above (which hold per row):
- every row computes what it would compute alone: saved caches are left-padded to a common length
  and suffixes left-padded inside the prefill chunk (so every row's last real token is the
  chunk's last column), all padding with attention 0 and every real token at its own position
  (position ids count only real tokens); the holes this leaves are never attended to;
- a row that stopped (EOS or its own `max_new_tokens`) gets attention 0 on every later column,
  so the cache it leaves holds no junk;
- the returned cache of a row holds exactly the tokens fed (context + sampled tokens but the last,
  which was never fed), in order, unpadded: extending it with later tokens computes what reading
  the whole sequence at once would — with the same weights; with a `WeightGate` each forward pass
  (each prefill, each decode step) holds the gate, so a load lands between two of them: a row's
  `versions` records which version's logits drew each of its tokens, and its KV cache (and a
  saved cache it continued) may hold keys and values computed with older weights (the same
  accepted approximation as within one `sample` call).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers < 4.56: no per-layer caches; DynamicCache is used as it is
    DynamicLayer = object  # type: ignore[misc,assignment]

from relayrl.backends.local.attention import to_additive_mask
from relayrl.backends.local.gate import WeightGate

__all__ = [
    "RowCache",
    "SampledSequence",
    "SamplingAborted",
    "SamplingParams",
    "TurnInput",
    "TurnOutput",
    "TurnStats",
    "pick_tokens",
    "sample",
    "sample_turns",
]

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
    # with a `WeightGate`: (first token index, version) of each run of tokens one version sampled
    versions: list[tuple[int, int]] = field(default_factory=list)


def pick_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    per_group: Sequence[tuple[torch.Generator | None, Sequence[int]]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row of `logits` ([B, V]); return (tokens [B], logprobs [B]).

    With `per_group`, (generator, batch rows in ascending order) pairs, each group's rows are
    drawn, in order, from its own generator (None: torch's default one), and rows in no group
    (finished ones riding along) get the argmax, drawing nothing; otherwise every row draws from
    `generator`. Greedy draws from no generator, so evaluation does not shift a sampling RNG
    stream.

    A draw is `torch.multinomial`'s own for one sample (argmax of p / E, E ~ Exp(1) drawn from
    the generator for each of the group's rows and tokens), so the same generator states give the
    same tokens as one `multinomial` call per group; but the whole batch is picked at once and
    nothing here reads the device (`multinomial` checks its input with a host sync per call): a
    distribution with NaN shows as a NaN log-prob, which the callers check with their one
    per-step read.
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
        probs = probs.masked_fill(drop, 0.0)  # p / E only compares: the nucleus needs no renormalising
    tokens = (probs / _exponential_noise(probs, generator, per_group)).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _exponential_noise(
    probs: torch.Tensor,
    generator: torch.Generator | None,
    per_group: Sequence[tuple[torch.Generator | None, Sequence[int]]] | None,
) -> torch.Tensor:
    """E [B, V] with each group's rows drawn as `torch.multinomial(probs[rows], 1, generator)`
    draws them (one `exponential_` of shape [len(rows), V], groups in order), 1 for rows in no
    group; assembled from contiguous slices, so no index tensor crosses to the device."""
    if per_group is None:
        return torch.empty_like(probs).exponential_(generator=generator)
    width = probs.shape[-1]
    owner: list[tuple[int, int] | None] = [None] * probs.shape[0]  # (group, its k-th row)
    draws: list[torch.Tensor] = []
    for g, (group_generator, rows) in enumerate(per_group):
        draws.append(probs.new_empty((len(rows), width)).exponential_(generator=group_generator) if rows else probs.new_empty((0, width)))
        for k, row in enumerate(rows):
            owner[row] = (g, k)
    pieces: list[torch.Tensor] = []
    start = 0
    while start < len(owner):  # runs of consecutive rows from one group's consecutive draws, or of no group
        first = owner[start]
        end = start + 1
        while end < len(owner) and (
            (first is None and owner[end] is None) or (first is not None and owner[end] == (first[0], first[1] + end - start))
        ):
            end += 1
        pieces.append(probs.new_ones((end - start, width)) if first is None else draws[first[0]][first[1] : first[1] + end - start])
        start = end
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers 5.x names the cache argument `cache`; 4.x named it `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer that writes each pass's keys and values into buffers sized
    for the whole call (`capacity` tokens) and hands the attention views of them: a decode step
    copies its own token's keys and values only, where `DynamicLayer` concatenates the whole
    cache again (O(T^2) copies over a generation; here O(T)). On the CPU the buffers start smaller
    and double (`_first_capacity`); past `capacity` they grow as needed. It adopts whatever a
    transformers method put in `keys`/`values` (a crop, a reorder) at the next update.
    Everything else (lengths, masks) is `DynamicLayer`'s, read from the views."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None  # what `keys`/`values` were set to
        self._length = 0

    def _first_capacity(self, need: int, cuda: bool) -> int:
        """On CUDA the whole call's `capacity` at once (the caching allocator makes it cheap, and
        a step never reallocates). On the CPU fresh memory costs a page fault per page touched, so a
        generation that stops early would pay for columns it never fills (measured: 10-20% of a
        short call): there the buffers start with room for one more token and double as needed,
        up to `capacity`."""
        if cuda:
            return max(self.capacity, need)
        return max(need, min(self.capacity, need + 1))

    def _owned(self) -> bool:
        return self._views is not None and self.keys is self._views[0] and self.values is self._views[1]

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, length: int, capacity: int) -> None:
        """New buffers of `capacity` tokens holding the first `length` tokens of `keys`/`values`."""
        k = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        v = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        if length:
            k[..., :length, :] = keys[..., :length, :]
            v[..., :length, :] = values[..., :length, :]
        self._buffers, self._length = (k, v), length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if not self._owned():  # first update, or something else replaced the views
            keys = self.keys if self.keys is not None and self.keys.dim() == 4 else key_states
            values = self.values if self.values is not None and self.values.dim() == 4 else value_states
            length = keys.shape[-2] if keys is not key_states else 0
            self._allocate(keys, values, length, self._first_capacity(length + new, key_states.is_cuda))
        assert self._buffers is not None
        k, v = self._buffers
        if self._length + new > k.shape[-2]:
            self._allocate(k, v, self._length, max(min(2 * k.shape[-2], self.capacity), self._length + new))
            k, v = self._buffers
        k[..., self._length : self._length + new, :] = key_states
        v[..., self._length : self._length + new, :] = value_states
        self._length += new
        self.keys, self.values = k[..., : self._length, :], v[..., : self._length, :]
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self._owned() or self._buffers is None:
            super().batch_select_indices(indices)
            return
        k, v = self._buffers
        rows, length = indices.shape[0], self._length
        if rows <= k.shape[0]:  # fewer rows (pruning): compacted in place, no new buffer
            k[:rows, ..., :length, :] = k[indices, ..., :length, :]  # (the right side is gathered first)
            v[:rows, ..., :length, :] = v[indices, ..., :length, :]
            self._buffers = (k[:rows], v[:rows])
        else:  # more rows (a prompt's prefill copied to its samples): the filled columns into new buffers
            self._allocate(k[indices, ..., :length, :], v[indices, ..., :length, :], length, k.shape[-2])
        assert self._buffers is not None
        k, v = self._buffers
        self.keys, self.values = k[..., : self._length, :], v[..., : self._length, :]
        self._views = (self.keys, self.values)


def _new_cache(model: PreTrainedModel, capacity: int = 0) -> DynamicCache:
    """A DynamicCache for `model`; with `capacity`, its full-attention layers preallocate that
    many tokens (`_PreallocatedLayer`); other layers (sliding window, ...) stay transformers'."""
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56
        return DynamicCache()
    layers = getattr(cache, "layers", None)
    if capacity > 0 and layers:
        cache.layers = [_PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in layers]
    return cache


def _step_mask(model: PreTrainedModel, attention: torch.Tensor, plain: bool) -> torch.Tensor:
    """The attention mask of a decode step (one new column per row) from `attention` [rows,
    columns]. For sdpa and eager attention over full-attention layers (`plain`) it is the 4D mask
    [rows, 1, 1, columns] transformers would build (bool for sdpa; additive for eager), which
    transformers then uses as it is: building it from the 2D mask costs a host sync per forward
    (its check whether the mask has any padding). Otherwise the 2D mask."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if not plain or implementation not in ("sdpa", "eager"):
        return attention
    keep = attention.bool()[:, None, None, :]
    if implementation == "sdpa":
        return keep
    return to_additive_mask(keep, model.dtype)


def _check_finite(logprobs: Sequence[float], where: str) -> None:
    """Refuse sampled log-probs with a NaN: the distribution they were drawn from was not one
    (the model's logits held inf or nan), as `torch.multinomial` refuses such probabilities."""
    if any(math.isnan(x) for x in logprobs):
        raise RuntimeError(f"{where}: the model's logits hold inf or nan, so the probabilities are not a distribution")


def _one_pass(gate: WeightGate | None) -> contextlib.AbstractContextManager[int]:
    """Hold the weights for one forward pass: `gate.step()`, giving the version it computes with;
    without a gate nothing to hold (version 0)."""
    return gate.step() if gate is not None else contextlib.nullcontext(0)


def _check_abort(abort: threading.Event | None) -> None:
    if abort is not None and abort.is_set():
        raise SamplingAborted("sampling aborted: the awaiting call was cancelled")


def _left_padded(rows: Sequence[Sequence[int]], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention) [len(rows), longest]: each row right-aligned, padding attention 0."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
            attention[i, width - len(row) :] = 1
    return input_ids.to(device), attention.to(device)


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
    gate: WeightGate | None = None,
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

    With `gate`, every forward pass holds it (a weight load lands between two passes, see
    `relayrl.backends.local.gate`) and each sequence's `versions` says which version's logits drew
    each of its tokens (and their log-probs): the pass that produced a token's logits decides.
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
    input_ids, prompt_attention = _left_padded(prefill_rows, pad_token_id, device)
    positions = (prompt_attention.cumsum(dim=-1) - 1).clamp_(min=0)
    width = input_ids.shape[-1]

    eos = torch.tensor(sorted(set(params.eos_token_ids)), dtype=torch.long, device=device)
    out_tokens = torch.zeros((total, params.max_new_tokens), dtype=torch.long, device=device)
    out_logprobs = torch.zeros((total, params.max_new_tokens), dtype=torch.float32, device=device)
    lengths = [params.max_new_tokens] * total
    stopped = [False] * total

    def check_abort() -> None:
        _check_abort(abort)

    check_abort()
    cache_arg = _cache_kwarg(model)
    cache = _new_cache(model, width + params.max_new_tokens)
    plain = _plain_layers(cache)
    changes: list[tuple[int, int]] = []  # (first step, version) of the passes that drew each run of steps
    with torch.inference_mode():
        with _one_pass(gate) as version:
            out = model(
                input_ids=input_ids,
                attention_mask=prompt_attention,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{cache_arg: cache},
            )
        changes.append((0, version))
        logits = out.logits[:, -1, :]
        if source != list(range(len(prefill_rows))):
            index = torch.tensor(source, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            logits, prompt_attention = logits[index], prompt_attention[index]
        next_pos = prompt_attention.sum(dim=-1)  # position of the token about to be fed
        # Every column a decode step adds is attended: the whole call's mask is laid out once and
        # each step passes a view of its first columns.
        attention = torch.cat([prompt_attention, prompt_attention.new_ones((total, params.max_new_tokens))], dim=-1)
        mask = _step_mask(model, attention, plain)
        # Host-side bookkeeping: which sample row each batch row is, which still sample. The
        # device is read once per decode step (which rows drew EOS, and a NaN check), and only
        # when there are EOS ids; without them, once at the end.
        rows = list(range(total))
        alive = [True] * total
        rows_index = torch.arange(total, device=device)  # `rows` on the device
        prompt_of = [i for i, c in enumerate(counts) for _ in range(c)]
        for step in range(params.max_new_tokens):
            per_group = None
            if generators is not None and not params.is_greedy:
                members: dict[int, list[int]] = {}
                for b, r in enumerate(rows):
                    if alive[b]:
                        members.setdefault(prompt_of[r], []).append(b)
                per_group = [(g, members.get(i, [])) for i, g in enumerate(generators) if counts[i]]
            tokens, logprobs = pick_tokens(logits, params, generator, per_group)
            # Rows that already stopped still ride along until pruned; their writes land past
            # their length and are cut off below.
            out_tokens[rows_index, step] = tokens
            out_logprobs[rows_index, step] = logprobs
            last = step == params.max_new_tokens - 1
            if eos.numel():
                # the step's one read: per batch row, whether it drew EOS, then whether its log-prob is NaN
                flags = torch.cat([torch.isin(tokens, eos), logprobs.isnan()]).tolist()
                n = len(rows)
                if not params.is_greedy:
                    _check_finite([math.nan if flags[n + b] and alive[b] else 0.0 for b in range(n)], f"sample, decode step {step}")
                done = [b for b in range(n) if alive[b] and flags[b]]
                if done:
                    for b in done:
                        lengths[rows[b]], stopped[rows[b]] = step + 1, True
                        alive[b] = False
                    live = n - alive.count(False)
                    if last or live == 0:
                        break
                    # Copying the cache rows costs ~1/10 of a decode step: prune once enough
                    # rows are dead to pay for it.
                    if (n - live) * _PRUNE_FRACTION >= n:
                        keep_rows = [b for b in range(n) if alive[b]]
                        keep = torch.tensor(keep_rows, dtype=torch.long, device=device)
                        cache.batch_select_indices(keep)
                        tokens, attention, mask, next_pos = tokens[keep], attention[keep], mask[keep], next_pos[keep]
                        rows, alive = [rows[b] for b in keep_rows], [True] * live
                        rows_index = rows_index[keep]
            if last:
                break
            check_abort()
            with _one_pass(gate) as version:
                out = model(
                    input_ids=tokens[:, None],
                    attention_mask=mask[..., : width + step + 1],
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
    if not params.is_greedy:
        _check_finite([x for r, n in enumerate(lengths) for x in logprob_lists[r][:n]], "sample")
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


# ---------------------------------------------------------------------------------------------
# Multi-turn: one policy turn per row, continuing saved KV caches.


@dataclass(slots=True)
class RowCache:
    """The KV cache of one sequence, unpadded: per layer (keys, values), each
    [kv_heads, len(tokens), head_dim], holding exactly `tokens` at positions 0..len(tokens)-1."""

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


@dataclass(slots=True)
class TurnInput:
    """One row of `sample_turns`: the whole context, its own token budget and generator, and
    optionally the episode's saved cache, which must cover a proper prefix of `context`."""

    context: Sequence[int]
    max_new_tokens: int
    generator: torch.Generator | None = None
    cache: RowCache | None = None


@dataclass(slots=True)
class TurnOutput:
    """One row's sampled turn; `cache` covers context + sequence tokens but the last (None when
    caches are not kept); `cached_tokens` context tokens were read from the input cache."""

    sequence: SampledSequence
    cache: RowCache | None
    cached_tokens: int


@dataclass(slots=True)
class TurnStats:
    """Counters `sample_turns` adds to when given one (cumulative over calls)."""

    rows: int = 0  # turns sampled
    prefill_rows: int = 0  # rows through a prefill forward (identical fresh contexts count once)
    computed_tokens: int = 0  # context tokens those prefills computed (padding not counted)
    padded_tokens: int = 0  # prefill slots, padding included
    cached_tokens: int = 0  # context tokens read from saved caches instead
    forward_passes: int = 0


def _plain_layers(cache: DynamicCache) -> bool:
    """True when every layer of `cache` keeps every token's keys and values (full attention):
    no sliding window (which crops), no linear-attention state, no quantized store."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers < 4.56: key_cache / value_cache lists of full tensors
        return hasattr(cache, "key_cache") and hasattr(cache, "value_cache")
    return all(
        not getattr(layer, "is_sliding", False) and not hasattr(layer, "conv_states") and not hasattr(layer, "_quantize")
        for layer in layers
    )


def supports_row_caches(model: PreTrainedModel) -> bool:
    """Whether `sample_turns` can save and continue this model's caches (full-attention layers)."""
    return _plain_layers(_new_cache(model))


def _layer_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (keys, values), each [batch, kv_heads, length, head_dim]."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return list(zip(cache.key_cache, cache.value_cache))  # type: ignore[attr-defined]
    return [(layer.keys, layer.values) for layer in layers]


def _cache_from(model: PreTrainedModel, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], extra: int = 0) -> DynamicCache:
    """A cache holding `kv`, with room for `extra` more tokens preallocated."""
    cache = _new_cache(model, (kv[0][0].shape[-2] + extra) if kv and extra > 0 else 0)
    for index, (keys, values) in enumerate(kv):
        cache.update(keys, values, index)
    return cache


def _stack_saved(saved: Sequence[RowCache], device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Saved caches as one batch, each left-padded (zeros, attention 0) to the longest."""
    width = max(len(c.tokens) for c in saved)
    attention = torch.zeros((len(saved), width), dtype=torch.long)
    for i, c in enumerate(saved):
        attention[i, width - len(c.tokens) :] = 1
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer, (k0, v0) in enumerate(saved[0].layers):
        keys = k0.new_zeros((len(saved), k0.shape[0], width, k0.shape[-1]), device=device)
        values = v0.new_zeros((len(saved), v0.shape[0], width, v0.shape[-1]), device=device)
        for i, c in enumerate(saved):
            k, v = c.layers[layer]
            keys[i, :, width - k.shape[1] :] = k
            values[i, :, width - v.shape[1] :] = v
        kv.append((keys, values))
    return kv, attention.to(device)


@dataclass(slots=True)
class _Prefilled:
    """One prefill forward's result: its cache, attention [rows, width], last logits [rows, V]."""

    cache: DynamicCache
    attention: torch.Tensor
    logits: torch.Tensor


def _merge(model: PreTrainedModel, parts: list[_Prefilled], order: list[tuple[int, int]], extra: int = 0) -> _Prefilled:
    """One batch whose row i is row order[i][1] of part order[i][0], the narrower parts
    left-padded (zeros, attention 0) to the widest (its cache with room for `extra` more tokens)."""
    device = parts[0].attention.device
    if len(parts) == 1:
        part = parts[0]
        rows = [r for _, r in order]
        if rows == list(range(part.attention.shape[0])):
            return part
        index = torch.tensor(rows, dtype=torch.long, device=device)
        part.cache.batch_select_indices(index)
        return _Prefilled(part.cache, part.attention[index], part.logits[index])
    width = max(p.attention.shape[-1] for p in parts)
    picks: list[tuple[torch.Tensor, torch.Tensor]] = []  # per part: (destination rows, source rows)
    for p in range(len(parts)):
        to_rows = [i for i, (q, _) in enumerate(order) if q == p]
        from_rows = [r for q, r in order if q == p]
        picks.append((torch.tensor(to_rows, dtype=torch.long, device=device), torch.tensor(from_rows, dtype=torch.long, device=device)))
    kvs = [_layer_kv(p.cache) for p in parts]
    merged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(len(kvs[0])):
        pair: list[torch.Tensor] = []
        for which in range(2):
            first = kvs[0][layer][which]
            out = first.new_zeros((len(order), first.shape[1], width, first.shape[-1]))
            for kv, (dest, src) in zip(kvs, picks):
                t = kv[layer][which]
                out[dest, :, width - t.shape[-2] :] = t[src]
            pair.append(out)
        merged.append((pair[0], pair[1]))
    attention = parts[0].attention.new_zeros((len(order), width))
    logits = parts[0].logits.new_empty((len(order), parts[0].logits.shape[-1]))
    for part, (dest, src) in zip(parts, picks):
        attention[dest, width - part.attention.shape[-1] :] = part.attention[src]
        logits[dest] = part.logits[src]
    return _Prefilled(_cache_from(model, merged, extra), attention, logits)


def _extract(cache: DynamicCache, attention: torch.Tensor, row: int, tokens: list[int]) -> RowCache:
    """Batch row `row`'s cache, only its attended columns (the tokens fed, in order)."""
    columns = attention[row].nonzero().squeeze(-1)
    if columns.numel() != len(tokens):
        raise RuntimeError(f"internal: row {row} has {columns.numel()} cached tokens, expected {len(tokens)}")
    return RowCache(tokens, [(k[row].index_select(-2, columns), v[row].index_select(-2, columns)) for k, v in _layer_kv(cache)])


def sample_turns(
    model: PreTrainedModel,
    turns: Sequence[TurnInput],
    params: SamplingParams,
    *,
    pad_token_id: int = 0,
    abort: threading.Event | None = None,
    keep_caches: bool = True,
    stats: TurnStats | None = None,
    gate: WeightGate | None = None,
) -> list[TurnOutput]:
    """Sample one completion per row (a policy turn), in one batch; result[i] is turns[i]'s.

    A row with a saved `cache` reads only the context tokens after it; the others read their
    whole context, identical contexts prefilled once. Each row stops at its first EOS (kept) or
    at its own `max_new_tokens` (`params.max_new_tokens` is not used); unless greedy it draws
    from its own `generator` only (one per row; a row without one draws from torch's default
    RNG), so what it samples does not depend on the other rows. With `keep_caches` (and a model
    whose layers all keep every token, `supports_row_caches`) each output carries the row's new
    cache. `abort` is checked before every forward pass; once set, `SamplingAborted` is raised.

    With `gate`, every forward pass holds it, as in `sample`: a weight load lands between two
    passes, and each row's `sequence.versions` lists (first token index, version) of the passes
    that drew its tokens (a row's first token is drawn by its prefill's logits).
    """
    if not turns:
        return []
    for i, turn in enumerate(turns):
        if turn.max_new_tokens < 1:
            raise ValueError(f"turn {i}: max_new_tokens must be >= 1, got {turn.max_new_tokens}")
        if not turn.context:
            raise ValueError(f"turn {i}: the context needs at least one token")
        if turn.cache is not None:
            covered = len(turn.cache.tokens)
            if not 0 < covered < len(turn.context) or list(turn.context[:covered]) != turn.cache.tokens:
                raise ValueError(f"turn {i}: its cache does not cover a proper prefix of its context")
    device = model.device
    cache_arg = _cache_kwarg(model)
    continuable = supports_row_caches(model)
    if not continuable and any(t.cache is not None for t in turns):
        raise ValueError("this model's cache keeps only some tokens (sliding window or linear attention): it cannot be continued")
    keep_caches = keep_caches and continuable

    # Prefill parts: 0 = fresh contexts (identical ones once), 1 = rows continuing a saved cache.
    unique: dict[tuple[int, ...], int] = {}
    fresh: list[Sequence[int]] = []
    continuing: list[int] = []
    where: list[tuple[bool, int]] = []  # per row: (continues a cache, its row in that part)
    for i, turn in enumerate(turns):
        if turn.cache is None:
            key = tuple(turn.context)
            if key not in unique:
                unique[key] = len(fresh)
                fresh.append(turn.context)
            where.append((False, unique[key]))
        else:
            where.append((True, len(continuing)))
            continuing.append(i)

    room = max(t.max_new_tokens for t in turns)  # decode columns the caches need room for
    parts: list[_Prefilled] = []
    part_of: dict[bool, int] = {}
    part_version: dict[bool, int] = {}  # the version of each prefill pass (0 without a gate)
    eos = set(params.eos_token_ids)

    def prefill(
        cache: DynamicCache, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, computed: int, cached: int
    ) -> tuple[_Prefilled, int]:
        """One prefill forward pass over `input_ids` (rows of `attention`'s width minus the
        cache's), counted in `stats`; returns it and the version of the weights it computed with."""
        with _one_pass(gate) as version:
            out = model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{cache_arg: cache},
            )
        if stats is not None:
            stats.prefill_rows += input_ids.shape[0]
            stats.computed_tokens += computed
            stats.cached_tokens += cached
            stats.padded_tokens += input_ids.numel()
            stats.forward_passes += 1
        return _Prefilled(cache, attention, out.logits[:, -1, :]), version

    with torch.inference_mode():
        if fresh:
            _check_abort(abort)
            input_ids, attention = _left_padded(fresh, pad_token_id, device)
            positions = (attention.cumsum(dim=-1) - 1).clamp_(min=0)
            part_of[False] = len(parts)
            part, part_version[False] = prefill(
                _new_cache(model, input_ids.shape[-1] + room), input_ids, attention, positions, sum(len(c) for c in fresh), 0
            )
            parts.append(part)
        if continuing:
            _check_abort(abort)
            saved = [turns[i].cache for i in continuing]
            assert all(c is not None for c in saved)
            saved_caches = [c for c in saved if c is not None]
            kv, past_attention = _stack_saved(saved_caches, device)
            suffixes = [turns[i].context[len(c.tokens) :] for i, c in zip(continuing, saved_caches)]
            input_ids, chunk_attention = _left_padded(suffixes, pad_token_id, device)
            attention = torch.cat([past_attention, chunk_attention], dim=-1)
            positions = (attention.cumsum(dim=-1) - 1).clamp_(min=0)[:, past_attention.shape[-1] :]
            part_of[True] = len(parts)
            computed, reused = sum(len(s) for s in suffixes), sum(len(c.tokens) for c in saved_caches)
            part, part_version[True] = prefill(
                _cache_from(model, kv, input_ids.shape[-1] + room), input_ids, attention, positions, computed, reused
            )
            parts.append(part)
        batch = _merge(model, parts, [(part_of[cont], r) for cont, r in where], room)
        cache, attention, logits = batch.cache, batch.attention, batch.logits

        n = len(turns)
        limits = [t.max_new_tokens for t in turns]
        tokens_of: list[list[int]] = [[] for _ in range(n)]
        logprobs_of: list[list[float]] = [[] for _ in range(n)]
        stopped = [False] * n
        saved_out: list[RowCache | None] = [None] * n
        rows = list(range(n))  # the turn of each batch row
        alive = [True] * n  # batch rows still sampling
        next_pos = attention.sum(dim=-1)  # position of the token each row feeds next
        plain = _plain_layers(cache)
        eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
        # On the device too: whether each batch row still samples, and each row's token budget;
        # the decode columns are laid out once (a stopped row's stay 0).
        live_flags = torch.ones(n, dtype=torch.bool, device=device)
        limit_of = torch.tensor(limits, dtype=torch.long, device=device)
        columns = attention.shape[-1]
        attention = torch.cat([attention, attention.new_zeros((n, room))], dim=-1)
        decode_versions: list[int] = []  # decode step k's version: its logits drew every row's token k + 1
        step = 0
        while True:
            per_group = None
            if not params.is_greedy:
                per_group = [(turns[r].generator, [b]) for b, r in enumerate(rows) if alive[b]]
            tokens, logprobs = pick_tokens(logits, params, None, per_group)
            # the step's one read: every row's token and log-prob (token ids are exact in float64)
            token_list, logprob_list = torch.stack([tokens.double(), logprobs.double()]).tolist()
            for b, r in enumerate(rows):
                if not alive[b]:
                    continue  # riding along until pruned: its draws are discarded
                if math.isnan(logprob_list[b]) and not params.is_greedy:
                    _check_finite([logprob_list[b]], f"sample_turns, turn {r}")
                token = int(token_list[b])
                tokens_of[r].append(token)
                logprobs_of[r].append(logprob_list[b])
                if token in eos:
                    stopped[r], alive[b] = True, False
                elif step + 1 >= limits[r]:
                    alive[b] = False
            live_flags &= ~torch.isin(tokens, eos_ids) & (limit_of > step + 1)
            live = sum(alive)
            if live == 0:
                break
            if (len(rows) - live) * _PRUNE_FRACTION >= len(rows):
                if keep_caches:
                    for b, r in enumerate(rows):
                        if not alive[b]:
                            saved_out[r] = _extract(cache, attention[:, :columns], b, list(turns[r].context) + tokens_of[r][:-1])
                keep = [b for b in range(len(rows)) if alive[b]]
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                tokens, attention, next_pos = tokens[index], attention[index], next_pos[index]
                live_flags, limit_of = live_flags[index], limit_of[index]
                rows, alive = [rows[b] for b in keep], [True] * live
            _check_abort(abort)
            # A stopped row's later columns get attention 0: its cache never holds what it did not sample.
            attention[:, columns] = live_flags
            columns += 1
            with _one_pass(gate) as version:
                out = model(
                    input_ids=tokens[:, None],
                    attention_mask=_step_mask(model, attention[:, :columns], plain),
                    position_ids=next_pos[:, None],
                    use_cache=True,
                    **{cache_arg: cache},
                )
            decode_versions.append(version)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
            step += 1
            if stats is not None:
                stats.forward_passes += 1
        attention = attention[:, :columns]
        if keep_caches:
            for b, r in enumerate(rows):
                if saved_out[r] is None:
                    saved_out[r] = _extract(cache, attention, b, list(turns[r].context) + tokens_of[r][:-1])
    if stats is not None:
        stats.rows += n

    def segments(r: int) -> list[tuple[int, int]]:
        """Row r's (first token index, version) runs: its prefill's, then the decode steps'."""
        if gate is None:
            return []
        runs = [(0, part_version[where[r][0]])]
        for k in range(len(tokens_of[r]) - 1):
            if decode_versions[k] != runs[-1][1]:
                runs.append((k + 1, decode_versions[k]))
        return runs

    return [
        TurnOutput(
            sequence=SampledSequence(
                tokens=tokens_of[r], logprobs=logprobs_of[r], finish_reason="stop" if stopped[r] else "length", versions=segments(r)
            ),
            cache=saved_out[r],
            cached_tokens=len(cached.tokens) if (cached := turns[r].cache) is not None else 0,
        )
        for r in range(n)
    ]
