"""Bounds on worker calls: a call that does not return in time fails with a message naming the
call and the config key that bounds it, instead of hanging the run.

`bounded` bounds one awaitable; `BoundedTrainer` bounds every call of a `Trainer`
(`train.call_timeout_s`), including the optional queue-ahead call (`Trainer.optim_step_ahead`),
which it forwards when the trainer it wraps may use it. The sample and sync stages bound `generate` and
`load_weights` (`rollout.generate_timeout_s`, `rollout.weight_load_timeout_s`); a replica that
exceeds them is failed over like one that raised.

Invariant: a timed-out call is cancelled, and waited for (its worker stops at its next abort
check) for at most CANCEL_GRACE_S; a call still running after that (a worker stuck in native
code) is kept referenced until it ends and its outcome is retrieved, so it neither blocks the
run's failure nor leaves an unretrieved exception. A bound of 0 means none.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from relayrl.abandoned import cancel_within
from relayrl.backends.protocols import PendingExport, Trainer
from relayrl.types import TrainBatch, Weights

T = TypeVar("T")
CANCEL_GRACE_S = 5.0


class CallTimeoutError(TimeoutError):
    """A worker call did not return within its bound."""


async def bounded(call: Awaitable[T], seconds: float, what: str, key: str) -> T:
    """Await `call`; past `seconds` (> 0), cancel it and raise `CallTimeoutError` naming `what`
    and the config `key` that sets the bound."""
    if seconds <= 0:
        return await call
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:  # the caller is cancelled: so is the call, as with a plain await
        await cancel_within(task, CANCEL_GRACE_S)
        raise
    if done:
        return task.result()
    await cancel_within(task, min(CANCEL_GRACE_S, seconds))
    raise CallTimeoutError(f"{what} did not return within {seconds:g}s ({key})")


class BoundedTrainer(Trainer):
    """A `Trainer` whose every call is bounded by `seconds` (`train.call_timeout_s`); exceeding it
    fails the run naming the call.

    Its `queue_ahead` is the wrapped trainer's (false when that cannot queue ahead).
    `optim_step_ahead` is bounded like `optim_step`: the bound covers the update; the queued train
    step is covered, as any train step sent ahead is, by the bound of the next training call,
    which awaits it."""

    def __init__(self, inner: Trainer, seconds: float) -> None:
        self.inner = inner
        self.seconds = seconds
        self._ready = False

    async def _bound(self, call: Awaitable[T], name: str, seconds: float | None = None) -> T:
        """`call` bounded by `seconds` (default: the trainer's bound), once the trainer is
        `ready` (its start-up is bounded by its own setting, not by this one)."""
        if not self._ready:
            try:
                await self.ready()
            except BaseException:
                if inspect.iscoroutine(call):  # (never started: no "never awaited" warning)
                    call.close()
                raise
        return await bounded(call, self.seconds if seconds is None else seconds, f"trainer call {name}", "train.call_timeout_s")

    async def ready(self) -> None:
        ready = getattr(self.inner, "ready", None)  # (a trainer that does not subclass Trainer: ready at once)
        if ready is not None:
            await ready()
        self._ready = True

    async def train_step(self, batch: TrainBatch) -> None:
        await self._bound(self.inner.train_step(batch), f"train_step(step {batch.step}, microbatch {batch.index})")

    async def optim_step(self) -> int:
        return await self._bound(self.inner.optim_step(), "optim_step")

    def step_train_time(self, step: int) -> float | None:
        return self.inner.step_train_time(step)

    def step_optim_time(self, step: int) -> float | None:
        return self.inner.step_optim_time(step)

    @property
    def queue_ahead(self) -> bool:
        return self.inner.queue_ahead

    async def optim_step_ahead(self, ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
        return await self._bound(self.inner.optim_step_ahead(ahead), "optim_step")

    async def get_metrics(self) -> dict[str, float]:
        return await self._bound(self.inner.get_metrics(), "get_metrics")

    async def export_weights(self) -> Weights:
        return await self._bound(self.inner.export_weights(), "export_weights")

    async def export_ahead(self) -> PendingExport | None:
        if not self._ready:
            await self.ready()
        loop = asyncio.get_running_loop()
        sent = loop.time()
        pending = await self._bound(self.inner.export_ahead(), "export_weights")
        if pending is None:
            return None
        left = max(1e-3, self.seconds - (loop.time() - sent)) if self.seconds > 0 else 0.0  # one bound for send and export
        return PendingExport(pending.weights, self._bound(pending.done, "export_weights", left))

    async def save_state(self, directory: Path) -> None:
        await self._bound(self.inner.save_state(directory), "save_state")

    async def load_state(self, directory: Path) -> int:
        return await self._bound(self.inner.load_state(directory), "load_state")

    async def close(self) -> None:
        await self.inner.close()
