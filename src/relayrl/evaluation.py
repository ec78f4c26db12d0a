"""Held-out evaluation: greedy exact-match accuracy of a given policy version.

Invariant: an evaluation reports the version whose weights it measured (the engine loads those
weights first), on the same fixed prompts every time, so accuracies are comparable across a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from relayrl.backends.protocols import Weights
from relayrl.types import Prompt


class GreedyEngine(Protocol):
    @property
    def version(self) -> int: ...

    async def load_weights(self, weights: Weights) -> None: ...

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...

    async def close(self) -> None: ...


@dataclass(slots=True, frozen=True)
class EvalResult:
    version: int
    accuracy: float
    num_prompts: int
    seconds: float


class HeldoutEvaluator:
    def __init__(
        self,
        engine: GreedyEngine,
        prompts: Sequence[Prompt],
        tokenize: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        max_new_tokens: int,
    ) -> None:
        if not prompts:
            raise ValueError("held-out evaluation needs at least one prompt (task.heldout_size)")
        self._engine = engine
        self._prompts = list(prompts)
        self._tokens = [tokenize(p.text) for p in prompts]
        self._decode = decode
        self._max_new_tokens = max_new_tokens

    async def evaluate(self, weights: Weights | None) -> EvalResult:
        """Accuracy of `weights` (None: of the weights the engine holds now)."""
        start = time.perf_counter()
        if weights is not None:
            await self._engine.load_weights(weights)
        outputs = await self._engine.greedy(self._tokens, self._max_new_tokens)
        correct = sum(self._decode(out).strip() == p.answer.strip() for out, p in zip(outputs, self._prompts, strict=True))
        return EvalResult(self._engine.version, correct / len(self._prompts), len(self._prompts), time.perf_counter() - start)

    async def close(self) -> None:
        await self._engine.close()
