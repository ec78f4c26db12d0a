"""Build the sim backend: latency-simulating workers, no model (see `relayrl.backends.sim.workers`)."""

from __future__ import annotations

import threading

from relayrl.backends.bundle import Backend
from relayrl.backends.sim.workers import SimCollator, SimHostWork, SimSampler, SimTokenizer, SimTrainer, sim_encode_text
from relayrl.config.schema import Config


def build_sim_backend(cfg: Config, abort: threading.Event) -> Backend:
    """`abort` is the orchestrator's abort flag, which the collator's CPU burn checks."""
    return Backend(
        trainer=SimTrainer(cfg.sim),
        samplers=[SimSampler(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=i) for i in range(cfg.rollout.num_samplers)],
        collator=SimCollator(cfg.sim, abort),
        tokenize=SimTokenizer(cfg.sim.prompt_tokens),
        host_work=SimHostWork(cfg),
        encode_text=sim_encode_text,
    )
