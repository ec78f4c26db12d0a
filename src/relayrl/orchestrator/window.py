"""The dispatch window: how many groups may be in flight, given staleness and the step count.

A group dispatched now is meant for step `(dispatched - filtered) // groups_per_step`; it may be
dispatched only while that step ≤ synced version + max_staleness (the samplers hold the synced
version, so its trajectories are at most `max_staleness` versions behind the step that trains
them unless filtering reorders groups; the train loop filters those as stale). A trajectory's
version is its OLDEST token's: with rollout.interruptible a generation running when a newer
version is loaded goes on with it, but its first token was sampled by a version at least the
synced one at dispatch, so the bound holds as stated. A filtered group
returns its credit so a replacement is dispatched: only through `Ledger.filtered`, the one call
that settles a filtered group and returns its credit (orchestrator/ledger.py), so neither half
can be forgotten.

Invariant: never more groups are meant for a step than `groups_per_step`, and never a group for
a step beyond the run's last.
"""

from __future__ import annotations

import asyncio


class DispatchWindow:
    def __init__(self, groups_per_step: int, max_staleness: int, total_steps: int, start_step: int = 0) -> None:
        """`start_step` > 0: a resumed run, whose samplers hold version `start_step`."""
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.total_steps = total_steps
        self.dispatched = start_step * groups_per_step
        self.filtered = 0
        self.synced_version = start_step
        self._changed = asyncio.Event()

    def _next_step(self) -> int:
        return (self.dispatched - self.filtered) // self.groups_per_step

    def available(self) -> int:
        """Groups that may be dispatched right now."""
        limit_step = min(self.synced_version + self.max_staleness, self.total_steps - 1)
        limit_groups = (limit_step + 1) * self.groups_per_step
        return max(0, limit_groups - (self.dispatched - self.filtered))

    async def acquire(self, most: int) -> int:
        """Wait until at least one group may be dispatched; take up to `most` credits."""
        while (n := self.available()) == 0:
            self._changed.clear()
            await self._changed.wait()
        n = min(n, most)
        self.dispatched += n
        return n

    def _return_credit(self) -> None:
        """A dispatched group was filtered: its credit goes back, so a replacement is dispatched.
        Called by `Ledger.filtered` only, which settles the group in the same call."""
        self.filtered += 1
        self._changed.set()

    def set_synced(self, version: int) -> None:
        self.synced_version = max(self.synced_version, version)
        self._changed.set()
