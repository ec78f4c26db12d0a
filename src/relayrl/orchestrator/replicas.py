"""Sampler replicas in service: their numbering, the version each holds, failover.

The pool numbers the replicas itself (replica i is the i-th sampler of the backend) and keeps, on
the orchestrator's side, the version each one holds (the one the sync stage last loaded into it):
no stage reads either off a worker.

A replica whose worker died (a killed Ray actor process) and can be restarted is not retired: its
requests go back to the queue, the weight publisher loads the current weights into it once it is
alive again and it serves again (`restarted`); one that cannot be restarted within its bound is
retired as below.

Invariant: with failover on, a replica whose `generate` or `load_weights` raised is taken out of
service once (one record, one warning) and the run goes on with the others. The run fails with
the failing replica's own exception when the last replica fails or failover is off, and with a
RuntimeError naming the groups when requests that already failed on one replica fail on another
(then the requests, not the replicas, are the likely cause; retiring every replica in turn would
only hide that).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from relayrl.backends.protocols import Sampler


async def forget_episodes(worker: Sampler, keys: Sequence[str]) -> None:
    """Tell `worker` to drop the caches of episodes that are over (`end_episodes`). Their samples
    never depend on it: a worker that died meanwhile (`Sampler.restartable`, a Ray actor's process)
    had answered every call of them, its caches went with it, and its next call restarts it; any
    other failure raises."""
    try:
        await worker.end_episodes(keys)
    except Exception as exc:
        if not worker.restartable(exc):
            raise


class SamplerRetiredWarning(RuntimeWarning):
    pass


class SamplerRestartedWarning(RuntimeWarning):
    pass


@dataclass(slots=True, eq=False)
class SamplerSlot:
    """A sampler replica as the orchestrator knows it."""

    replica: int
    worker: Sampler
    version: int = 0  # the policy version last loaded into it (orchestrator-side knowledge)
    restarting: bool = False  # its worker is being restarted: sync rounds skip it until the publisher loaded it


@dataclass(slots=True)
class ReplicaPool:
    """The sampler replicas still in service, and why the others were retired."""

    alive: list[SamplerSlot]
    failover: bool = True
    retired: list[dict[str, object]] = field(default_factory=list)
    restarted: list[dict[str, object]] = field(default_factory=list)
    target: int = 0  # the newest version the publisher exported: a restarted replica loads at least this
    _failed_groups: set[int] = field(default_factory=set)  # group ids of requests a replica failed on

    @classmethod
    def of(cls, samplers: Sequence[Sampler], failover: bool, version: int = 0) -> ReplicaPool:
        """Replica i is `samplers[i]`, holding `version` (a resumed run's samplers hold its start)."""
        return cls([SamplerSlot(i, s, version) for i, s in enumerate(samplers)], failover, target=version)

    @property
    def slots(self) -> list[SamplerSlot]:
        """The replicas in service (a copy)."""
        return list(self.alive)

    def serves(self, slot: SamplerSlot) -> bool:
        return any(s is slot for s in self.alive)

    def record_restart(self, slot: SamplerSlot, exc: Exception, during: str, version: int) -> None:
        """`slot`'s worker died during `during`, was restarted and loaded `version`; it serves again."""
        self.restarted.append({"replica": slot.replica, "during": during, "error": f"{type(exc).__name__}: {exc}", "version": version})
        warnings.warn(
            f"sampler replica {slot.replica} restarted after {during} raised {type(exc).__name__}: {exc}; it loaded version {version}",
            SamplerRestartedWarning,
            stacklevel=2,
        )

    def retire(self, slot: SamplerSlot, exc: Exception, during: str, group_ids: Sequence[int] = ()) -> None:
        """Take `slot` out of service; raise when the run cannot go on (see module)."""
        newly = self.serves(slot)
        if newly:
            self.alive = [s for s in self.alive if s is not slot]
            self.retired.append({"replica": slot.replica, "during": during, "error": f"{type(exc).__name__}: {exc}"})
        retried = sorted(self._failed_groups.intersection(group_ids))
        self._failed_groups.update(group_ids)
        if retried:
            raise RuntimeError(
                f"sampler replica {slot.replica}: {during} failed on group(s) {retried}, which already failed on "
                f"another replica: the requests, not the replicas, look at fault ({type(exc).__name__}: {exc})"
            ) from exc
        if not self.failover or not self.alive:
            raise exc
        if newly:
            warnings.warn(
                f"sampler replica {slot.replica} retired after {during} raised {type(exc).__name__}: {exc}; "
                f"its requests go to the {len(self.alive)} other replica(s)",
                SamplerRetiredWarning,
                stacklevel=2,
            )
