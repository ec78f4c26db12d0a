"""A run's configuration: the models (keys described, resumable ones marked), TOML loading, `--set`
overrides, docs/configuration.md rendered from them, the pip extras a config needs and the memory it
can hold. All checked before a run starts; nothing here imports the orchestrator, a backend or torch."""
