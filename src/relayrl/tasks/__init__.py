"""Tasks: prompt streams with verifiable answers (synthetic, arithmetic, JSONL) and rewards."""
