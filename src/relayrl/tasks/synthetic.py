"""A synthetic prompt stream for the sim backend: numbered prompts with known answers.

Invariant: the stream is a pure function of the seed; prompt ids are unique.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from relayrl.types import Prompt


def synthetic_stream(seed: int) -> Iterator[Prompt]:
    rng = random.Random(seed)
    i = 0
    while True:
        a, b = rng.randrange(100), rng.randrange(100)
        yield Prompt(prompt_id=f"sim-{i}", text=f"{a}+{b}=", answer=str(a + b))
        i += 1


def synthetic_heldout(n: int, seed: int) -> list[Prompt]:
    stream = synthetic_stream(seed + 1_000_003)
    return [Prompt(f"sim-heldout-{i}", p.text, p.answer) for i, p in zip(range(n), stream)]
