"""A run's configuration: the pydantic models, TOML loading and `--set` overrides, the pip extras a
config needs and the memory it can hold. Everything here is checked before a run starts; nothing
here imports the orchestrator, a backend or torch."""
