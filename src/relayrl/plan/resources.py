"""The resource model: which device each worker occupies, and how workers busy on one device at
the same time slow each other.

A worker's call needs `work` seconds of its device alone. While `k` workers (itself included)
are busy on the device, each progresses at rate 1 / (1 + contention × (k − 1)): processor
sharing, the way torch workers on one pool of CPU cores, or a trainer and a sampler on one GPU,
share it. `contention` is fitted from the source run (`fit_contention`: each span's measured
duration against the time-averaged number of other busy workers on its device), so 0 means the
device serves everyone at full speed (separate GPUs, the sim's sleeps) and 1 means k workers
each run k times slower (compute-bound workers on a fully used pool of cores).

Devices: a worker on the CPU ("cpu") shares this machine's cores with every other CPU worker
(the local backend and Ray on one machine alike); a worker on "cuda:N" shares that GPU only with
workers on the same index ("cuda" is index 0).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from relayrl.config.schema import Config

GRID = tuple(step / 50 for step in range(151))  # contention factors tried: 0, 0.02, ..., 3
TICK_S = 0.005  # a shared call re-reads how many workers share its device this often


def device_name(spec: str) -> str:
    spec = spec.strip().lower()
    if spec in ("cpu", "auto", ""):
        return "cpu"
    return "cuda:0" if spec == "cuda" else spec


def worker_devices(cfg: Config) -> dict[str, str]:
    """Lane name → device of each worker of `cfg`: "trainer" and "sampler/<i>"."""
    sampler = device_name(cfg.rollout.device)
    out = {"trainer": device_name(cfg.train.device)}
    for i in range(cfg.rollout.num_samplers):
        out[f"sampler/{i}"] = sampler
    return out


def overlap_load(busy: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Time-averaged number of `busy` intervals overlapping [start, end]."""
    if end <= start:
        return 0.0
    covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
    return covered / (end - start)


def fit_contention(
    samples: Sequence[tuple[float, float]],
    alone: Callable[[float], Sequence[float]],
    grid: Sequence[float] = GRID,
) -> float:
    """The contention factor that best explains measured durations: `samples` are (measured
    seconds, load: other workers busy on the device, time-averaged); `alone(c)` returns each
    sample's fitted alone-cost given the factor c (the caller refits its cost model for each c).
    Least absolute error on log durations over `grid` (robust to a shared machine's outliers and
    to slow early calls); 0 when no sample ever overlapped another."""
    if not samples or max(load for _, load in samples) < 0.05:
        return 0.0
    import math

    best, best_err = 0.0, math.inf
    for c in grid:
        costs = alone(c)
        err = 0.0
        for (dur, load), cost in zip(samples, costs):
            if dur > 0 and cost > 0:
                err += abs(math.log(dur) - math.log(cost * (1 + c * load)))
        if err < best_err - 1e-12:
            best, best_err = c, err
    return best


class Device:
    """One device in a planned run: calls on it share it (see the module). Lives on the event
    loop the modelled workers run on; not thread-safe."""

    def __init__(self, name: str, contention: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.contention = contention
        self.busy = 0  # calls running on the device now
        self._clock = clock

    def slowdown(self) -> float:
        return 1.0 + self.contention * max(0, self.busy - 1)

    async def run(self, work: float) -> None:
        """Spend `work` device-alone seconds, slowed by whoever else is busy meanwhile."""
        if work <= 0:
            return
        self.busy += 1
        try:
            remaining = work
            last = self._clock()
            while remaining > 1e-6:
                factor = self.slowdown()
                await asyncio.sleep(min(remaining * factor, TICK_S))
                now = self._clock()
                remaining -= (now - last) / factor
                last = now
        finally:
            self.busy -= 1


def devices_for(cfg: Config, contention: dict[str, float]) -> dict[str, Device]:
    """One `Device` per device `cfg`'s workers occupy, keyed by lane ("trainer", "sampler/<i>");
    lanes on one device share one object. `contention`: device kind ("cpu", "cuda") → factor."""
    shared: dict[str, Device] = {}
    out: dict[str, Device] = {}
    for lane, name in worker_devices(cfg).items():
        kind = "cpu" if name == "cpu" else "cuda"
        if name not in shared:
            shared[name] = Device(name, contention.get(kind, 0.0))
        out[lane] = shared[name]
    return out
