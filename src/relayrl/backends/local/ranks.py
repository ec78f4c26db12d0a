"""One rank of the sharded trainer (`train.world_size` > 1): the process body the host
(`relayrl.backends.local.sharded.ShardedTrainer`) starts N of, and `ShardedCompute`, the
`TrainerCompute` whose policy is wrapped with FSDP2 (`fully_shard`, one unit per decoder layer
plus the root) so that this rank holds 1/N of the parameters, gradients and optimizer state.

LoRA (train.lora): the policy is a peft model; the units wrap its causal LM (whose forward runs),
the frozen base is sharded like the adapters, the optimizer holds the adapters only, a version's
weights are its adapters gathered whole, and rank 0's checkpoint file also holds them whole (the
model export reads them there). The Ray host (`relayrl.backends.ray.ranks`) serves the same
compute through `join_group` and `serve`.

A rank talks to the host over one pipe: requests `(id, op, arg)`, replies `(id, ok, value)`.
Its main thread runs the compute requests (train, optim, load) one at a time, in order, and every
rank gets the same sequence of them, so their collectives match; a checkpoint request runs in a
thread of its own on a separate process group, reading only what the last `optim_step` left
(the sharded parameters and the optimizer state do not change until the next one, which the host
sends only after the checkpoint ended), so it never waits behind a train step.

Streaming (`stream`, the Ray host with the collective transport): a version is this rank's own
shards instead (`Shards`: no gather; `relayrl.backends.ray.collective`), kept beside the next one
while a publication still reads it (`optim_step(keep)`); the object store's export gathers them on
demand (`gather_shards`, on a gloo group of the ranks' own, beside training).

Invariants: a step's loss normaliser is the step's global one and rank gradients are summed (FSDP's
average times N), so N ranks compute the one-rank step; the metrics and the full weights
of a version are gathered once, inside `optim_step` (streaming: each rank copies its shards), and
rank 0 sends them with its reply; a rank whose host goes away (its pipe closes) exits.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from relayrl.backends.local.collate import PackedBatch
from relayrl.backends.local.determinism import make_deterministic
from relayrl.backends.local.logprobs import token_logprobs
from relayrl.backends.local.shm import spill
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings, _StepStats, merge_stats
from relayrl.backends.ray.collective import OP_TIMEOUT_S, StreamLayout, assemble, local_shards, pack_shards, stream_layout
from relayrl.backends.transports import STAGED
from relayrl.models.checkpointing import enable_gradient_checkpointing
from relayrl.models.lora import adapter_payload, peft_base
from relayrl.models.sharing import retie
from relayrl.types import TrainBatch, Weights

#: In a checkpoint directory, beside the shards `torch.distributed.checkpoint` writes there (one
#: `__<rank>_0.distcp` per rank and its `.metadata`, so the checkpoint's file list covers each):
#: rank 0's file of what is not sharded (version, schedule, counts, world size).
META_FILE = "trainer-sharded.pt"

#: The request id of a rank's heartbeat on its pipe (`(HEARTBEAT, True, None)`, no request
#: awaits it): sent every `beat_s` seconds once the rank runs, so that the host tells a rank that
#: stopped answering from one that computes (`relayrl.backends.local.sharded`).
HEARTBEAT = -1


@dataclass(frozen=True, slots=True)
class Shards:
    """A streaming rank's snapshot of a version (`Weights.payload`): a copy of its own rows, one
    flat tensor per send of its (`relayrl.backends.ray.collective.pack_shards`)."""

    version: int
    flats: dict[int, torch.Tensor]


class ShardedCompute(TrainerCompute):
    """A `TrainerCompute` on one rank of an initialised process group. Every method that is not
    thread-safe is a collective: all ranks call it, in the same order."""

    casts_params = False  # mixed precision by FSDP2's MixedPrecisionPolicy (wrap_model)
    fused_cpu_optimizer = False  # its parameters are DTensors: AdamW's default implementation on the CPU

    def __init__(
        self,
        model: PreTrainedModel,
        settings: TrainerSettings,
        ref_model: PreTrainedModel | None = None,
        device: torch.device | str | None = None,
        *,
        stream: bool = False,
    ) -> None:
        """`stream`: a version is this rank's own shards (the collective transport streams them
        from each rank, `relayrl.backends.ray.collective`), not the full weights on rank 0."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        super().__init__(model, settings, ref_model, device)
        # the sharded parameters, by name, as the optimizer holds them (the module swaps in
        # unsharded ones during a forward pass, these stay)
        self._sharded = {name: p for name, p in self.model.named_parameters()}
        self._idle_batch: TrainBatch | None = None  # the last micro-batch an idle pass ran on
        self._ckpt_group = dist.new_group(backend="gloo")  # checkpoints run beside training, on their own group
        self.stream_layout: StreamLayout | None = None
        self._held_back: dict[int, Weights] = {}  # streaming: earlier snapshots a publication still reads
        if stream:
            if self._adapters:
                raise ValueError("rollout.weight_transport = 'collective' streams whole models only: not with train.lora")
            spec, _ = local_shards(self.model.state_dict(keep_vars=True), self.rank)
            specs: list[Any] = [None] * self.world_size
            dist.all_gather_object(specs, spec)
            self.stream_layout = stream_layout(specs)
            # the object store's export gathers the ranks' snapshots here, beside training
            self._weights_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=OP_TIMEOUT_S))
        snapshot = self.export()
        with self._slot_lock:
            self._snapshot = snapshot

    def wrap_model(self, model: PreTrainedModel) -> None:
        net = peft_base(model) if self._adapters else model  # (LoRA: the wrapped causal LM, its adapters injected)
        layers = getattr(getattr(net, "model", None), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise TypeError(f"train.world_size > 1: {type(model).__name__} has no model.layers to shard by decoder layer")
        # model.dtype "bfloat16": float32 sharded master weights, bfloat16 compute, float32 gradient reduction
        mp = (
            MixedPrecisionPolicy(param_dtype=self.precision.compute, reduce_dtype=torch.float32)
            if self.precision.mixed
            else MixedPrecisionPolicy()
        )
        for layer in layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(net, mp_policy=mp)  # (the root: the module whose forward runs)

    def gather_stats(self, stats: _StepStats) -> _StepStats:
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, stats)
        return merge_stats(parts)

    def clip_gradients(self, params: list[torch.nn.Parameter]) -> float:
        grads = [p.grad for p in params if p.grad is not None]
        # FSDP averaged the ranks' gradients; the loss is normalised per step, so they must add up
        # (scaled here: gloo has no pre-multiplied sum for set_gradient_divide_factor(1.0))
        torch._foreach_mul_(grads, float(self.world_size))
        total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, self.settings.max_grad_norm, total)
        return float(total)

    def export(self) -> Weights:
        """Collective: the full weights, gathered to rank 0 on the CPU (other ranks: an empty
        payload). Streaming: no collective, this rank's own shards (`Shards`)."""
        if self.stream_layout is not None:
            _, local = local_shards(self.model.state_dict(keep_vars=True), self.rank)
            flats = pack_shards(self.stream_layout, self.rank, local, self.device)
            if self.device.type == "cuda":  # (the copies are done when another thread reads them)
                torch.cuda.current_stream(self.device).synchronize()
            return Weights(version=self.version, payload=Shards(self.version, flats))
        if self._adapters:  # LoRA: the adapters only, each gathered whole
            adapters = {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in adapter_payload(self.model).items()}
            return Weights(version=self.version, payload=adapters if self.rank == 0 else {})
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # gathered per name: a tied weight arrives twice, kept once (both names share it; the pipe keeps that)
        return Weights(version=self.version, payload=retie(state, self.model) if self.rank == 0 else {})

    def train_step(self, tb: TrainBatch, abort: threading.Event | None = None) -> None:
        super().train_step(tb, abort)
        if self.settings.several_updates and tb.minibatch != 0:
            self._reshard()

    def optim_step(self, keep: Sequence[int] = ()) -> int:
        """`keep`: streaming, the versions whose publication is under way (the previous snapshot
        is kept while one of them, see `shards`)."""
        previous = self.committed_weights()
        version = super().optim_step()
        if self.stream_layout is not None:
            self._retain(previous, keep)
        if self.device.type == "cuda":  # (every rank's device is): the step's peak is the largest rank's
            with self._slot_lock:
                mine = self._slot.get("gpu_mem_peak_gb")
            parts: list[Any] = [None] * self.world_size
            dist.all_gather_object(parts, mine)
            with self._slot_lock:
                for r, peak in enumerate(parts):
                    if peak is not None:
                        self._slot[f"gpu_mem_peak_gb_rank{r}"] = float(peak)
                if any(p is not None for p in parts):
                    self._slot["gpu_mem_peak_gb"] = max(float(p) for p in parts if p is not None)
        return version

    def _retain(self, previous: Weights | None, keep: Sequence[int]) -> None:
        with self._slot_lock:
            kept = {v: w for v, w in self._held_back.items() if v in keep}
            if previous is not None and previous.version in keep and previous.version != self.version:
                kept[previous.version] = previous
            self._held_back = kept

    def shards(self, version: int) -> dict[int, torch.Tensor]:
        """Thread-safe. Streaming: this rank's snapshot of `version` (send index -> flat bucket):
        the committed one, or an earlier one kept for a publication under way; raises when this
        rank holds neither."""
        with self._slot_lock:
            held = self._snapshot if self._snapshot is not None and self._snapshot.version == version else self._held_back.get(version)
            have = sorted({*self._held_back, *([self._snapshot.version] if self._snapshot is not None else [])})
        if held is None or not isinstance(held.payload, Shards):
            raise RuntimeError(f"trainer rank {self.rank} holds no shards of version {version} (it holds {have})")
        return held.payload.flats

    def gather_shards(self, version: int) -> dict[str, torch.Tensor] | None:
        """Collective on the ranks' weights group, thread-safe: the full weights of `version`
        from every rank's snapshot, assembled on rank 0 on the CPU (for the object store's
        export; the collective transport streams without it); other ranks: None."""
        layout = self.stream_layout
        assert layout is not None, "gather_shards: this compute does not stream"
        flats = self.shards(version)
        group = self._weights_group
        if self.rank != 0:
            for i, s in enumerate(layout.sends):
                if s.src == self.rank:
                    dist.send(flats[i].cpu(), dst=0, group=group)
            return None
        got: dict[int, torch.Tensor] = {}
        for i, s in enumerate(layout.sends):
            if s.src == 0:
                got[i] = flats[i].cpu()
            else:
                got[i] = torch.empty(s.numel, dtype=s.dtype)
                dist.recv(got[i], src=s.src, group=group)
        STAGED.add(layout.full.nbytes)  # the version, whole, in host memory
        return assemble(layout, got)

    def _reshard(self) -> None:
        """After a no-grad forward: FSDP leaves the root unit's parameters gathered (for a backward
        that does not come), which the next optimizer step would leave stale; free them."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def agree_counts(self, counts: dict[int, int]) -> dict[int, int]:
        """Collective: per minibatch of the step, the most micro-batches any rank kept."""
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, counts)
        out: dict[int, int] = {}
        for part in parts:
            for k, n in part.items():
                out[k] = max(out.get(k, 0), n)
        return out

    def sum_loss(self, loss: float) -> float:
        """Collective: the update's loss over the ranks (so they all apply it, or all skip it)."""
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, loss)
        return float(sum(parts))

    def idle_step(self, tb: TrainBatch | None, backward: bool = True) -> None:
        """A pass in which this rank has no micro-batch of its own (a round's, or an update's after
        the first): a forward and backward pass of zero loss on `tb` (another rank's; None: the
        last one idled on), so the ranks' collectives match; nothing is accumulated. With several
        updates per step a round of a minibatch after the first is a no-grad forward (as its
        micro-batches' proximal log-probs are), so the idle pass is too (`backward` False)."""
        if tb is None:
            tb = self._idle_batch
            if tb is None:
                raise RuntimeError("idle_step: this rank has seen no micro-batch to idle on")
        self._idle_batch = tb
        batch = tb.payload
        if not isinstance(batch, PackedBatch):
            raise TypeError(f"micro-batch {tb.step}/{tb.index} was not collated by the TorchCollator")
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        if not backward:
            with torch.no_grad():
                token_logprobs(self._net, batch, self.settings.temperature)
            self._reshard()
            return
        logp, _ = token_logprobs(self._net, batch, self.settings.temperature)
        (logp.sum() * 0.0).backward()

    def memory(self) -> dict[str, float]:
        """This rank's peak resident memory and the bytes of its shard of the parameters and of
        the optimizer state (the benchmark's figures)."""
        import resource

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        params = sum(local(p).numel() * local(p).element_size() for p in self._sharded.values())
        optim = sum(
            local(v).numel() * local(v).element_size()
            for st in self._optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        return {
            "peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
            "param_bytes": float(params),
            "optim_bytes": float(optim),
        }

    # -- checkpoints ---------------------------------------------------------------------------
    def _optim_template(self, fill: bool) -> dict[str, dict[str, Any]]:
        """The optimizer state by parameter name (what a checkpoint holds): the optimizer's own
        tensors, or (`fill`, before a load) zeros of their shapes to load into."""
        out: dict[str, dict[str, Any]] = {}
        for name, p in self._sharded.items():
            if not p.requires_grad:  # (LoRA: the frozen base has no optimizer state)
                continue
            if fill:
                out[name] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
            else:
                out[name] = dict(self._optimizer.state[p])
        return out

    def save_state(self, directory: Path) -> None:
        """Collective on the checkpoint group, thread-safe between a commit and the next
        `optim_step`: each rank writes its shard of the parameters and AdamW moments
        (`torch.distributed.checkpoint`, into `directory`), rank 0 the rest (meta file)."""
        version = self.version
        has_optim = bool(self._optimizer.state)  # empty while every update so far was skipped
        state: dict[str, Any] = {"model": dict(self._sharded)}
        if has_optim:
            state["optim"] = self._optim_template(fill=False)
        dcp.save(state, checkpoint_id=directory, process_group=self._ckpt_group)
        if self.rank == 0:
            meta = {
                "version": version,
                "world_size": self.world_size,
                "has_optim": has_optim,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self._optimizer.param_groups],
                "scheduler": self._scheduler.state_dict(),
                "nonfinite_steps": self._nonfinite_steps,
                "consecutive_skips": self._consecutive_skips,
            }
            if self._adapters:  # LoRA: the version's adapters whole, for the model export (read_full_weights)
                snapshot = self.committed_weights()
                assert snapshot is not None and snapshot.version == version
                meta["adapters"] = snapshot.payload
            torch.save(meta, directory / META_FILE)

    def load_state(self, directory: Path) -> int:
        meta = torch.load(directory / META_FILE, map_location="cpu", weights_only=True)
        state: dict[str, Any] = {"model": dict(self._sharded)}
        if meta["has_optim"]:
            state["optim"] = self._optim_template(fill=True)
        with torch.no_grad():
            dcp.load(state, checkpoint_id=directory)
        if meta["has_optim"]:
            for name, p in self._sharded.items():
                if p.requires_grad:
                    self._optimizer.state[p] = state["optim"][name]
        for group, saved in zip(self._optimizer.param_groups, meta["param_groups"], strict=True):
            group.update(saved)
        self._scheduler.load_state_dict(meta["scheduler"])
        self.version = int(meta["version"])
        self._nonfinite_steps = int(meta["nonfinite_steps"])
        self._consecutive_skips = int(meta["consecutive_skips"])
        snapshot = self.export()
        with self._slot_lock:
            self._snapshot, self._held_back = snapshot, {}
        return self.version


