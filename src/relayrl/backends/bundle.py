"""The workers a run uses, built for the configured backend.

Invariant: the program only sees the protocols; which backend built them is invisible to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.backends.protocols import Collator, Sampler, Trainer
from relayrl.config import Config
from relayrl.evaluation import HeldoutEvaluator


@dataclass(slots=True)
class Backend:
    trainer: Trainer
    samplers: list[Sampler]
    collator: Collator
    tokenize: Callable[[str], list[int]]
    host_costs: dict[str, float] = field(default_factory=dict)  # sim only: CPU per bookkeeping span
    evaluator: HeldoutEvaluator | None = None

    async def close(self) -> None:
        """Close every worker, even when some fail to close (a retired replica may be broken);
        the first error is raised after all were tried."""
        closers = [s.close for s in self.samplers]
        if self.evaluator is not None:
            closers.append(self.evaluator.close)
        closers.append(self.trainer.close)
        first: Exception | None = None
        for close in closers:
            try:
                await close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first


def build_sim_backend(cfg: Config, abort: threading.Event) -> Backend:
    from relayrl.backends.sim import SimCollator, SimSampler, SimTokenizer, SimTrainer, host_costs

    return Backend(
        trainer=SimTrainer(cfg.sim),
        samplers=[SimSampler(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=i) for i in range(cfg.rollout.num_samplers)],
        collator=SimCollator(cfg.sim, abort),
        tokenize=SimTokenizer(cfg.sim.prompt_tokens),
        host_costs=host_costs(cfg),
    )
