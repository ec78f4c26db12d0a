"""The command line (`relayrl train | check-trace | report | runs | bench`) and how the process
answers signals. It parses, calls the orchestrator or analysis, and turns every failure into one
line and an exit code; nothing else imports it."""