def read_full_weights(directory: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, full weights by parameter name) of a sharded trainer state in `directory`, read
    in this one process (no process group: for the model export). Tied weights appear once. With
    LoRA (train.lora) the version's adapter payload instead, which rank 0 wrote whole."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = torch.load(directory / META_FILE, map_location="cpu", weights_only=True)
    if "adapters" in meta:  # LoRA: the adapter payload (relayrl.models.lora)
        return int(meta["version"]), dict(meta["adapters"])
    reader = dcp.FileSystemReader(directory)
    entries = reader.read_metadata().state_dict_metadata
    prefix = "model."
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in entries.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return int(meta["version"]), {key[len(prefix) :]: value for key, value in state.items()}


def _reply(conn: Connection, lock: threading.Lock, rid: int, ok: bool, value: object) -> None:
    with lock:
        conn.send((rid, ok, value))


def _beat(conn: Connection, lock: threading.Lock, every_s: float) -> None:
    """This rank's heartbeat (see HEARTBEAT), until the pipe breaks."""
    while True:
        try:
            _reply(conn, lock, HEARTBEAT, True, None)
        except Exception:  # the host is gone (the receiver ends the rank)
            return
        time.sleep(every_s)


def _error(exc: BaseException) -> BaseException:
    """`exc` if it can travel back to the host, else a RuntimeError carrying its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")


@dataclass(slots=True)
class RankParts:
    """What one rank builds its `ShardedCompute` from: its copy of the model (every rank's the
    same), the settings, the (unsharded) reference model, and the rank's device."""

    model: PreTrainedModel
    settings: TrainerSettings
    ref_model: PreTrainedModel | None
    device: torch.device


