"""Worker interfaces every backend implements (sim, local torch, Ray).

Invariant: every call a stage makes on a worker is awaitable, so an in-process object and a Ray
actor handle look the same to the orchestrator. Heavy compute never runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from relayrl.types import GenerateResult, MicroBatch, SampleRequest, Trajectory


@dataclass(slots=True, frozen=True)
class Weights:
    """A policy version's weights as they travel to samplers; `payload` is backend-specific."""

    version: int
    payload: object


class Sampler(Protocol):
    replica: int

    @property
    def version(self) -> int:
        """The policy version whose weights are loaded now."""
        ...

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        """Sample every request with the weights loaded when the call starts."""
        ...

    async def load_weights(self, weights: Weights) -> None:
        """Swap to `weights` (no reload from disk). Never called while another load runs."""
        ...

    async def close(self) -> None: ...


class Trainer(Protocol):
    async def train_step(self, mb: MicroBatch) -> None:
        """Forward + backward on one packed micro-batch, accumulating gradients."""
        ...

    async def optim_step(self) -> int:
        """Apply the accumulated update; returns the new policy version. Overwrites the metrics
        slot that `get_metrics` reads."""
        ...

    async def get_metrics(self) -> dict[str, float]:
        """Metrics of the last committed step (read from the slot `optim_step` filled)."""
        ...

    async def export_weights(self) -> Weights: ...

    async def save_state(self, directory: Path) -> None:
        """Write the committed state (weights, optimizer, schedule, version) into `directory`.
        Called between a commit and the next `optim_step`, which waits for it; training may run
        meanwhile, so it must not wait behind a train step."""
        ...

    async def load_state(self, directory: Path) -> int:
        """Restore what `save_state` wrote (before any training); returns its version."""
        ...

    async def close(self) -> None: ...


class Collator(Protocol):
    """Turns a planned micro-batch into what the trainer consumes. Runs in a packing thread.

    Rows were sized by `relayrl.packing.layout_tokens`: with `mb.share_prompt` a collator must
    lay each row out as `relayrl.packing.segments` (one prompt copy per segment) or it may
    exceed the row budget."""

    def collate(self, mb: MicroBatch) -> object: ...


class RewardFn(Protocol):
    """Scores one trajectory. May raise: the trajectory is then marked failed with reward 0."""

    __name__: str

    def __call__(self, trajectory: Trajectory) -> float: ...
