"""Runs inside vLLM's worker process: relayrl's engine for vLLM's weight-transfer API
(`WeightTransferConfig(backend="relayrl")`, registered by `relayrl.backends.vllm.engine`), the
receiving end of the collective transport in the engine: a vLLM replica in this process
(`relayrl.backends.vllm.broadcast`) or in a Ray sampler actor (`relayrl.backends.ray.collective`).

vLLM's own engines move weights over NCCL or CUDA IPC only; this one receives as a member of
relayrl's weight group (`relayrl.backends.ray.collective.Member`: gloo on the CPU, NCCL on CUDA)
in the sampler's place: the worker joins it from the TCP store the trainer serves, reads there the
version's layout (one trainer's buckets, or the sharded trainer's stream of every rank's shards),
and receives every version into buckets of its own on its device, as a sampler actor would. It
drives vLLM's lifecycle as vLLM's NCCL engine does:

- `init_transfer_engine` (vLLM's `init_weight_transfer_engine`, once): join the group as the
  sampler's receiver, with the names the engine loads (the sampler checked them against the
  model: tied names, which vLLM ties itself, left out);
- `start_weight_update`: a version begins;
- `update_weights` (one per version): the round is received (its header checked against the round
  the sampler expects, and the version when it knows it: in a Ray actor it learns it from the
  round, `received_version`) into the buckets, and only then does vLLM's layer-wise reload
  start and the model load the bucket views (a receive that fails has not touched the model);
- `finish_weight_update`: the layer-wise reload ends (vLLM re-packs the weights it read), and a
  tied LM head is re-packed from the new embedding (`refresh_tied_lm_head`);
- `shutdown`: leave the group (the trainer's pending broadcast then fails at once).

A receive that fails (the trainer's broadcast failed, a timeout, an out-of-step round) leaves the
group for good and raises: the sampler then loads the version another way (its file in this
process, the object store on Ray).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from relayrl.backends.ray.collective import Member
from relayrl.backends.vllm.worker import expected_misses, refresh_tied_lm_head

__all__ = ["RelayrlInitInfo", "RelayrlTransferEngine", "RelayrlUpdateInfo"]


@dataclass
class RelayrlInitInfo(WeightTransferInitInfo):
    """Where the group meets, this worker's place in it (receiver `receiver` of `world` - 1), and
    the names the engine loads of each version, in order."""

    host: str
    port: int
    receiver: int
    world: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float  # each collective's bound
    names: list[str]


@dataclass
class RelayrlUpdateInfo(WeightTransferUpdateInfo):
    """One version: the round the sampler expects and its version (None: the round's, unchecked)."""

    round: int
    version: int | None = None


class RelayrlTransferEngine(WeightTransferEngine):
    """See the module."""

    init_info_cls = RelayrlInitInfo
    update_info_cls = RelayrlUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._member: Member | None = None
        self._names: list[str] = []
        self.broken: str | None = None
        self.last_seconds = 0.0  # the last version's receive and load
        self.received_version: int | None = None  # the version of the last round received
        self._started = 0.0
        self._reloading = False  # vLLM's layer-wise reload started for the version received

    def init_transfer_engine(self, init_info: RelayrlInitInfo) -> None:
        self.shutdown()  # (a group joined before: a new trainer's)
        self.broken = None
        i = init_info
        self._member = Member.join(i.host, i.port, i.backend, i.timeout_s, i.world - 1, receiver=i.receiver, device=self.device)
        self._names = list(i.names)

    def start_weight_update(self) -> None:
        self._started = time.perf_counter()
        self._reloading = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronizes "the accelerator", which the CPU has none of (it raises there)
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RelayrlUpdateInfo) -> None:
        member = self._member
        if self.broken is not None or member is None:
            raise RuntimeError(f"relayrl's weight-transfer engine is not in a group: {self.broken or 'not initialised'}")
        try:
            version, views = member.receive(update_info.round)
            if update_info.version is not None and version != update_info.version:
                expected = f"round {update_info.round} is version {version}, not {update_info.version}"
                raise RuntimeError(f"the weight group is out of step: {expected}")
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            self.shutdown()
            raise
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.received_version = version
        initialize_layerwise_reload(self.model)  # only once the whole version is here (see the module)
        self._reloading = True
        with expected_misses(self.model):
            self.model.load_weights(iter((name, views[name]) for name in self._names))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._reloading:
            raise RuntimeError("finish_weight_update: no version was received since start_weight_update")
        self._reloading = False
        with expected_misses(self.model):
            finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_lm_head(self.model)
        self.last_seconds = time.perf_counter() - self._started

    def shutdown(self) -> None:
        member, self._member = self._member, None
        if member is not None:
            member.close()
