"""The sharded trainer's host (`train.world_size = N > 1`): one `Trainer` to the orchestrator,
N rank processes (`relayrl.backends.local.ranks`) behind it.

Launch: the ranks are spawned (`torch.multiprocessing`, start method "spawn") on this machine,
each given the model, the settings, MASTER_ADDR=127.0.0.1 and a free port, and one pipe; rank r
joins the process group as rank r (gloo on the CPU, NCCL on CUDA with device cuda:(b+r) for
`device` cuda:b: `relayrl.backends.local.placement`) and shards its copy of the model. Each pipe
has a reader thread here that settles the answers.

Liveness: a rank that has not answered "started" within `startup_timeout_s` of its spawn
(train.rank_startup_timeout_s) fails; once started it sends a heartbeat every quarter of
`heartbeat_timeout_s` (train.rank_heartbeat_timeout_s) from a thread of its own, and a rank the
reader hears nothing from for that long (a stopped process, one hung outside Python) is killed
and fails every call naming it. Start-up is awaited by `ready` (the orchestrator's call bound,
train.call_timeout_s, starts after it), so a slow start never counts against a call.

Rounds: FSDP needs every rank to run each forward and backward pass together, so micro-batches
are held until there is one per rank (a round) and then sent, the largest first, one per rank;
the step's last, partial round goes out with `optim_step`, the ranks without a micro-batch
running a zero-loss pass on another's. With several updates per step (`train.ppo_epochs` ×
`train.minibatches_per_step` > 1) a round never mixes minibatches (the first is trained on
arrival, the others only get a no-grad forward: the ranks' passes must be of one kind), so each
minibatch ends with its partial round; the later updates run inside `optim_step`, each rank on the
micro-batches it kept, padded with zero-loss passes to the most any rank holds of that minibatch (and, FSDP leaving the
root unit gathered after a no-grad forward, resharded after each). Holding rather than waiting for
a "final" flag keeps the trainer busy while the orchestrator packs the next micro-batches, and needs no change to
`TrainBatch`; a round's micro-batches come from one packing plan, so their token counts are
close. The loss normaliser stays the step's (the micro-batch carries it) and rank gradients are
summed, so N ranks compute the one-rank step.

Invariants: `get_metrics` and `export_weights` answer from what rank 0 sent with the last
`optim_step` (or `load_state`) reply, and `save_state` runs on the ranks' checkpoint threads, so
none waits behind a train step; a rank that dies fails every call in flight or made later with a
`RunFailed` naming the rank (its pipe closes), and `close` ends the ranks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from transformers import PreTrainedModel

from relayrl.backends.local.placement import rank_devices
from relayrl.backends.local.ranks import HEARTBEAT, META_FILE, RankOptions, rank_main
from relayrl.backends.local.shm import plan_shm, remove_dir, unspill
from relayrl.backends.local.trainer import TrainerSettings
from relayrl.backends.protocols import Trainer
from relayrl.errors import RunFailed
from relayrl.types import TrainBatch, Weights

#: after a rank's error, how long to wait for a rank to die before reporting the error itself: a
#: collective broken by a dead peer may answer before the kernel has ended the peer (under load,
#: tearing down a process with a model in memory takes a while)
DEATH_GRACE_S = 10.0


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class RankFailed(RunFailed):
    """A rank of the sharded trainer died or its connection broke; names the rank."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Rank:
    """The host's end of one rank: its process, its pipe and the answers awaited from it."""

    def __init__(self, rank: int, process: Any, conn: Any, heartbeat_timeout_s: float = 0.0) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.pending: dict[int, concurrent.futures.Future[Any]] = {}
        self.lock = threading.Lock()
        # one message at a time on the pipe: a checkpoint's request is sent while a round's
        # (megabytes, written in parts) may be on its way, and interleaved writes corrupt both
        self.send_lock = threading.Lock()
        self.dead: RankFailed | None = None
        self.started = self.expect(0)  # its first answer: ready (or why it could not start)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.seen: float | None = None  # when its last message arrived (None: none yet)
        threading.Thread(target=self._read, name=f"relayrl-rank{rank}-reader", daemon=True).start()

    def send(self, message: tuple[int, str, Any]) -> None:
        with self.send_lock:
            self.conn.send(message)

    def expect(self, rid: int) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.lock:
            if self.dead is not None:
                future.set_exception(self.dead)
            else:
                self.pending[rid] = future
        return future

    def _read(self) -> None:
        hb = self.heartbeat_timeout_s
        while True:
            try:
                # silence is bounded once the rank has said anything (its heartbeat starts first
                # thing in its body; before that it imports, which train.rank_startup_timeout_s bounds)
                if hb > 0 and self.seen is not None and not self.conn.poll(hb):
                    self._stalled(f"stopped answering: no heartbeat for {hb:g}s (train.rank_heartbeat_timeout_s)")
                    return
                rid, ok, value = self.conn.recv()
            except Exception as exc:  # EOF, a broken pipe, or a message that does not unpickle
                self._died(exc)
                return
            self.seen = time.monotonic()
            if rid == HEARTBEAT:
                continue
            with self.lock:
                future = self.pending.pop(rid, None)
            if ok:
                try:
                    value = unspill(value)  # (weights that came through a disk directory)
                except Exception as exc:
                    ok, value = False, exc
            if future is None or future.done():  # (cancelled: its caller gave up)
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value if isinstance(value, BaseException) else RuntimeError(str(value)))

    def _stalled(self, what: str) -> None:
        """The rank is silent past its bound: end it (a stopped process too) and fail its calls."""
        self.process.kill()
        self.process.join(timeout=5.0)
        self._fail(RankFailed(f"sharded trainer rank {self.rank} (pid {self.process.pid}) {what}"))

    def _died(self, exc: BaseException) -> None:
        self.process.join(timeout=2.0)
        code = self.process.exitcode
        dead = RankFailed(
            f"sharded trainer rank {self.rank} (pid {self.process.pid}) died"
            + (f" (exit code {code})" if code is not None else f" ({type(exc).__name__})")
        )
        self._fail(dead)

    def _fail(self, dead: RankFailed) -> None:
        with self.lock:
            self.dead = dead
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(dead)


