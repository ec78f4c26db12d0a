"""In-process PyTorch trainer: clipped policy gradient on packed micro-batches, AdamW, gradient
accumulation and clipping, warm-up + LR schedule, a metrics slot per committed step.

What computes and where it runs are separate: `TrainerCompute` is the synchronous compute (plain
methods), `LocalTrainer` hosts one in a `ThreadHost` and implements the `Trainer` protocol.

All compute runs in one named worker thread ("relayrl-trainer"), in call order, so a
`train_step`, `optim_step` or weight export never races another. The compute methods marked
thread-safe (`metrics`, `committed_weights`, `save_state`) only read what `optim_step` published
under a lock, so the host calls them outside that thread and they never wait behind a running
train step (a Ray actor would give them their own concurrency group).

The sampler's log-probs are the behaviour policy's: no extra forward pass. The objective is
clipped (and dual-clipped) PPO against them, or with `tis_cap` decoupled PPO with a truncated
importance weight (algorithms/losses.py says exactly what each computes and reports). The policy
and the reference model have dropout off (`disable_dropout`): the trainer runs them in train
mode, the samplers in eval mode, and on-policy their log-probs must agree (ratio 1).

Devices: the policy (and reference) model live on the trainer's device (`device`; default: where
the model already is); a micro-batch, collated on the CPU, is moved there once, whole, at the start
of its `train_step`. Exported weights stay on that device (an in-process sampler copies them onto
its own; the Ray transport brings them to the CPU); checkpoints load onto the CPU first.

Invariants: exactly one optimizer update per `optim_step`, which overwrites the metrics slot with
that step's figures and returns the new policy version (= number of updates so far) — or none,
for a step whose loss or gradient is not finite (skipped, or the run fails under "fail"); more
than `max_consecutive_skips` skipped steps in a row fail the run (the count is checkpointed).
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from relayrl.algorithms.losses import LossConfig, policy_loss
from relayrl.backends.local.collate import PackedBatch
from relayrl.backends.local.logprobs import token_logprobs
from relayrl.backends.protocols import Trainer
from relayrl.errors import RunFailed
from relayrl.models.loading import disable_dropout
from relayrl.threads import ThreadHost
from relayrl.types import TrainBatch, Weights


@dataclass(slots=True)
class TrainerSettings:
    learning_rate: float
    total_steps: int
    loss: LossConfig
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    torch_threads: int = 0
    on_nonfinite: str = "skip"  # a step whose loss or gradient is not finite: "skip" its update, or "fail"
    max_consecutive_skips: int = 10  # under "skip": more skipped steps in a row than this fail the run


class NonFiniteStepError(RunFailed, FloatingPointError):
    """A step's loss or gradient was NaN or infinite and `train.on_nonfinite = "fail"`, or more
    than `train.max_consecutive_skips` steps in a row were skipped for it under "skip". (A
    FloatingPointError, so the command line reports it in one line without importing torch.)"""


@dataclass(slots=True)
class _StepStats:
    """Token-weighted sums over a step's micro-batches."""

    loss: float = 0.0
    tokens: int = 0
    loss_tokens: int = 0
    microbatches: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)