def join_group(rank: int, world_size: int, addr: str, port: int, device: torch.device) -> None:
    """Join the ranks' process group as `rank` (gloo on the CPU, NCCL on CUDA with `device`
    current), rank 0 serving the rendezvous at `addr`:`port`."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size)


def serve(compute: ShardedCompute, op: str, arg: Any) -> object:
    """Run one compute request (`op`: train, optim, memory, load) on this rank; returns the reply
    (after a commit or a load rank 0's carries the version's weights and metrics)."""
    if op == "train":
        tb, idle = arg
        if idle:  # (a round of a later minibatch: no-grad forwards, see TrainerCompute.train_step)
            compute.idle_step(tb, backward=not (compute.settings.several_updates and tb.minibatch != 0))
        else:
            compute.train_step(tb)
        return None
    if op == "optim":  # (arg: the versions a publication still reads, streaming; None: none)
        version = compute.optim_step(tuple(arg or ()))
        return (version, compute.committed_weights(), compute.metrics()) if compute.rank == 0 else (version, None, None)
    if op == "memory":
        return compute.memory()
    if op == "load":
        version = compute.load_state(Path(arg))
        return (version, compute.committed_weights(), compute.metrics()) if compute.rank == 0 else (version, None, None)
    raise ValueError(f"unknown request {op!r}")


@dataclass(frozen=True, slots=True)
class RankOptions:
    """How the host starts each local rank besides its model and settings."""

    beat_s: float = 0.0  # a heartbeat every this many seconds (0: none)
    gradient_checkpointing: bool = False  # train.gradient_checkpointing on its copy of the model
    deterministic: bool = False  # run.deterministic, before its first CUDA call
    # the rank loads its (model, reference model) itself with this, instead of receiving them
    # through shared memory (relayrl.backends.local.build.RankModel)
    source: Callable[[], tuple[PreTrainedModel, PreTrainedModel | None]] | None = None
    spill_dir: str | None = None  # rank 0's version weights through this disk directory (shm.plan_shm)
    env: dict[str, str] = field(default_factory=dict)  # set first (e.g. NCCL_SHM_DISABLE)


def rank_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    model: PreTrainedModel | None,
    settings: TrainerSettings,
    ref_model: PreTrainedModel | None,
    device: str,
    options: RankOptions | None = None,
) -> None:
    """The body of rank `rank` (a spawned process) on `device` (its own: the host maps rank r to
    cuda:(b+r)), training `model` (None: loaded by `options.source`); see `RankOptions`."""
    opts = options if options is not None else RankOptions()
    os.environ.update(opts.env)
    if opts.deterministic:
        make_deterministic()
    lock = threading.Lock()
    torch.set_num_threads(settings.torch_threads or 1)
    if opts.beat_s > 0:
        threading.Thread(target=_beat, args=(conn, lock, opts.beat_s), name="relayrl-rank-heartbeat", daemon=True).start()
    spill_dir = opts.spill_dir if rank == 0 else None
    try:
        where = torch.device(device)
        if model is None:
            if opts.source is None:
                raise ValueError("rank_main: neither a model nor a source to load it")
            model, ref_model = opts.source()
        if opts.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        join_group(rank, world_size, "127.0.0.1", port, where)
        compute = ShardedCompute(model, settings, ref_model, where)
        del model, ref_model
    except BaseException as exc:
        _reply(conn, lock, 0, False, _error(exc))
        return
    _reply(conn, lock, 0, True, (spill(compute.committed_weights(), spill_dir), compute.metrics()))

    work: queue.Queue[tuple[int, str, Any] | None] = queue.Queue()

    def checkpoint(rid: int, directory: str) -> None:
        try:
            compute.save_state(Path(directory))
            _reply(conn, lock, rid, True, None)
        except BaseException as exc:
            _reply(conn, lock, rid, False, _error(exc))

    def receive() -> None:  # the pipe's reader: compute requests to the main thread, checkpoints beside it
        while True:
            try:
                rid, op, arg = conn.recv()
            except Exception:  # the host is gone, or its message does not unpickle: this rank cannot go on
                os._exit(1)
            if op == "save":
                threading.Thread(target=checkpoint, args=(rid, arg), name="relayrl-rank-checkpoint", daemon=True).start()
            elif op == "close":
                work.put(None)
                return
            else:
                work.put((rid, op, arg))

    threading.Thread(target=receive, name="relayrl-rank-receive", daemon=True).start()
    while (item := work.get()) is not None:
        rid, op, arg = item
        try:
            answer = serve(compute, op, arg)
            if spill_dir is not None and op in ("optim", "load"):  # (version, weights, metrics)
                assert isinstance(answer, tuple)
                answer = (answer[0], spill(answer[1], spill_dir), answer[2])
            _reply(conn, lock, rid, True, answer)
        except BaseException as exc:
            _reply(conn, lock, rid, False, _error(exc))
    dist.destroy_process_group()
