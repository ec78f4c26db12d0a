"""The sim compute kind (`run.backend = "sim"`, see `relayrl.backends.registry`): latency-simulating
workers, no model (`relayrl.backends.sim.workers`).

It runs multi-turn episodes (one sim token per character of an observation) but no held-out
evaluation: it has no greedy engine and no detokenizer (`eval.enabled` has no effect with it).
"""

from __future__ import annotations

import functools
import threading

from relayrl.backends.protocols import UnsupportedError
from relayrl.backends.registry import Compute
from relayrl.backends.sim.workers import SimCollator, SimHostWork, SimSampler, SimTokenizer, SimTrainer, sim_encode_text
from relayrl.config.schema import Config


def sim_sampler(cfg: Config, replica: int) -> SimSampler:
    """Sampler replica `replica` (a factory: run in the process that hosts it)."""
    return SimSampler(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=replica, interruptible=cfg.rollout.interrupts)


def sim_trainer(cfg: Config) -> SimTrainer:
    """The trainer (a factory: run in the process that hosts it)."""
    return SimTrainer(cfg.sim, ppo_epochs=cfg.train.ppo_epochs)


def sim_decode(tokens: list[int]) -> str:
    raise UnsupportedError("the sim backend has no detokenizer (run.backend=sim)")


def compute(cfg: Config, abort: threading.Event) -> Compute:
    """`abort` is the orchestrator's abort flag, which the collator's CPU burn checks."""
    return Compute(
        collator=SimCollator(cfg.sim, abort),
        tokenize=SimTokenizer(cfg.sim.prompt_tokens),
        encode_text=sim_encode_text,
        decode=sim_decode,
        max_prompt_tokens=None,
        greedy_engine=None,
        trainer=functools.partial(sim_trainer, cfg),
        samplers=[functools.partial(sim_sampler, cfg, i) for i in range(cfg.rollout.num_samplers)],
        host_work=SimHostWork(cfg),
    )
