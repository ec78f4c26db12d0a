"""A stand-in vLLM replica for a Ray sampler actor (tests/ray/test_ray_transports.py): its
"engine" joins the collective weight group in the actor's place, as a `VllmSampler` started with
relayrl's weight-transfer engine does (`transfer_refusal` None, `join_transfer`, `receive_round`),
and loads into a plain model what it receives; from round `fail_from` on its receive fails after
leaving the group, as relayrl's engine does when a receive fails. `loaded` records each load:
("engine", version) for a round received, ("load_weights", version) for any other load."""

from __future__ import annotations

import asyncio
from typing import Any

from relayrl.bench.weights import BenchSampler
from relayrl.types import Weights


class EngineSampler(BenchSampler):
    def __init__(self, model: str, dtype: str, seed: int, fail_from: int | None = None) -> None:
        super().__init__(model, dtype, seed)
        self.fail_from = fail_from
        self.loaded: list[tuple[str, int]] = []
        self._member: Any = None

    def transfer_refusal(self) -> str | None:
        return None

    async def join_transfer(self, host: str, port: int, receiver: int, world: int, backend: str, timeout_s: float) -> None:
        from relayrl.backends.ray.collective import Member

        self._member = await asyncio.to_thread(Member.join, host, port, backend, timeout_s, world - 1, receiver=receiver)

    async def receive_round(self, round_: int, version: int | None = None) -> int:
        if self.fail_from is not None and round_ >= self.fail_from:
            error = RuntimeError(f"the stand-in engine fails round {round_}")
            self._member.fail(error)  # (leaves the group: the trainer's broadcast fails at once)
            raise error
        got, views = await asyncio.to_thread(self._member.receive, round_)
        await super().load_weights(Weights(got, views))
        self.loaded.append(("engine", got))
        return got

    async def load_weights(self, weights: Any) -> None:
        await super().load_weights(weights)
        self.loaded.append(("load_weights", weights.version))
