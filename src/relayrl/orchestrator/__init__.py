"""The orchestrator: builds a run from its config, then drives the stages (orchestrator/stages/) and
the primitives they share (window, ledger, replicas, deferred jobs, deadlines, watchdog) under one
TaskGroup. It talks to workers only through backends/protocols.py; workers never import it."""
