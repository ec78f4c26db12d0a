"""Endless training prompts from a finite list: every prompt once per epoch, in an order fixed
by a key and the epoch number (or the list's own order), with random access for resuming.

Invariant: `stream(start)` yields `prompt_at(start)`, `prompt_at(start + 1)`, ... for ever, and
`prompt_at(i)` depends only on the list, the key and i.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from relayrl.types import Prompt


class EpochCycle:
    def __init__(self, prompts: Sequence[Prompt], shuffle_key: str | None) -> None:
        """`shuffle_key` seeds each epoch's shuffle (`"<key>:<epoch>"`); None keeps list order."""
        if not prompts:
            raise ValueError("an epoch cycle needs at least one prompt")
        self.prompts = tuple(prompts)
        self.shuffle_key = shuffle_key

    def order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle_key is not None:
            random.Random(f"{self.shuffle_key}:{epoch}").shuffle(order)
        return order

    def prompt_at(self, index: int) -> Prompt:
        """Training item number `index` (epoch `index // len(prompts)`)."""
        if index < 0:
            raise ValueError(f"training prompt index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self.prompts))
        return self.prompts[self.order(epoch)[pos]]

    def stream(self, start: int = 0) -> Iterator[Prompt]:
        """Endless training prompts from item `start` on."""
        if start < 0:
            raise ValueError(f"training prompt index must be >= 0, got {start}")
        epoch, pos = divmod(start, len(self.prompts))
        while True:
            for i in self.order(epoch)[pos:]:
                yield self.prompts[i]
            epoch, pos = epoch + 1, 0
