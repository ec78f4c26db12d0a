"""Collated micro-batches of arithmetic trajectories, for the sharded trainer's tests (local and
on Ray): the same steps fed to it and to the one-process trainer, and the training loop that
feeds them."""

from __future__ import annotations

import random
from typing import Any

import torch

from relayrl.backends.local.collate import TorchCollator
from relayrl.packing import build_microbatch, plan
from relayrl.types import Prompt, TrainBatch
from support.trajectories import trajectory


def microbatch_steps(tok: Any, steps: int = 3, minibatches: int = 1) -> list[list[TrainBatch]]:
    """`steps` steps of 3 micro-batches each (of different sizes): a full round of 2 and a partial
    one; with `minibatches` > 1 every micro-batch made (10 groups of one, minibatch by minibatch)."""
    rng = random.Random(0)
    out: list[list[TrainBatch]] = []
    for step in range(steps):
        trajs = []
        for i in range(10):
            a, b = rng.randrange(10, 99), rng.randrange(10, 99)
            ids = tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
            completion = tok(str(a + b + rng.choice([0, 0, 1])), add_special_tokens=False)["input_ids"][: rng.randrange(1, 4)]
            p = Prompt(f"p{i}", f"{a}+{b}=", str(a + b))
            trajs.append(
                trajectory(
                    sample=i,
                    prompt=p,
                    prompt_tokens=ids,
                    completion_tokens=completion,
                    logprob=-1.5 - 0.1 * i,
                    text="",
                    advantage=rng.uniform(-1, 1),
                    group=i if minibatches > 1 else 0,
                )
            )
        pp = plan(trajs, 24, 1, share_prompt=False, minibatches=minibatches)
        batches = []
        for index in range(len(pp.microbatches)):
            mb = build_microbatch(step, index, trajs, pp)
            mb.payload = TorchCollator(pad_token_id=0).collate(mb)
            batches.append(mb.train_batch())
        if minibatches > 1:
            out.append(batches)
            continue
        out.append(batches[: len(batches) - 1 + len(batches) % 2])  # (the normaliser still counts a dropped one: fine for both)
    assert minibatches > 1 or all(len(b) % 2 == 1 and len(b) > 1 for b in out)  # each step ends with a partial round
    return out


async def train_steps(trainer: Any, steps: list[list[TrainBatch]]) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """Train `steps` (each step's micro-batches, then its update): every step's metrics, and the
    weights after the last (a Ray trainer's object-store reference resolved)."""
    metrics = []
    for batches in steps:
        for tb in batches:
            await trainer.train_step(tb)
        await trainer.optim_step()
        metrics.append(await trainer.get_metrics())
    weights = await trainer.export_weights()
    if not isinstance(weights.payload, dict):  # a Ray trainer's reference into the object store
        from relayrl.backends.ray.actors import resolve

        weights = await resolve(weights)
    return metrics, {k: v.clone() for k, v in dict(weights.payload).items()}


def named(name: str, message: str) -> str:
    """An `assert_close` message naming the tensor (`functools.partial(named, name)`)."""
    return f"{name}: {message}"


def assert_trained_alike(sharded: dict[str, torch.Tensor], single: dict[str, torch.Tensor], lr: float) -> None:
    """The weights after a few steps of the sharded trainer equal one process's, up to what
    AdamW makes of rounding: the ranks sum gradients in another order, and an element whose
    gradient is tiny against that noise (a key bias's is 0 in exact arithmetic: softmax ignores a
    constant added to every key) gets a normalised step of up to the learning rate either way.
    So a key bias within 3 steps of `lr`; elsewhere every element within 3 steps of `lr` and all
    but 0.01% within 1e-5 (measured on a 2-core Xeon: one element of layers.3.q_proj 2.4e-5 apart)."""
    assert set(sharded) == set(single)
    for name, value in single.items():
        diff = (sharded[name] - value).abs()
        assert float(diff.max()) <= 3 * lr, named(name, f"max difference {float(diff.max()):.3g}")
        if not name.endswith("k_proj.bias"):
            off = int((diff > 1e-5).sum())
            assert off <= 1e-4 * diff.numel(), named(name, f"{off} of {diff.numel()} elements differ by > 1e-5")
