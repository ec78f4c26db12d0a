"""Tasks: prompt streams with verifiable answers (synthetic, arithmetic, JSONL, reasoning-gym) and rewards."""
