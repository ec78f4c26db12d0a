"""The run directory: its ownership and lock, its own files (config.toml, summary.json, the JSONL
files), and the checkpoint format. Every file here is written atomically or appended line by
line; nothing here imports the orchestrator."""
