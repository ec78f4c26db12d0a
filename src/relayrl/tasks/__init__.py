"""Tasks: prompt streams with verifiable answers (synthetic, arithmetic, JSONL, reasoning-gym) and
their fixed held-out sets. A task yields `Prompt`s; scoring them is rewards/' job; nothing here
imports the orchestrator."""
