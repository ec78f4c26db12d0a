"""Reward functions: the built-ins and the registry of names, resolving `task.reward_functions`, and
the scorer that runs them (inline, in reward call threads or in worker processes, each bounded in
time) and turns their results into rewards or failures."""
