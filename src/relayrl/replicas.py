"""Sampler replicas in service: failover when one fails.

Invariant: with failover on, a replica whose `generate` or `load_weights` raised is taken out of
service, the failure is recorded and warned about once, and the run goes on with the others;
only the failure of the last replica (or any failure, with failover off) fails the run — with
that replica's own exception.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from relayrl.backends.protocols import Sampler


class SamplerRetiredWarning(RuntimeWarning):
    pass


@dataclass(slots=True)
class ReplicaPool:
    """The sampler replicas still in service, and why the others were retired."""

    alive: list[Sampler]
    failover: bool = True
    retired: list[dict[str, object]] = field(default_factory=list)

    @classmethod
    def of(cls, samplers: Sequence[Sampler], failover: bool) -> ReplicaPool:
        return cls(list(samplers), failover)

    def retire(self, sampler: Sampler, exc: Exception, during: str) -> None:
        """Take `sampler` out of service; re-raise `exc` when failover is off or none is left."""
        if sampler in self.alive:
            self.alive.remove(sampler)
        self.retired.append({"replica": sampler.replica, "during": during, "error": f"{type(exc).__name__}: {exc}"})
        if not self.failover or not self.alive:
            raise exc
        warnings.warn(
            f"sampler replica {sampler.replica} retired after {during} raised {type(exc).__name__}: {exc}; "
            f"its requests go to the {len(self.alive)} other replica(s)",
            SamplerRetiredWarning,
            stacklevel=2,
        )
