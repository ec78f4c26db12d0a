"""The planner's resource model (relayrl.plan.resources): workers sharing a device slow each other
by the contention factor, and the factor is recovered from durations measured under load."""

from __future__ import annotations

import asyncio
import time

from relayrl.plan.resources import Device, fit_contention, overlap_load


def test_two_calls_sharing_a_device_each_take_longer_by_the_contention_factor() -> None:
    async def timed(device: Device, work: float) -> float:
        start = time.monotonic()
        await device.run(work)
        return time.monotonic() - start

    async def main() -> tuple[float, list[float]]:
        alone = await timed(Device("cpu", 1.0), 0.1)
        shared = Device("cpu", 1.0)
        both = await asyncio.gather(timed(shared, 0.1), timed(shared, 0.1))
        return alone, list(both)

    alone, both = asyncio.run(main())
    assert 0.09 <= alone < 0.15
    assert all(0.18 <= t < 0.3 for t in both)  # processor sharing: 2 workers, factor 1 → twice as long


def test_a_device_without_contention_serves_everyone_at_full_speed() -> None:
    async def main() -> float:
        device = Device("cuda:0", 0.0)
        start = time.monotonic()
        await asyncio.gather(device.run(0.1), device.run(0.1), device.run(0.1))
        return time.monotonic() - start

    assert asyncio.run(main()) < 0.16


def test_the_contention_factor_is_recovered_from_durations_under_load() -> None:
    base = [0.05, 0.08, 0.11, 0.05, 0.09]
    loads = [0.0, 1.0, 0.5, 2.0, 0.25]
    samples = [(b * (1 + 0.6 * load), load) for b, load in zip(base, loads)]
    assert abs(fit_contention(samples, lambda _c: base) - 0.6) < 0.021
    assert fit_contention([(0.1, 0.0), (0.2, 0.0)], lambda _c: [0.1, 0.2]) == 0.0  # never overlapped


def test_overlap_load_is_the_time_averaged_number_of_busy_intervals() -> None:
    assert overlap_load([(0.0, 1.0), (0.5, 2.0)], 0.0, 1.0) == 1.5
    assert overlap_load([], 0.0, 1.0) == 0.0
