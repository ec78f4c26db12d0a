"""Per-token log-probs and entropies of a Hugging Face causal LM on a packed batch.

Job: run the model once on a `PackedBatch` and return, for every loss token (completion token),
its log π(token | its sequence's earlier tokens) and the entropy of that next-token distribution.

Invariant: packed results equal what one unpacked forward pass per sequence gives (to float
round-off), because the prefix-tree attention mask and positions isolate the sequences (see
`collate`); the mask is built here, on the batch's device, from the batch's segment and branch
ids, in the form the model's attention implementation takes on that device (`attention`).
The log-probs carry gradient; the entropy is detached (a statistic) unless `entropy_grad` asks
for its gradient (an entropy bonus in the loss: backward then keeps each chunk's full-vocabulary
probabilities).
Memory: only the positions that predict a loss token get logits — for Qwen2/Qwen3/Llama/Mistral
the vocabulary projection itself runs on those hidden states only (a prompt's other positions
never get a full-vocabulary row); other models compute all logits and select. The log-prob is
`gather(logits, target) - logsumexp(logits)`, so backward keeps no second full-vocabulary tensor
as `log_softmax` would. The entropy is computed under `no_grad`
a chunk of tokens at a time so its softmax temporaries stay small. Exceptions: non-float32
logits or a temperature ≠ 1 make a float32 / scaled copy per chunk, which backward keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from relayrl.backends.local.attention import packed_attention
from relayrl.backends.local.collate import PackedBatch
from relayrl.types import Trajectory


class CausalLM(Protocol):
    """What we need of a Hugging Face causal LM: callable returning an object with `.logits`."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = ...,
        position_ids: torch.Tensor | None = ...,
        use_cache: bool = ...,
    ) -> object: ...


def _logits(model: CausalLM, **inputs: object) -> torch.Tensor:
    out = model(**inputs)  # type: ignore[arg-type]
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"model output {type(out).__name__} has no `logits` tensor")
    return logits


CHUNK_ELEMENTS = 1 << 24  # full-vocabulary temporaries per chunk (64 MiB of float32)


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(…, V) logits and (…) integer targets → (log-prob of target, entropy), both (…); the
    entropy is detached unless `entropy_grad`.

    Computed in float32, `chunk_tokens` vectors of V logits at a time (None: as many as keep the
    temporaries under CHUNK_ELEMENTS); only the entropy and a dtype up-cast need full-vocabulary
    temporaries. With no targets the result is empty but still part of the autograd graph.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() < 2 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    vocab = logits.shape[-1]
    step = max(1, chunk_tokens if chunk_tokens is not None else CHUNK_ELEMENTS // max(1, vocab))
    flat_logits = logits.reshape(-1, vocab)
    if flat_logits.shape[0] == 0:
        empty = flat_logits.float().sum(-1)  # (0,), connected to the graph: backward() still works
        return empty.view(targets.shape), empty.detach().view(targets.shape)
    logps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    # `split` (not slicing in a loop): backward then concatenates the chunk gradients instead of
    # adding one full-size zero-padded gradient per chunk
    for chunk, target in zip(flat_logits.split(step), targets.reshape(-1).split(step)):
        if chunk.dtype != torch.float32:
            chunk = chunk.float()
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        lse = torch.logsumexp(chunk, dim=-1)
        logps.append(picked - lse)
        if entropy_grad:
            ents.append(lse - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
            continue
        with torch.no_grad():
            detached = chunk.detach()
            probs = torch.softmax(detached, dim=-1)
            ents.append(lse.detach() - (probs * detached).sum(-1))
            del probs
    return torch.cat(logps).view(targets.shape), torch.cat(ents).view(targets.shape)


def token_logprobs(
    model: CausalLM, batch: PackedBatch, temperature: float = 1.0, chunk_tokens: int | None = None, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per loss token (log-prob of `batch.target_ids`, entropy), each (T,) float32, from one
    forward pass over the packed batch. `temperature` must match the sampler's for the log-probs
    to be comparable. `chunk_tokens`: see `logprobs_from_logits` (a small vocabulary takes the
    whole batch in one chunk).
    """
    with packed_attention(model, batch.segment_ids, batch.branch_ids) as mask:
        inputs: dict[str, object] = {
            "input_ids": batch.input_ids,
            "attention_mask": mask,
            "position_ids": batch.position_ids,
            "use_cache": False,
        }
        split = _plain_head(model)
        if split is not None:  # the vocabulary projection only where a loss token is predicted
            base, head = split
            hidden = base(**inputs, return_dict=True).last_hidden_state
            predicting = head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.source_index))
        else:
            logits = _logits(model, **inputs)
            predicting = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.source_index)
    return logprobs_from_logits(predicting, batch.target_ids, temperature, chunk_tokens, entropy_grad)


# Causal LMs whose logits are exactly lm_head(base_model(...).last_hidden_state): no soft-capping,
# scaling or bias added in the head (checked against their transformers `forward`).
PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def _plain_head(model: CausalLM) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(base model, output projection) when logits may be computed for chosen positions only."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):  # sharded (FSDP2): only the root's own forward gathers its parameters
        return None
    base = getattr(model, "base_model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(base, torch.nn.Module) or base is model or not isinstance(head, torch.nn.Module):
        return None
    return base, head


def unpacked_token_logprobs(
    model: CausalLM, trajectories: Sequence[Trajectory], temperature: float = 1.0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Reference: one plain forward pass per trajectory (no packing, no mask). Returns, per
    trajectory, the log-probs and entropies of its policy tokens (every completion token, or
    those with `loss_mask` 1 in a multi-turn trajectory)."""
    device = _model_device(model)
    logps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    for traj in trajectories:
        n_prompt, n_comp = len(traj.prompt_tokens), len(traj.completion_tokens)
        if n_comp == 0:
            logps.append(torch.zeros(0))
            ents.append(torch.zeros(0))
            continue
        if n_prompt == 0:
            raise ValueError(
                f"trajectory group_id={traj.group_id} sample_index={traj.sample_index}: "
                "empty prompt_tokens; the first completion token has no predictor"
            )
        ids = torch.tensor([traj.prompt_tokens + traj.completion_tokens], dtype=torch.long, device=device)
        logits = _logits(model, input_ids=ids, use_cache=False)[0, n_prompt - 1 : -1]
        lp, ent = logprobs_from_logits(logits, ids[0, n_prompt:], temperature)
        if traj.loss_mask is not None:
            policy = torch.tensor(traj.loss_mask, dtype=torch.bool, device=lp.device)
            lp, ent = lp[policy], ent[policy]
        logps.append(lp)
        ents.append(ent)
    return logps, ents


def _model_device(model: CausalLM) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")
