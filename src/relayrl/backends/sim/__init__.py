"""The sim backend: latency-simulating workers (`workers`) and their bundle (`build`)."""

from relayrl.backends.sim.workers import SimCollator, SimHostWork, SimSampler, SimTokenizer, SimTrainer

__all__ = ["SimCollator", "SimSampler", "SimTokenizer", "SimTrainer", "SimHostWork"]
