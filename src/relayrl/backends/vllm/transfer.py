"""Runs inside vLLM's worker process: relayrl's engine for vLLM's weight-transfer API
(`WeightTransferConfig(backend="relayrl")`, registered by `relayrl.backends.vllm.worker`), the
receiving end of the collective transport with the vLLM engine (`relayrl.backends.vllm.broadcast`).

vLLM's own engines move weights over NCCL or CUDA IPC only; this one receives over relayrl's own
process group (`relayrl.backends.ray.collective.OwnGroup`: gloo on the CPU, NCCL on CUDA) of the
trainer (rank 0) and every replica's worker (rank 1 + its replica), made from the TCP store the
trainer serves, from which the worker also reads the version layout (`Layout`: the tensors the
file transport would load, in dtype-grouped flat buckets). It drives vLLM's lifecycle as vLLM's
NCCL engine does:

- `init_transfer_engine` (vLLM's `init_weight_transfer_engine`, once): join the group, allocate
  one version's buckets on the worker's device;
- `start_weight_update`: a version begins;
- `update_weights` (one per version): the header (round, version) is checked against the round
  the sampler expects, every bucket is received in place, and only then does vLLM's layer-wise
  reload start and the model load the bucket views (a receive that fails has not touched the model);
- `finish_weight_update`: the layer-wise reload ends (vLLM re-packs the weights it read), and a
  tied LM head is re-packed from the new embedding (`refresh_tied_lm_head`);
- `shutdown`: leave the group (the trainer's pending broadcast then fails at once).

A receive that fails (the trainer's broadcast failed, a timeout, an out-of-step round) leaves the
group for good and raises: the sampler then loads the version from its file instead.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from relayrl.backends.ray.collective import JOIN_TIMEOUT_S, Layout, OwnGroup, full_views
from relayrl.backends.transports import STAGED
from relayrl.backends.vllm.broadcast import GROUP_PREFIX, LAYOUT_KEY
from relayrl.backends.vllm.worker import expected_misses, refresh_tied_lm_head

__all__ = ["RelayrlInitInfo", "RelayrlTransferEngine", "RelayrlUpdateInfo"]


@dataclass
class RelayrlInitInfo(WeightTransferInitInfo):
    """Where the group meets and this worker's place in it."""

    host: str
    port: int
    rank: int
    world: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float  # each collective's bound


@dataclass
class RelayrlUpdateInfo(WeightTransferUpdateInfo):
    """One version: the round the sampler expects and its version."""

    round: int
    version: int


class RelayrlTransferEngine(WeightTransferEngine):
    """See the module."""

    init_info_cls = RelayrlInitInfo
    update_info_cls = RelayrlUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group: OwnGroup | None = None
        self._store: Any = None
        self._layout: Layout | None = None
        self._buckets: list[torch.Tensor] = []
        self.broken: str | None = None
        self.last_seconds = 0.0  # the last version's receive and load
        self._started = 0.0
        self._reloading = False  # vLLM's layer-wise reload started for the version received

    def init_transfer_engine(self, init_info: RelayrlInitInfo) -> None:
        import torch.distributed as dist

        self.shutdown()  # (a group joined before: a new trainer's)
        self.broken = None
        store = dist.TCPStore(init_info.host, init_info.port, None, False, timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)
        layout: Layout = pickle.loads(bytes.fromhex(store.get(LAYOUT_KEY).decode()))
        op = timedelta(seconds=init_info.timeout_s)
        self._group = OwnGroup(store, GROUP_PREFIX, init_info.rank, init_info.world, init_info.backend, op)
        self._store, self._layout = store, layout
        self._buckets = [torch.empty(n, dtype=d, device=self.device) for d, n in layout.buckets]

    def start_weight_update(self) -> None:
        self._started = time.perf_counter()
        self._reloading = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronizes "the accelerator", which the CPU has none of (it raises there)
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RelayrlUpdateInfo) -> None:
        group, layout = self._group, self._layout
        if self.broken is not None or group is None or layout is None:
            raise RuntimeError(f"relayrl's weight-transfer engine is not in a group: {self.broken or 'not initialised'}")
        try:
            header = torch.zeros(2, dtype=torch.int64, device=self.device)
            group.broadcast(header)
            got, version = (int(x) for x in header.tolist())
            if (got, version) != (update_info.round, update_info.version):
                raise RuntimeError(
                    f"the weight group is out of step: received round {got} (version {version}),"
                    f" expected round {update_info.round} (version {update_info.version})"
                )
            for bucket in self._buckets:
                group.broadcast(bucket.view(torch.uint8))
                if bucket.device.type == "cpu":
                    STAGED.add(bucket.numel() * bucket.element_size())
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            self.shutdown()
            raise
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        views = full_views(layout, self._buckets)
        initialize_layerwise_reload(self.model)  # only once the whole version is here (see the module)
        self._reloading = True
        with expected_misses(self.model):
            self.model.load_weights(iter((name, views[name]) for name in layout.names))

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
        group, self._group = self._group, None
        if group is not None:
            group.close()
        self._store = None
        self._buckets = []
