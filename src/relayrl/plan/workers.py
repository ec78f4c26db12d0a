"""The modelled workers a planned run trains with: the sim backend's sampler and trainer with the
fitted costs (relayrl.plan.fit) spent on shared devices (relayrl.plan.resources).

`PlanSampler` draws each prompt's success rate from the measured per-prompt rates (a pure
function of the seed and the prompt) and each completion's length from the measured lengths; a
completion is the prompt's answer with that rate, else a wrong number, so the task's own reward
scores it and dynamic sampling filters the groups whose rewards tie, as in the measured run.
A call costs the fitted generate time of its sequences on the replica's device. `PlanTrainer`
spends the fitted train_step time of each micro-batch's tokens, and optim_step, on the trainer's
device; the metrics fetch, the sync round and checkpoints sleep their measured medians.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import random
from collections.abc import Sequence
from pathlib import Path

from relayrl.backends.protocols import Sampler
from relayrl.backends.sim.workers import SimTrainer
from relayrl.config.schema import SimConfig
from relayrl.plan.fit import PlanModel
from relayrl.plan.resources import Device
from relayrl.types import Completion, GenerateResult, SampleRequest, TrainBatch, Weights


class _Empirical:
    """Draws from a histogram {value: count}."""

    def __init__(self, histogram: dict[str, int]) -> None:
        items = sorted((float(k), n) for k, n in histogram.items() if n > 0)
        self.values = [v for v, _ in items]
        self._cum: list[int] = []
        total = 0
        for _, n in items:
            total += n
            self._cum.append(total)

    def draw(self, rng: random.Random) -> float:
        return self.values[bisect.bisect_right(self._cum, rng.randrange(self._cum[-1]))]


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


class PlanSampler(Sampler):
    """One modelled sampler replica (see the module)."""

    def __init__(self, model: PlanModel, device: Device, max_new_tokens: int, seed: int, replica: int) -> None:
        self._model = model
        self._device = device
        self._max_new = max_new_tokens
        self._seed = seed
        self._replica = replica
        self._version = 0
        self._warm = False
        self._lengths = _Empirical(model.completion_lengths)
        self._success = _Empirical(model.success_rates)

    def _rate(self, prompt: str) -> float:
        digest = hashlib.blake2b(f"{self._seed}\x00{prompt}".encode(), digest_size=8).digest()
        return self._success.draw(random.Random(int.from_bytes(digest, "little")))

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        version = self._version
        results: list[GenerateResult] = []
        sequences = 0
        for req in requests:
            p = self._rate(req.prompt.text)
            rng = random.Random(f"{self._seed}\x00{req.seed_key}\x00{version}")
            answer = req.prompt.answer
            wrong = str(int(answer) + 1) if answer.lstrip("-").isdigit() else answer + "?"
            completions = []
            for _ in range(req.num_samples):
                n = max(1, min(self._max_new, round(self._lengths.draw(rng))))
                text = answer if rng.random() < p else wrong
                completions.append(Completion(tokens=[rng.randrange(2, 64) for _ in range(n)], logprobs=[-0.5] * n, text=text))
            sequences += req.num_samples
            results.append(GenerateResult(req, completions, version, self._replica))
        cost = self._model.generate
        work = cost.cost(sequences * self._model.tokens_per_sequence)
        if not self._warm:
            self._warm, work = True, work + cost.warmup_s
        await self._device.run(work)
        return results

    async def load_weights(self, weights: Weights) -> None:
        await _sleep(self._model.load_s)
        self._version = weights.version


class PlanTrainer(SimTrainer):
    """The modelled trainer (see the module): SimTrainer's bookkeeping, the fitted costs."""

    def __init__(self, model: PlanModel, device: Device, ppo_epochs: int = 1) -> None:
        super().__init__(SimConfig(), ppo_epochs=ppo_epochs)
        self._model = model
        self._device = device
        self._warm = False

    async def train_step(self, batch: TrainBatch) -> None:
        work = self._model.train_step.cost(batch.num_tokens)
        if not self._warm:
            self._warm, work = True, work + self._model.train_step.warmup_s
        await self._device.run(work)
        await super().train_step(batch)  # the sim's bookkeeping (its own cost is 0)

    async def optim_step(self) -> int:
        await self._device.run(self._model.optim_step_s)
        return await super().optim_step()

    async def get_metrics(self) -> dict[str, float]:
        await _sleep(self._model.get_metrics_s)
        return await super().get_metrics()

    async def save_state(self, directory: Path) -> None:
        await _sleep(self._model.checkpoint_s)
        await super().save_state(directory)
