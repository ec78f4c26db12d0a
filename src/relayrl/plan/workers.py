"""The modelled workers a planned run trains with: the sim backend's sampler and trainer with the
fitted costs (relayrl.plan.fit) spent on shared devices (relayrl.plan.resources).

`PlanSampler` draws each prompt's success rate from the measured per-prompt rates (a pure
function of the seed and the prompt) and each completion's length from the measured lengths; a
completion is the prompt's answer with that rate, else a wrong number, so the task's own reward
scores it and dynamic sampling filters the groups whose rewards tie, as in the measured run.
A call costs the fitted decode time of its rows (sequences) and passes (its longest completion's
tokens) on the replica's device. `PlanTrainer`
spends the fitted train_step time of each micro-batch's padded positions (rows × padded length), and optim_step, on the trainer's
device; the metrics fetch, the sync round and checkpoints sleep their measured medians.

On Ray (the target's `ray.enabled`), the workers are actors one round trip away
(`RayCosts`): a sampler call's result comes back its round trip (a fixed part and one per row it
carries) after its work ends, and
`RayPlanTrainer` runs its calls in order on a modelled actor the way `RayTrainer` drives the real
one (a micro-batch sent ahead of the previous one's end, the next step's first one queued behind
`optim_step`): each reaches the actor half a round trip after it is sent and its result the driver
half a round trip after it ends, and the actor's own spans (lane `actor:trainer`, the work alone)
are what the trainer busy fraction is read from, as on Ray.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import hashlib
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from relayrl.backends.protocols import Sampler
from relayrl.backends.sim.workers import SimTrainer
from relayrl.config.schema import SimConfig
from relayrl.plan.fit import PlanModel
from relayrl.plan.resources import Device
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Completion, GenerateResult, SampleRequest, TrainBatch, Weights


@dataclass(slots=True, frozen=True)
class RayCosts:
    """A Ray actor's round trips (PlanModel.ray): the trainer's (the gap a driver round trip leaves
    in the trainer actor, before its optim_step) and a sampler's (a generate call's window less
    the actor's span of it: the requests out, the results back), a fixed part and one per row."""

    trainer_call_s: float
    sampler_call_s: float
    sampler_call_per_row_s: float = 0.0

    def sampler_call(self, rows: int) -> float:
        """A generate call's round trip, carrying `rows` sequences."""
        return self.sampler_call_s + self.sampler_call_per_row_s * rows


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

    def __init__(self, model: PlanModel, device: Device, max_new_tokens: int, seed: int, replica: int, ray: RayCosts | None = None) -> None:
        self._model = model
        self._ray = ray
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
        sequences = passes = 0
        for req in requests:
            p = self._rate(req.prompt.text)
            rng = random.Random(f"{self._seed}\x00{req.seed_key}\x00{version}")
            answer = req.prompt.answer
            wrong = str(int(answer) + 1) if answer.lstrip("-").isdigit() else answer + "?"
            completions = []
            for _ in range(req.num_samples):
                n = max(1, min(self._max_new, round(self._lengths.draw(rng))))
                passes = max(passes, n)  # a call decodes until its longest completion ends
                text = answer if rng.random() < p else wrong
                completions.append(Completion(tokens=[rng.randrange(2, 64) for _ in range(n)], logprobs=[-0.5] * n, text=text))
            sequences += req.num_samples
            results.append(GenerateResult(req, completions, version, self._replica))
        cost = self._model.generate
        work = cost.cost(sequences, passes)
        if not self._warm:
            self._warm, work = True, work + cost.warmup_s
        await self._device.run(work)
        if self._ray is not None:  # the round trip: out to the actor and the results back
            await _sleep(self._ray.sampler_call(sequences))
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
        work = self._model.train_step.cost(batch.padded_tokens or batch.num_tokens)
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


@dataclass(slots=True)
class _Sent:
    """A call sent to the modelled trainer actor: its task (the driver's view: it ends when the
    result is back) and the actor span's seconds once known."""

    task: asyncio.Task[float]