class RankedTrainer(Trainer):
    """The `Trainer` the orchestrator sees in front of `world_size` ranks: the rounds, and the
    answers kept from rank 0's last reply (see the module). A host sends the requests: `_all`."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"train.world_size = {world_size}: the sharded trainer needs a rank at least")
        self.world_size = world_size
        self._held: list[TrainBatch] = []
        self._train_time: dict[int, float] = {}
        self._optim_time: dict[int, float] = {}  # without the step's last round, which optim_step runs first
        self._snapshot: Weights | None = None
        self._slot: dict[str, float] = {}

    async def _start(self) -> None:
        """Wait until every rank is up (default: they are once constructed)."""
        return None

    async def _all(self, args: list[tuple[str, Any]]) -> list[Any]:
        """Send request `args[r]` to rank r, every rank; their answers, rank 0 first. A checkpoint
        request ("save") runs beside the compute requests."""
        raise NotImplementedError

    async def _round(self, batches: list[TrainBatch]) -> None:
        """One forward/backward round: the largest micro-batch to rank 0, and so on; the ranks
        left without one run a zero-loss pass on the smallest."""
        ordered = sorted(batches, key=lambda tb: tb.num_tokens, reverse=True)
        args = [("train", (ordered[r], False)) if r < len(ordered) else ("train", (ordered[-1], True)) for r in range(self.world_size)]
        start = time.perf_counter()
        await self._all(args)
        step = batches[0].step
        self._train_time[step] = self._train_time.get(step, 0.0) + time.perf_counter() - start

    async def train_step(self, batch: TrainBatch) -> None:
        """Holds `batch` until a round is full (one per rank), then trains the round. A round
        holds one minibatch's micro-batches only (several updates per step): a new minibatch
        sends the previous one's partial round first."""
        if self._held and self._held[0].minibatch != batch.minibatch:
            held, self._held = self._held, []
            await self._round(held)
        self._held.append(batch)
        if len(self._held) == self.world_size:
            held, self._held = self._held, []
            await self._round(held)
        else:
            await self._start()

    def step_train_time(self, step: int) -> float | None:
        """Seconds of the step's rounds (a held micro-batch's train_step returns at once)."""
        return self._train_time.pop(step, None)

    def step_optim_time(self, step: int) -> float | None:
        """Seconds of the step's update across the ranks (its last, partial round is train time)."""
        return self._optim_time.pop(step, None)

    async def optim_step(self) -> int:
        if self._held:
            held, self._held = self._held, []
            await self._round(held)
        start = time.perf_counter()
        answers = await self._all([("optim", None)] * self.world_size)
        version, snapshot, slot = answers[0]
        self._snapshot, self._slot = snapshot, slot
        self._optim_time[int(version)] = time.perf_counter() - start  # step N's commit makes version N
        return int(version)

    async def get_metrics(self) -> dict[str, float]:
        return dict(self._slot)

    async def export_weights(self) -> Weights:
        """The last committed version's full weights, gathered inside `optim_step` (or at start)."""
        await self._start()
        assert self._snapshot is not None
        return self._snapshot

    async def save_state(self, directory: Path) -> None:
        await self._all([("save", str(directory))] * self.world_size)

    async def load_state(self, directory: Path) -> int:
        meta_file = directory / META_FILE
        if not meta_file.is_file():
            raise RuntimeError(
                f"{directory} holds no sharded trainer state: it was written with train.world_size = 1, this run has {self.world_size}"
            )
        meta = await asyncio.to_thread(torch.load, meta_file, map_location="cpu", weights_only=True)
        if int(meta["world_size"]) != self.world_size:
            raise RuntimeError(
                f"{directory} was written with train.world_size = {meta['world_size']}, this run has {self.world_size}: "
                "resume with the same"
            )
        answers = await self._all([("load", str(directory))] * self.world_size)
        version, snapshot, slot = answers[0]
        self._snapshot, self._slot = snapshot, slot
        return int(version)


