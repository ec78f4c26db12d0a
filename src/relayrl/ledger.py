"""The trajectory ledger: where every dispatched group ended up.

Invariant: every dispatched group reaches exactly one of trained, filtered (by reason) or unused
(still in flight when the run ended). Settling a group twice, or one never dispatched, raises.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from relayrl.types import FilteredGroup


class LedgerError(RuntimeError):
    pass


@dataclass(slots=True)
class Ledger:
    groups_dispatched: int = 0
    trajectories_dispatched: int = 0
    trajectories_trained: int = 0
    trajectories_failed: int = 0
    reward_errors: Counter[str] = field(default_factory=Counter)
    _outcome: dict[int, str] = field(default_factory=dict)
    _pending_filtered: list[FilteredGroup] = field(default_factory=list)

    def dispatch(self, num_groups: int, group_size: int) -> range:
        """Allocate ids for newly dispatched groups."""
        ids = range(self.groups_dispatched, self.groups_dispatched + num_groups)
        self.groups_dispatched += num_groups
        self.trajectories_dispatched += num_groups * group_size
        return ids

    def _settle(self, group_id: int, outcome: str) -> None:
        if group_id >= self.groups_dispatched or group_id < 0:
            raise LedgerError(f"group {group_id} settled as {outcome} but was never dispatched")
        previous = self._outcome.get(group_id)
        if previous is not None:
            raise LedgerError(f"group {group_id} settled twice: {previous}, then {outcome}")
        self._outcome[group_id] = outcome

    def trained(self, group_id: int, num_trajectories: int) -> None:
        self._settle(group_id, "trained")
        self.trajectories_trained += num_trajectories

    def filtered(self, item: FilteredGroup) -> None:
        self._settle(item.group.group_id, "filtered:" + item.reason.value)
        self._pending_filtered.append(item)

    def drain_filtered(self) -> list[FilteredGroup]:
        """The groups filtered since the last drain (each step drains once, at its commit)."""
        items, self._pending_filtered = self._pending_filtered, []
        return items

    def as_dict(self) -> dict[str, object]:
        counts = Counter(self._outcome.values())
        filtered = {k.removeprefix("filtered:"): v for k, v in counts.items() if k.startswith("filtered:")}
        return {
            "groups_dispatched": self.groups_dispatched,
            "groups_trained": counts.get("trained", 0),
            "groups_filtered": filtered,
            "groups_unused": self.groups_dispatched - len(self._outcome),
            "trajectories_dispatched": self.trajectories_dispatched,
            "trajectories_trained": self.trajectories_trained,
            "trajectories_failed": self.trajectories_failed,
            "reward_errors": dict(self.reward_errors),
        }