class RayPlanTrainer(PlanTrainer):
    """The modelled trainer as a Ray actor (see the module): `RayTrainer`'s driver-side order
    (TRAIN_AHEAD = 1, queue ahead behind optim_step) over a modelled actor that runs one call at a
    time, half a round trip (`trainer_call_s` / 2) away each way."""

    def __init__(self, model: PlanModel, device: Device, ray: RayCosts, queue_ahead: bool, ppo_epochs: int = 1) -> None:
        super().__init__(model, device, ppo_epochs=ppo_epochs)
        self._half = ray.trainer_call_s / 2
        self._queue = queue_ahead
        self._tracer: Tracer | None = None
        self._sent: list[_Sent] = []
        self._actor_free: asyncio.Future[None] | None = None  # resolved when the actor's last call ends
        self._trained: dict[int, float] = {}
        self._optimized: dict[int, float] = {}

    def attach(self, tracer: Tracer) -> None:
        self._tracer = tracer

    @property
    def queue_ahead(self) -> bool:
        return self._queue

    def _send(self, name: str, work: Callable[[], Awaitable[object]], args: dict[str, object]) -> _Sent:
        before = self._actor_free
        free: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._actor_free = free
        sent = _Sent(asyncio.ensure_future(self._on_actor(before, free, name, work, args)))
        self._sent.append(sent)
        return sent

    async def _on_actor(
        self,
        before: asyncio.Future[None] | None,
        free: asyncio.Future[None],
        name: str,
        work: Callable[[], Awaitable[object]],
        args: dict[str, object],
    ) -> float:
        try:
            await _sleep(self._half)  # the call reaches the actor
            if before is not None:
                await before  # the actor runs its calls one at a time, in order
            start = self._tracer.now() if self._tracer is not None else 0.0
            await work()
            end = self._tracer.now() if self._tracer is not None else 0.0
            if self._tracer is not None:
                self._tracer.complete("actor:trainer", name, start, end, **args)
        finally:
            if not free.done():
                free.set_result(None)
        await _sleep(self._half)  # the result reaches the driver
        return end - start

    async def _drain(self, keep: int = 0) -> None:
        while len(self._sent) > keep:
            await self._sent.pop(0).task

    async def train_step(self, batch: TrainBatch) -> None:
        await self._train(batch, ahead=False)
        await self._drain(keep=1)

    async def _train(self, batch: TrainBatch, ahead: bool) -> None:
        args: dict[str, object] = {"step": batch.step, "microbatch": batch.index}
        if ahead:
            args["ahead"] = True
        sent = self._send("train_step", lambda: PlanTrainer.train_step(self, batch), args)
        sent.task.add_done_callback(functools.partial(self._count_train, batch.step))

    def _count_train(self, step: int, task: asyncio.Task[float]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._trained[step] = self._trained.get(step, 0.0) + task.result()

    async def optim_step(self) -> int:
        version, _ = await self._optim(None)
        return version

    async def optim_step_ahead(self, ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
        return await self._optim(ahead)

    async def _optim(self, ahead: Callable[[], TrainBatch | None] | None) -> tuple[int, bool]:
        await self._drain()
        args: dict[str, object] = {}

        async def update() -> None:
            args["step"] = await PlanTrainer.optim_step(self)  # the version it made, as RayTrainer's span says

        optim = self._send("optim_step", update, args)
        batch = ahead() if ahead is not None else None
        if batch is not None:
            await self._train(batch, ahead=True)
        self._sent.remove(optim)
        seconds = await optim.task
        version = int(args["step"])  # type: ignore[call-overload]
        self._optimized[version] = seconds
        return version, batch is not None

    def step_train_time(self, step: int) -> float | None:
        seconds = self._trained.pop(step, 0.0)
        for earlier in [s for s in self._trained if s < step]:
            del self._trained[earlier]
        return seconds

    def step_optim_time(self, step: int) -> float | None:
        seconds = self._optimized.pop(step, 0.0)
        for earlier in [s for s in self._optimized if s < step]:
            del self._optimized[earlier]
        return seconds

    async def close(self) -> None:
        for sent in self._sent:  # none is left behind the run (a run that failed mid-step)
            sent.task.cancel()
        await asyncio.gather(*(sent.task for sent in self._sent), return_exceptions=True)
        self._sent.clear()
        await super().close()
