"""The maths of the objective: group-relative advantages and the policy loss, on plain floats and
torch tensors. Pure functions with no I/O; nothing here imports the orchestrator or a backend."""
