"""The sim compute kind: latency-simulating workers (`workers`) and the kind's registry entry (`build`)."""

from relayrl.backends.sim.workers import SimCollator, SimHostWork, SimSampler, SimTokenizer, SimTrainer

__all__ = ["SimCollator", "SimSampler", "SimTokenizer", "SimTrainer", "SimHostWork"]