def lr_multiplier(step: int, settings: TrainerSettings) -> float:
    if settings.warmup_steps and step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.lr_schedule == "constant":
        return 1.0
    span = max(1, settings.total_steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    if settings.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class TrainerCompute:
    """The policy model, its optimizer and schedule, and the synchronous training compute. Not
    thread-safe except where marked: its host runs the other methods one at a time."""

    def __init__(
        self,
        model: PreTrainedModel,
        settings: TrainerSettings,
        ref_model: PreTrainedModel | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if settings.loss.kl_beta > 0 and ref_model is None:
            raise ValueError("algorithm.kl_beta > 0 needs a reference model")
        if settings.max_consecutive_skips < 1:
            raise ValueError(f"train.max_consecutive_skips must be >= 1, got {settings.max_consecutive_skips}")
        if device is not None:  # before the optimizer is made: its parameters are the ones on the device
            torch.nn.Module.to(model, device)  # (transformers' own `to` types badly)
            if ref_model is not None:
                torch.nn.Module.to(ref_model, device)
        self.model = disable_dropout(model).train()  # train mode, but log-probs as the samplers' eval mode gives
        self.ref_model = disable_dropout(ref_model).eval() if ref_model is not None else None
        self.wrap_model(self.model)  # before the optimizer is made: it holds the wrapped parameters
        self.device: torch.device = model.device
        self.settings = settings
        self.version = 0
        self._optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=settings.learning_rate,
            weight_decay=settings.weight_decay,
            betas=settings.betas,
        )
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(self._optimizer, lambda s: lr_multiplier(s, settings))
        self._stats = _StepStats()
        self._nonfinite_steps = 0  # steps whose update was skipped (loss or gradient not finite)
        self._consecutive_skips = 0  # ... of them, the last ones in a row
        self._slot: dict[str, float] = {}
        self._snapshot: Weights | None = None
        self._slot_lock = threading.Lock()

    # -- hooks a sharded compute (backends/local/ranks.py) overrides --------------------------
    def wrap_model(self, model: PreTrainedModel) -> None:
        """Wrap the policy in place before the optimizer is made. Default: nothing (one process)."""
        return None

    def gather_stats(self, stats: _StepStats) -> _StepStats:
        """The step's statistics over every process that trained a part of it. Default: this one's."""
        return stats

    def clip_gradients(self, params: list[torch.nn.Parameter]) -> float:
        """Clip the gradients to `max_grad_norm`; returns their global norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(params, self.settings.max_grad_norm))

    # -- thread-safe: read what optim_step published ------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Thread-safe. The metrics slot of the last committed step."""
        with self._slot_lock:
            return dict(self._slot)

    def committed_weights(self) -> Weights | None:
        """Thread-safe. The weights snapshotted at the last commit (None before any)."""
        with self._slot_lock:
            return self._snapshot

    def save_state(self, directory: Path) -> None:
        """Thread-safe between a commit and the next `optim_step` (which must wait for it): the
        committed snapshot, the optimizer and LR schedule, in `directory/trainer.pt`."""
        snapshot = self.committed_weights()
        if snapshot is None or snapshot.version != self.version:
            raise RuntimeError(f"save_state: no committed snapshot of version {self.version}")
        state = {
            "version": snapshot.version,
            "model": snapshot.payload,
            "optimizer": self._optimizer.state_dict(),
            "scheduler": self._scheduler.state_dict(),
            "nonfinite_steps": self._nonfinite_steps,
            "consecutive_skips": self._consecutive_skips,
        }
        torch.save(state, directory / "trainer.pt")

    # -- the worker thread's calls -------------------------------------------------------------
    def load_state(self, directory: Path) -> int:
        if (directory / "trainer-sharded.pt").is_file():
            raise RuntimeError(f"{directory} holds a sharded trainer state (train.world_size > 1); this run has train.world_size = 1")
        state = torch.load(directory / "trainer.pt", map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self._scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        self._nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self._consecutive_skips = int(state.get("consecutive_skips", 0))
        snapshot = self.export()
        with self._slot_lock:
            self._snapshot = snapshot
        return self.version

    def train_step(self, tb: TrainBatch, abort: threading.Event | None = None) -> None:
        if abort is not None and abort.is_set():
            return
        batch = tb.payload
        if not isinstance(batch, PackedBatch):
            raise TypeError(f"micro-batch {tb.step}/{tb.index} was not collated by the TorchCollator")
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)  # once, every tensor of the micro-batch
        cfg = self.settings.loss
        logp, entropy = token_logprobs(self.model, batch, self.settings.temperature)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(self.ref_model, batch, self.settings.temperature)
        out = policy_loss(
            logp,
            batch.old_logprobs,
            batch.advantages,
            batch.loss_mask,
            batch.seq_index,
            cfg,
            num_tokens_in_step=float(max(1, tb.step_completion_tokens)),
            num_seqs_in_step=float(max(1, tb.step_sequences)),
            ref_logprobs=ref,
            entropy=entropy,
        )
        out.loss.backward()
        st = self._stats
        st.loss += float(out.loss.detach())
        st.tokens += batch.num_real_tokens
        st.loss_tokens += out.num_tokens
        st.microbatches += 1
        n = out.num_tokens
        for key, value in out.metrics().items():
            if key in ("loss", "num_loss_tokens"):
                continue
            if key.endswith("_max"):
                st.maxes[key] = max(st.maxes.get(key, -math.inf), value)
            elif key.endswith("_min"):
                st.mins[key] = min(st.mins.get(key, math.inf), value)
            else:
                st.sums[key] = st.sums.get(key, 0.0) + value * n

    def optim_step(self) -> int:
        self._stats = self.gather_stats(self._stats)
        if self._stats.microbatches == 0:
            raise RuntimeError("optim_step with no accumulated train_step")
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = self.clip_gradients(params)
        lr = self._scheduler.get_last_lr()[0]
        finite = math.isfinite(grad_norm) and math.isfinite(self._stats.loss)
        if finite:
            self._optimizer.step()
            self._consecutive_skips = 0
        else:  # nothing of this step reaches the weights or the optimizer's moments
            self._optimizer.zero_grad(set_to_none=True)
            loss = self._stats.loss
            if self.settings.on_nonfinite == "fail":
                self._stats = _StepStats()
                raise NonFiniteStepError(
                    f"step {self.version}: the loss ({loss}) or gradient norm ({grad_norm}) is not finite "
                    "(train.on_nonfinite = 'fail'; 'skip' skips such a step's update and goes on)"
                )
            self._consecutive_skips += 1
            limit = self.settings.max_consecutive_skips
            if self._consecutive_skips > limit:
                self._stats = _StepStats()
                raise NonFiniteStepError(
                    f"step {self.version}: {self._consecutive_skips} steps in a row had a non-finite loss or gradient norm "
                    f"(this one: loss {loss}, gradient norm {grad_norm}), more than train.max_consecutive_skips = {limit}: "
                    "their updates were all skipped (train.on_nonfinite = 'skip'), so the run is not training"
                )
            self._nonfinite_steps += 1
        with warnings.catch_warnings():  # after a skipped update torch warns the schedule ran first: it is meant to
            warnings.simplefilter("ignore", UserWarning)
            self._scheduler.step()  # the schedule follows the run's steps, skipped or not
        self._optimizer.zero_grad(set_to_none=True)
        st = self._stats
        denom = max(1, st.loss_tokens)
        slot: dict[str, float] = {
            "step": float(self.version),
            "loss": st.loss,
            "grad_norm": grad_norm,
            "learning_rate": float(lr),
            "tokens": float(st.tokens),
            "completion_tokens": float(st.loss_tokens),
            "microbatches": float(st.microbatches),
            "skipped_nonfinite": 0.0 if finite else 1.0,
            "nonfinite_steps": float(self._nonfinite_steps),
        }
        slot.update({k: v / denom for k, v in st.sums.items()})
        slot.update(st.maxes)
        slot.update(st.mins)
        self._stats = _StepStats()
        self.version += 1
        snapshot = self.export()
        with self._slot_lock:
            self._slot = slot
            self._snapshot = snapshot
        return self.version

    def export(self) -> Weights:
        """The model's weights now, as the version it holds."""
        with torch.no_grad():
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return Weights(version=self.version, payload=state)


class LocalTrainer(Trainer):
    """A `TrainerCompute` hosted in one worker thread ("relayrl-trainer"; implements `Trainer`).
    `get_metrics`, `export_weights` (after the first commit) and `save_state` call the compute's
    thread-safe methods outside that thread, so they never wait behind a train step."""

    def __init__(
        self,
        model: PreTrainedModel,
        settings: TrainerSettings,
        ref_model: PreTrainedModel | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.compute = TrainerCompute(model, settings, ref_model, device)
        threads = settings.torch_threads
        self._host = ThreadHost("trainer", initializer=functools.partial(torch.set_num_threads, threads) if threads else None)

    @property
    def model(self) -> PreTrainedModel:
        return self.compute.model

    @property
    def settings(self) -> TrainerSettings:
        return self.compute.settings

    async def train_step(self, batch: TrainBatch) -> None:
        await self._host.call(lambda: self.compute.train_step(batch, self._host.abort))

    async def optim_step(self) -> int:
        return await self._host.call(self.compute.optim_step)

    async def get_metrics(self) -> dict[str, float]:
        return self.compute.metrics()

    async def export_weights(self) -> Weights:
        """The weights of the last committed version. They are snapshotted inside `optim_step`, so
        a sync never queues behind the next step's micro-batches on the trainer thread."""
        snapshot = self.compute.committed_weights()
        return snapshot if snapshot is not None else await self._host.call(self.compute.export)

    async def save_state(self, directory: Path) -> None:
        """Runs in its own thread: the optimizer state does not change before the next
        `optim_step`, which waits for this, so training goes on."""
        await asyncio.to_thread(self.compute.save_state, directory)

    async def load_state(self, directory: Path) -> int:
        return await self._host.call(lambda: self.compute.load_state(directory))

    async def close(self) -> None:
        self._host.close()