class ShardedTrainer(RankedTrainer):
    """`world_size` rank processes training `model` with FSDP2 (see the module)."""

    def __init__(
        self,
        model: PreTrainedModel,
        settings: TrainerSettings,
        world_size: int,
        ref_model: PreTrainedModel | None = None,
        device: torch.device | str = "cpu",
        *,
        startup_timeout_s: float = 0.0,
        heartbeat_timeout_s: float = 0.0,
        gradient_checkpointing: bool = False,
        source: Callable[[], tuple[PreTrainedModel, PreTrainedModel | None]] | None = None,
        microbatch_bytes: int = 0,
        version_bytes: int | None = None,
    ) -> None:
        """`device`: rank 0's (rank r computes on cuda:(b+r) for cuda:b, see the module);
        `startup_timeout_s` / `heartbeat_timeout_s`: the ranks' liveness bounds (0: none);
        `gradient_checkpointing`: each rank checkpoints its copy's activations; `source`: each
        rank loads (model, reference model) with it instead of receiving `model` and
        `ref_model` through shared memory (`model` then only sizes a version); `microbatch_bytes`:
        about a micro-batch's size, and `version_bytes`, a version's (None: `model`'s parameters;
        with LoRA its adapters'), for the shared-memory plan (`relayrl.backends.local.shm`)."""
        super().__init__(world_size)
        self.settings = settings
        devices = rank_devices(torch.device(device), world_size)
        weights = _bytes(model)
        handed = 0 if source is not None else weights + (_bytes(ref_model) if ref_model is not None else 0)
        version = weights if version_bytes is None else version_bytes
        self.shm = plan_shm(version, microbatch_bytes, world_size, handed_bytes=handed)
        options = RankOptions(
            beat_s=min(5.0, max(0.05, heartbeat_timeout_s / 4)) if heartbeat_timeout_s > 0 else 0.0,
            gradient_checkpointing=gradient_checkpointing,
            deterministic=torch.are_deterministic_algorithms_enabled(),  # (run.deterministic: the ranks do as this process)
            source=source,
            spill_dir=self.shm.spill_dir,
            env=self.shm.env,
        )
        handed_model, handed_ref = (None, None) if source is not None else (model, ref_model)
        ctx = mp.get_context("spawn")
        port = free_port()
        self._ids = itertools.count(1)
        self._ranks: list[_Rank] = []
        try:
            for r in range(world_size):
                parent, child = ctx.Pipe()
                process = ctx.Process(
                    target=rank_main,
                    args=(r, world_size, port, child, handed_model, settings, handed_ref, str(devices[r]), options),
                    name=f"relayrl-trainer-rank{r}",
                    daemon=True,
                )
                process.start()
                child.close()
                self._ranks.append(_Rank(r, process, parent, heartbeat_timeout_s))
        except BaseException:  # a rank that cannot start: the ones started and the spill directory go with it
            for rank in self._ranks:
                rank.process.kill()
            remove_dir(self.shm.spill_dir)
            raise
        self._ready = False
        self._closed = False
        self._startup_timeout_s = startup_timeout_s
        self._spawned = time.monotonic()
        self._start_failed: RankFailed | None = None

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank 0 first."""
        return [int(rank.process.pid) for rank in self._ranks]

    async def ready(self) -> None:
        """Wait until every rank has started (bounded by `startup_timeout_s`, see the module)."""
        await self._start()

    async def _start(self) -> None:
        if self._ready:
            return
        if self._start_failed is not None:
            raise self._start_failed
        bound = self._startup_timeout_s
        waits = [asyncio.wrap_future(rank.started) for rank in self._ranks]
        try:
            if bound > 0:
                left = max(0.0, self._spawned + bound - time.monotonic())
                answers = await asyncio.wait_for(self._gather(waits), left)
            else:
                answers = await self._gather(waits)
        except TimeoutError:
            self._start_failed = self._late()
            raise self._start_failed from None
        self._snapshot, self._slot = answers[0]
        self._ready = True

    def _late(self) -> RankFailed:
        """The failure of a start-up past its bound, naming the ranks to blame: those not started
        that are silent (not yet beating, or no longer), else every one not started (those that
        beat are waiting for the others in the rendezvous)."""
        now = time.monotonic()
        waiting = [r for r in self._ranks if r.started.cancelled() or not r.started.done()]  # (the wait cancelled them)
        beat = self._ranks[0].heartbeat_timeout_s
        silent = [r for r in waiting if r.seen is None or (beat > 0 and now - r.seen > beat)]
        late = silent or waiting
        which = ", ".join(str(r.rank) for r in late)
        pids = ", ".join(str(r.process.pid) for r in late)
        return RankFailed(
            f"sharded trainer rank{'s' if len(late) > 1 else ''} {which} (pid{'s' if len(late) > 1 else ''} {pids}) did not start "
            f"within {self._startup_timeout_s:g}s (train.rank_startup_timeout_s)"
        )

    async def _gather(self, waits: list[asyncio.Future[Any]]) -> list[Any]:
        """Every rank's answer; the first failure is raised at once, as the death of a rank if
        one died (the others may notice first: their collective with it broke)."""
        try:
            return list(await asyncio.gather(*waits))
        except RankFailed:
            raise
        except Exception as exc:
            dead = await asyncio.to_thread(self._dead_rank, DEATH_GRACE_S)
            if dead is not None:
                raise dead from exc
            raise
        finally:
            for w in waits:
                if not w.done():
                    w.cancel()

    def _dead_rank(self, grace_s: float) -> RankFailed | None:
        """The failure of the first rank that has died, waiting up to `grace_s` for one to. Read
        off what each rank's pipe reader found (its end of the pipe closes when the rank dies; the
        reader reaps it and names its exit code): only that thread waits for the process, as two
        threads reaping one process race (the loser sees it alive)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank in self._ranks:
                if rank.dead is not None:
                    return rank.dead
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    async def _all(self, args: list[tuple[str, Any]]) -> list[Any]:
        """Send request `args[r]` to rank r, every rank; their answers, rank 0 first."""
        await self._start()
        rid = next(self._ids)
        waits = [asyncio.wrap_future(rank.expect(rid)) for rank in self._ranks]
        for rank, (op, arg) in zip(self._ranks, args, strict=True):
            if rank.dead is not None:
                raise rank.dead
            try:
                await asyncio.to_thread(rank.send, (rid, op, arg))
            except (OSError, EOFError) as exc:  # (its death, once its process has ended)
                dead = await asyncio.to_thread(self._dead_rank, DEATH_GRACE_S)
                raise dead or RankFailed(f"sharded trainer rank {rank.rank} (pid {rank.process.pid}): cannot send {op} ({exc})") from exc
        return await self._gather(waits)

    async def memory(self) -> list[dict[str, float]]:
        """Per rank (waiting behind its compute): peak RSS, its shard's parameter and optimizer bytes."""
        return await self._all([("memory", None)] * self.world_size)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        for rank in self._ranks:
            try:
                rank.send((0, "close", None))
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for rank in self._ranks:
            rank.process.join(timeout=max(0.1, deadline - time.monotonic()))
        for rank in self._ranks:  # a rank stuck in a collective with a dead one does not leave by itself
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(timeout=5.0)
        for rank in self._ranks:
            rank.conn.close()
        remove_dir(self.shm.spill_dir)
