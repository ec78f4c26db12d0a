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
        for sampler in self.samplers:
            await sampler.close()
        if self.evaluator is not None:
            await self.evaluator.close()
        await self.trainer.close()


def build_sim_backend(cfg: Config, abort: threading.Event) -> Backend:
    from relayrl.backends.sim import SimCollator, SimSampler, SimTokenizer, SimTrainer, host_costs

    return Backend(
        trainer=SimTrainer(cfg.sim),
        samplers=[SimSampler(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=i) for i in range(cfg.rollout.num_samplers)],
        collator=SimCollator(cfg.sim, abort),
        tokenize=SimTokenizer(cfg.sim.prompt_tokens),
        host_costs=host_costs(cfg),
    )
