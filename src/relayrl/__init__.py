"""relayrl: an asynchronous RL post-training orchestrator whose trainer never waits for work that
could have overlapped it."""

__version__ = "0.1.0"
