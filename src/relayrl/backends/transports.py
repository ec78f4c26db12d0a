"""Weight transports: how a committed version's bytes reach the sampler replicas
(`rollout.weight_transport`), which one applies where, and the bytes each stages in host memory.

The weight publisher (`relayrl.orchestrator.publisher`) decides which replicas load which version,
bounds the loads, fails replicas over and traces; a transport only moves the bytes:

- "direct": in one process (the hf engine, or the sim): each sampler copies the trainer's
  committed snapshot (`Weights.payload`, tensors on the trainer's device) into its own model,
  device to device; the one snapshot per commit is what lets the trainer train on while the
  samplers copy, and the staleness rule never needs two (a load holds the newest one);
- "file": in one process with rollout.engine = "vllm": each replica writes the snapshot to a
  safetensors file (/dev/shm when it fits) that its engine's worker reads back
  (`relayrl.backends.vllm`);
- "collective" in one process with rollout.engine = "vllm": the trainer broadcasts each version
  to every replica's engine worker, which receives it through vLLM's weight-transfer API in
  relayrl's engine (gloo on the CPU, NCCL on CUDA, where each engine needs a GPU the trainer does
  not use; `relayrl.backends.vllm.broadcast`); a round whose receive fails loads from the file;
- "object_store": on Ray: the trainer actor puts each version once into Ray's object store as
  numpy arrays, each sampler actor reads it there (zero-copy on one node) and copies it in
  (`relayrl.backends.ray.transport`);
- "collective": on Ray (the local kind): a torch.distributed process group of the trainer actor
  (rank 0) and every sampler actor, set up once when the actors start; each version is broadcast
  from the trainer's snapshot in dtype-grouped flat buckets (gloo when the trainer computes on the
  CPU, NCCL on CUDA; `relayrl.backends.ray.collective`); with rollout.engine = "vllm" each
  actor's engine worker joins the group in the actor's place and receives each version through
  vLLM's weight-transfer API (`relayrl.backends.vllm.transfer`). With the sharded trainer
  (train.world_size > 1) each rank streams its own shards of each bucket from its own snapshot,
  one group per rank with the sampler actors, and each receiver assembles the whole tensors: no
  rank gathers the model for it (train.lora: refused, its adapters are gathered whole). A round
  that does not load every member (one restarting, retired or restarted: a new process is no
  member) uses the object store instead, as does the evaluation's engine.

"auto" is the fastest that applies (`resolve`): direct in one process with the hf engine (or the
sim); with vLLM in one process, collective when the trainer computes on a GPU no engine shares
(NCCL, no host copy), else file (on the CPU the two are close, docs/design.md); on Ray,
collective when the trainer actor computes on CUDA
(NCCL: no host copy, where the object store copies device → host → device) or the sampler
replicas are vLLM engines (each receives in its worker, where the object store writes and reads a
file per engine: `relayrl bench weights --vllm`, 0.5B shape, 2 actors: 3.6 s a version against
4.4 s), for the local kind with one trainer rank (the sharded trainer's streaming over NCCL is not
measured yet: "auto" keeps the object store there), else the object store: on one CPU node the
object store is one copy into shared memory and zero-copy reads, while gloo moves each version
through a loopback socket once per receiver (`relayrl bench weights`, 0.5B shape in bfloat16, 2
sampler actors: object store 0.9–1.7 s, collective 1.3–3.7 s a version). A transport set that
does not apply is refused in one line naming the key (`refusal`).

Host copies (`STAGED`): every transport adds the bytes it copies into a staging buffer in host
memory (a `ray.put`, a `.cpu()` of a device tensor, a file written or read, a collective bucket on
the CPU) to this process's counter; `relayrl bench weights` divides their sum over the processes by
a version's bytes. The copies into the replicas' own parameters and the trainer's committed
snapshot are no staging and not counted.

This module imports nothing heavy (the config schema validates with it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from relayrl.backends.protocols import PendingExport
    from relayrl.config.schema import Config

TransportName = Literal["object_store", "file", "collective", "direct"]
TRANSPORTS: tuple[TransportName, ...] = ("direct", "file", "object_store", "collective")
KEY = "rollout.weight_transport"


def applicable(cfg: Config) -> tuple[TransportName, ...]:
    """The transports that apply to `cfg`'s hosting, kind and engine, fastest first."""
    if not cfg.ray.enabled:
        return ("file", "collective") if cfg.rollout.engine == "vllm" and cfg.run.backend == "local" else ("direct",)
    if cfg.run.backend == "local" and (cfg.train.world_size == 1 or cfg.train.lora is None):
        return ("collective", "object_store")
    return ("object_store",)


def _where(cfg: Config) -> str:
    hosting = "on Ray (ray.enabled)" if cfg.ray.enabled else "in one process"
    engine = f"rollout.engine = {cfg.rollout.engine!r}"
    return f"run.backend = {cfg.run.backend!r} with {engine} {hosting}, train.world_size = {cfg.train.world_size}"


def refusal(cfg: Config) -> str | None:
    """One line naming the key when `rollout.weight_transport` does not apply to `cfg`; None when it does."""
    chosen = cfg.rollout.weight_transport
    if chosen == "auto":
        return None
    fits = applicable(cfg)
    if chosen in fits:
        return None
    why = ""
    if chosen == "collective" and cfg.ray.enabled and cfg.run.backend == "local":
        why = " (with train.lora the sharded trainer gathers its adapters whole; only whole models stream from its ranks)"
    elif chosen == "collective" and cfg.ray.enabled:
        why = " (the sim moves no weights)"
    return f"{KEY} = {chosen!r} does not apply to {_where(cfg)}{why}: use one of {', '.join(repr(t) for t in fits)} or 'auto'"


def resolve(cfg: Config, trainer_on_cuda: bool = False) -> TransportName:
    """The transport `cfg` runs: its `rollout.weight_transport`, or the fastest that applies for
    "auto" (`trainer_on_cuda`: the trainer computes on a GPU no sampler engine shares, see the module)."""
    chosen = cfg.rollout.weight_transport
    if chosen != "auto":
        return chosen
    fits = applicable(cfg)
    in_engines = cfg.ray.enabled and cfg.rollout.engine == "vllm"  # (received in each engine's worker)
    if "collective" in fits and (trainer_on_cuda or in_engines) and cfg.train.world_size == 1:
        return "collective"
    return fits[0] if fits[0] != "collective" else "object_store"


class WeightBroadcast(Protocol):
    """A transport that moves one version to every sampler replica at once (collective): the
    weight publisher uses it for a round that loads exactly the replicas it `covers`, and the
    trainer's own export (the object store) otherwise."""

    name: str

    def covers(self, replicas: Sequence[int]) -> bool:
        """Whether a round loading exactly `replicas` can be broadcast (every member loads, none
        was restarted, the group is intact)."""
        ...

    async def export_ahead(self) -> PendingExport:
        """Start broadcasting the trainer's committed version; `weights` is handed to every
        covered replica's `load_weights` now (each receives there), `done` is the trainer's end."""
        ...


class _Staged:
    """Bytes this process copied into host-memory staging buffers (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += int(nbytes)

    def read(self) -> int:
        with self._lock:
            return self._bytes


STAGED = _Staged()


__all__ = ["KEY", "STAGED", "TRANSPORTS", "TransportName", "WeightBroadcast", "applicable", "refusal", "resolve"]
