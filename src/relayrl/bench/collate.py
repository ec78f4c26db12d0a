"""`relayrl bench collate`: collation of packed micro-batches with shared prompts, the current
path (segment and branch ids; the mask built later on the trainer's device) beside the old one
(the same layout plus the dense (rows, 1, L, L) boolean mask built on the driver's CPU and
shipped in the batch), measured in the same run.

Cases: micro-batches of about 3k, 6k and 11k tokens, two rows each holding one group of four
completions behind one shared prompt copy. Per case and path: `tokens` (laid-out tokens),
`collate_ms` (median of the timed repeats, after one warm-up) and `batch_bytes` (the bytes of
every tensor in the batch); `tokens_unshared` (what the same trajectories take without prompt
sharing) shows the sharing's saving, which both paths keep. The new path also reports `mask_ms`:
what the trainer itself now spends building the mask on `--device` (the dense boolean mask on
the CPU, a FlexAttention block mask on CUDA), off the driver.
"""

from __future__ import annotations

import random
import statistics
import time
from functools import partial
from typing import Any

import torch

from relayrl.backends.local import attention
from relayrl.backends.local.collate import PackedBatch, TorchCollator
from relayrl.errors import UserError
from relayrl.packing import build_microbatch, plan
from relayrl.types import MicroBatch, Prompt, Trajectory, TrajectoryStatus

#: Cases as (name, prompt tokens, completion tokens, completions per group, rows).
CASES: list[tuple[str, int, int, int, int]] = [
    ("3k", 256, 320, 4, 2),
    ("6k", 512, 640, 4, 2),
    ("11k", 1024, 1152, 4, 2),
]
#: The target for the 11k-token micro-batch on the CPU (issue 31).
TARGET_11K_MS = 50.0


def microbatch(prompt_tokens: int, completion_tokens: int, completions: int, rows: int, seed: int = 0) -> MicroBatch:
    """A packed micro-batch of `rows` groups (one per row), each `completions` completions of
    `completion_tokens` tokens sharing one `prompt_tokens`-token prompt."""
    rng = random.Random(seed)
    trajectories: list[Trajectory] = []
    for g in range(rows):
        prompt = [rng.randrange(3, 30000) for _ in range(prompt_tokens)]
        for s in range(completions):
            completion = [rng.randrange(3, 30000) for _ in range(completion_tokens)]
            trajectories.append(
                Trajectory(
                    group_id=g,
                    sample_index=s,
                    prompt=Prompt(f"p{g}", "", ""),
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    sampler_logprobs=[-rng.random() for _ in completion],
                    completion_text="",
                    policy_version=0,
                    replica=0,
                    reward=0.0,
                    advantage=rng.uniform(-1, 1),
                    status=TrajectoryStatus.OK,
                )
            )
    pack = plan(trajectories, prompt_tokens + completions * completion_tokens, rows, share_prompt=True)
    return build_microbatch(0, 0, trajectories, pack)


def _old_prefix_tree_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """The old collation's dense mask, as it was built on the driver (8202bc9, `collate.py`)."""
    rows, length = segment_ids.shape
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids >= 0)[:, :, None]
    visible = (branch_ids[:, None, :] < 0) | (branch_ids[:, :, None] == branch_ids[:, None, :])
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril_()
    eye = torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    mask = (same & real & visible & causal) | eye
    return mask.unsqueeze(1)


def _old_collate(collator: TorchCollator, mb: MicroBatch) -> dict[str, torch.Tensor]:
    """The old path's batch: the same layout (whose loop is unchanged) with the dense boolean
    mask in place of the branch ids, as the driver built and shipped it."""
    batch = collator.collate(mb)
    tensors = _tensors(batch)
    branch = tensors.pop("branch_ids")
    tensors["attention_mask"] = _old_prefix_tree_mask(batch.segment_ids, branch)
    return tensors


def _tensors(batch: PackedBatch) -> dict[str, torch.Tensor]:
    return {name: value for name in batch.__slots__ if isinstance(value := getattr(batch, name), torch.Tensor)}


def batch_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _timed_ms(fn: Any, repeats: int) -> tuple[float, Any]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def _device_mask(batch: PackedBatch, device: torch.device) -> object:
    """The mask the trainer builds on `device` for sdpa (`attention.mask_form`), finished."""
    if attention.mask_form("sdpa", device) == "block":
        block = attention.prefix_tree_block_mask(batch.segment_ids, batch.branch_ids)
        torch.cuda.synchronize(device)
        return block
    return attention.prefix_tree_mask(batch.segment_ids, batch.branch_ids)


def run_collate(repeats: int = 5, scale: float = 1.0, device: str = "cpu") -> dict[str, object]:
    """{"cases": [per case: name, rows, length, tokens, tokens_unshared, and per path ("new",
    "old") tokens, collate_ms, batch_bytes; "new" also mask_ms, the trainer's own build of the
    mask on `device`], "target_11k_ms", "repeats", "scale", "device"} (see the module). `scale`
    (0, 1] shortens every prompt and completion (a quick run)."""
    if repeats < 1 or not 0 < scale <= 1:
        raise UserError(f"bench collate: --repeats must be >= 1 and --scale in (0, 1], got {repeats} and {scale}")
    try:
        where = torch.device(device)
    except RuntimeError as exc:
        raise UserError(f"bench collate: --device {device!r}: {exc}") from None
    if where.type not in ("cpu", "cuda") or (where.type == "cuda" and not torch.cuda.is_available()):
        raise UserError(f"bench collate: --device {device!r}: cpu, or cuda[:N] where CUDA is available")
    collator = TorchCollator(pad_token_id=0)
    out: list[dict[str, object]] = []
    for name, n_prompt, n_comp, completions, rows in CASES:
        mb = microbatch(max(1, round(n_prompt * scale)), max(1, round(n_comp * scale)), completions, rows)
        new_ms, batch = _timed_ms(partial(collator.collate, mb), repeats)
        old_ms, old = _timed_ms(partial(_old_collate, collator, mb), repeats)
        del old["attention_mask"]  # (60 MiB at 11k: freed before the next case)
        old_bytes = batch_bytes(old) + int(batch.shape[0]) * int(batch.shape[1]) ** 2  # + the bool mask
        tokens = batch.num_real_tokens
        mask_ms, _ = _timed_ms(partial(_device_mask, batch.to(where), where), repeats)
        out.append(
            {
                "name": name,
                "rows": batch.shape[0],
                "length": batch.shape[1],
                "tokens": tokens,
                "tokens_unshared": sum(t.num_tokens for t in mb.trajectories),
                "new": {"tokens": tokens, "collate_ms": new_ms, "batch_bytes": batch_bytes(_tensors(batch)), "mask_ms": mask_ms},
                "old": {"tokens": tokens, "collate_ms": old_ms, "batch_bytes": old_bytes},
            }
        )
    return {"cases": out, "target_11k_ms": TARGET_11K_MS, "repeats": repeats, "scale": scale, "device": str(where)}
