"""What a run records while it runs: the trace (tracer), per-step metrics and their sinks, the
trajectory log, the per-step bookkeeping and callbacks, console progress, memory release. It
records and reports; it never steers the orchestrator or imports it."""
