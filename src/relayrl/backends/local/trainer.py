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

LoRA (train.lora): the model is a peft model (`relayrl.models.lora.wrap`); the optimizer holds its
adapters only (the only parameters that require gradients), the KL reference is the same model
with its adapters off (`disable_adapter`, no second copy), the exported weights and the
checkpoint's "model" hold the adapters only (`adapter_payload`). The adapters' dropout stays on in
training when train.lora.dropout > 0 (allowed with algorithm.tis_cap only: on-policy the ratio is
then not 1).

Precision (`TrainerSettings.precision`, model.dtype resolved; backends/local/precision.py):
"bfloat16" keeps float32 master parameters, gradients and AdamW moments (and checkpoints them)
and runs every forward (and so its backward) on bfloat16 casts of them (`_logprobs`); a frozen
LoRA base and the KL reference are held in bfloat16. "bfloat16-pure" casts everything to
bfloat16. AdamW is fused (on the CPU too, but for a sharded compute); on CUDA float32 matmuls use TF32.

Devices: the policy (and reference) model live on the trainer's device (`device`; default: where
the model already is); a micro-batch, collated on the CPU, is moved there once, whole, at the start
of its `train_step`. Exported weights stay on that device (an in-process sampler copies them onto
its own; the Ray transport brings them to the CPU); checkpoints load onto the CPU first.

Several updates per step (`ppo_epochs` × `minibatches_per_step` > 1): the step's micro-batches
arrive grouped by minibatch (packing.py). Those of minibatch 0 are trained as they arrive, as with
one update, and their log-probs kept; the others get a no-grad forward on arrival. Either way
each is kept (its collated payload, where it came, e.g. the CPU) with its *proximal* log-probs:
the policy's before the step's first update. `optim_step` applies the first update (minibatch 0,
pass 1), then runs the remaining ones in order, pass by pass, minibatch by minibatch: forward and
backward of the minibatch's micro-batches against the kept proximal log-probs (decoupled PPO's
π_prox; clipped PPO keeps the sampler's log-probs as its old policy), gradient clipping and an
optimizer step each. The learning rate schedule advances once per step.

Invariants: one `optim_step` per step, which makes 1 (or `ppo_epochs` × minibatches) optimizer
updates, overwrites the metrics slot with that step's figures and returns the new policy version
(= number of steps so far); an update whose loss or gradient is not finite is not applied (the
step counts as skipped, or the run fails under "fail"); more than `max_consecutive_skips` skipped
steps in a row fail the run (the count is checkpointed).
"""

from __future__ import annotations

import asyncio
import math
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel

from relayrl.algorithms.losses import MAX_LOG_RATIO, DeferredLoss, LossConfig, deferred_policy_loss
from relayrl.backends.local.collate import PackedBatch
from relayrl.backends.local.gpumem import step_peak_gb
from relayrl.backends.local.logprobs import token_logprobs
from relayrl.backends.local.precision import Precision, cuda_precision_settings, in_compute_dtype, optimizer_options
from relayrl.backends.local.streams import enter_stream, handoff, receive, worker_stream
from relayrl.backends.protocols import Trainer
from relayrl.errors import RunFailed
from relayrl.models.loading import disable_dropout
from relayrl.models.lora import adapter_payload, is_peft_model, load_adapter_payload, peft_base, restore_adapter_dropout
from relayrl.models.sharing import clone_once
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
    lora_dropout: float = 0.0  # a LoRA model's adapter dropout, kept on in training (train.lora.dropout)
    ppo_epochs: int = 1  # passes over a step's data (train.ppo_epochs)
    minibatches_per_step: int = 1  # optimizer updates per pass (train.minibatches_per_step)
    # model.dtype resolved (relayrl.backends.local.precision): "float32" trains the model in the
    # dtype it comes in; "bfloat16" casts it to float32 master weights and computes on bfloat16
    # casts of them; "bfloat16-pure" casts it to bfloat16
    precision: str = "float32"

    @property
    def several_updates(self) -> bool:
        return self.ppo_epochs > 1 or self.minibatches_per_step > 1


class NonFiniteStepError(RunFailed, FloatingPointError):
    """A step's loss or gradient was NaN or infinite and `train.on_nonfinite = "fail"`, or more
    than `train.max_consecutive_skips` steps in a row were skipped for it under "skip". (A
    FloatingPointError, so the command line reports it in one line without importing torch.)"""


@dataclass(slots=True)
class _StepStats:
    """Token-weighted sums over a step's micro-batches; `weights[k]`: the loss tokens of the
    micro-batches that reported statistic k (one that applies only to some of them, e.g. the clip
    fractions of decoupled PPO on the updates after the step's first, is averaged over those)."""

    loss: float = 0.0
    tokens: int = 0
    loss_tokens: int = 0
    microbatches: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _Kept:
    """A micro-batch of a step with several updates, kept for the updates after the first, with
    its proximal log-probs (the policy's before the step's first update, per loss token)."""

    batch: TrainBatch
    proximal: torch.Tensor


def merge_stats(parts: list[_StepStats], into: _StepStats | None = None) -> _StepStats:
    """The statistics of the micro-batches of every part (e.g. one per rank), added to `into`
    (default: new ones)."""
    out = into if into is not None else _StepStats()
    for st in parts:
        out.loss += st.loss
        out.tokens += st.tokens
        out.loss_tokens += st.loss_tokens
        out.microbatches += st.microbatches
        for k, v in st.sums.items():
            out.sums[k] = out.sums.get(k, 0.0) + v
        for k, n in st.weights.items():
            out.weights[k] = out.weights.get(k, 0) + n
        for k, v in st.maxes.items():
            out.maxes[k] = max(out.maxes.get(k, -math.inf), v)
        for k, v in st.mins.items():
            out.mins[k] = min(out.mins.get(k, math.inf), v)
    return out


# per pass, these statistics are reported as `<key>_epoch<pass>` (several updates per step only)
EPOCH_STATS = ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_mean", "ppo_kl")


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
        self._adapters = is_peft_model(model)  # LoRA: only adapters train, travel and are checkpointed
        if settings.loss.kl_beta > 0 and ref_model is None and not self._adapters:
            raise ValueError("algorithm.kl_beta > 0 needs a reference model (or LoRA adapters, the reference being the model without them)")
        if settings.max_consecutive_skips < 1:
            raise ValueError(f"train.max_consecutive_skips must be >= 1, got {settings.max_consecutive_skips}")
        if settings.ppo_epochs < 1 or settings.minibatches_per_step < 1:
            raise ValueError(
                f"train.ppo_epochs and train.minibatches_per_step must be >= 1, got {settings.ppo_epochs}, {settings.minibatches_per_step}"
            )
        precision = Precision.of(settings.precision)
        if precision.name != "float32":  # the master weights' dtype (float32 keeps the model's own)
            torch.nn.Module.to(model, precision.master)
            with torch.no_grad():  # frozen (a LoRA base): no master copy needed, held in the compute dtype
                for p in model.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(precision.compute)
            if ref_model is not None:  # frozen: held in the compute dtype, as the samplers' copies
                torch.nn.Module.to(ref_model, precision.compute)
        if device is not None:  # before the optimizer is made: its parameters are the ones on the device
            torch.nn.Module.to(model, device)  # (transformers' own `to` types badly)
            if ref_model is not None:
                torch.nn.Module.to(ref_model, device)
        self.settings = settings  # (before wrap_model: a sharded compute's mixed precision policy reads it)
        self.precision = precision
        self.model = disable_dropout(model).train()  # train mode, but log-probs as the samplers' eval mode gives
        if self._adapters and settings.lora_dropout > 0:
            restore_adapter_dropout(model, settings.lora_dropout)
        self.ref_model = disable_dropout(ref_model).eval() if ref_model is not None else None
        self.wrap_model(self.model)  # before the optimizer is made: it holds the wrapped parameters
        self.device: torch.device = model.device
        cuda_precision_settings(self.device)  # TF32 for float32 matmuls on CUDA
        # bfloat16 compute over float32 master weights: parameter casts here (a sharded
        # compute's FSDP2 policy casts instead)
        self._cast_to: torch.dtype | None = precision.compute if precision.mixed and self.casts_params else None
        # what computes the log-probs: a peft model's wrapped model (its adapters injected; the
        # packed forward needs the plain causal LM's base model and head)
        self._net: PreTrainedModel = peft_base(model) if self._adapters else model
        self.version = 0
        self._optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=settings.learning_rate,
            weight_decay=settings.weight_decay,
            betas=settings.betas,
            **optimizer_options(self.device, fused_cpu=self.fused_cpu_optimizer),
        )
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(self._optimizer, lambda s: lr_multiplier(s, settings))
        self._stats = _StepStats()  # the step's first pass (today's figures)
        self._kept: list[_Kept] = []  # several updates per step: the step's micro-batches so far
        self._nonfinite_steps = 0  # steps whose update was skipped (loss or gradient not finite)
        self._consecutive_skips = 0  # ... of them, the last ones in a row
        self._slot: dict[str, float] = {}
        self._snapshot: Weights | None = None
        self._slot_lock = threading.Lock()

    # -- hooks a sharded compute (backends/local/ranks.py) overrides --------------------------
    world_size = 1  # processes that train a step together (each a part of its micro-batches)
    casts_params = True  # mixed precision ("bfloat16") by in_compute_dtype; False: wrap_model's (FSDP2)
    fused_cpu_optimizer = True  # AdamW's fused kernel on the CPU too (False: a sharded compute's DTensor parameters)

    def wrap_model(self, model: PreTrainedModel) -> None:
        """Wrap the policy in place before the optimizer is made. Default: nothing (one process)."""
        return None

    def gather_stats(self, stats: _StepStats) -> _StepStats:
        """The step's statistics over every process that trained a part of it. Default: this one's."""
        return stats

    def agree_counts(self, counts: dict[int, int]) -> dict[int, int]:
        """Per minibatch, the forward and backward passes every process runs in each update after
        the first (`counts`: this one's kept micro-batches). Default: this one's."""
        return counts

    def sum_loss(self, loss: float) -> float:
        """An update's loss summed over every process that trained a part of it. Default: this one's."""
        return loss

    def idle_step(self, tb: TrainBatch | None, backward: bool = True) -> None:
        """A pass that adds nothing, on `tb` (None: any micro-batch this process saw), for a
        process with fewer micro-batches than another in an update. Never needed by one process."""
        raise NotImplementedError("idle_step: a one-process trainer never idles")

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
        # on CUDA: this thread's stream waits for the commit's event (recorded after the optimizer's step too)
        receive(snapshot.ready, cast(dict[str, torch.Tensor], snapshot.payload).values(), self.device)
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
        if self._adapters:
            load_adapter_payload(self.model, state["model"])
        else:
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
        batch = self._on_device(tb)
        if not self.settings.several_updates:
            self._accumulate(tb, batch, self._stats)
            return
        if tb.minibatch == 0:  # the step's first update: trained now, its log-probs are the proximal ones
            proximal = self._accumulate(tb, batch, self._stats)[0]
        else:
            with torch.no_grad():
                proximal, _ = self._logprobs(self._net, batch)
        self._kept.append(_Kept(tb, proximal.detach()))

    def _logprobs(self, model: PreTrainedModel, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_logprobs` of `model` in the compute dtype ("bfloat16": on bfloat16 casts of the
        float32 master parameters; the log-probs themselves are float32), for no backward pass."""
        t = self.settings.temperature
        return in_compute_dtype(model, self._cast_to, lambda m: token_logprobs(m, batch, t))

    def _on_device(self, tb: TrainBatch) -> PackedBatch:
        batch = tb.payload
        if not isinstance(batch, PackedBatch):
            raise TypeError(f"micro-batch {tb.step}/{tb.index} was not collated by the TorchCollator")
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)  # once, every tensor of the micro-batch
        return batch

    def _accumulate(
        self, tb: TrainBatch, batch: PackedBatch, st: _StepStats, proximal: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, float]:
        """Forward and backward of one micro-batch, its figures added to `st`; `proximal`: the
        proximal policy's log-probs when it is no longer the current one (an update after the
        step's first). Returns the current log-probs, detached, and the loss."""
        cfg = self.settings.loss

        def forward_backward(net: torch.nn.Module) -> tuple[torch.Tensor, DeferredLoss]:
            logp, entropy = token_logprobs(net, batch, self.settings.temperature, entropy_grad=cfg.entropy_coef > 0)
            ref = None  # (entropy: a bonus, with its gradient)
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = self._logprobs(self.ref_model, batch)
            elif self._adapters and cfg.kl_beta > 0:  # the reference: the base model, adapters off
                with torch.no_grad(), self.model.disable_adapter():
                    ref, _ = token_logprobs(net, batch, self.settings.temperature)
            deferred = deferred_policy_loss(
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
                prox_logprobs=proximal,
            )
            deferred.loss.backward()
            return logp, deferred

        # Forward and backward under one set of compute-dtype casts: a layer that
        # train.gradient_checkpointing recomputes in the backward pass recomputes on the casts too.
        logp, deferred = in_compute_dtype(self._net, self._cast_to, forward_backward)
        extra: list[torch.Tensor] = []
        if proximal is not None:  # k3 estimate of KL(π_prox ‖ π) at this update's start (its sum)
            with torch.no_grad():
                delta = (logp.detach() - proximal).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
                extra.append((torch.exp(delta) - delta - 1.0).sum())
        out, extras = deferred.fetch_with(extra)  # the micro-batch's one host sync, after its backward pass is queued
        loss = out.loss_value
        st.loss += loss
        st.tokens += batch.num_real_tokens
        st.loss_tokens += out.num_tokens
        st.microbatches += 1
        n = out.num_tokens
        metrics = out.metrics()
        if extras:
            metrics["ppo_kl"] = extras[0] / max(1, n)
        for key, value in metrics.items():
            if key in ("loss", "num_loss_tokens"):
                continue
            if key.endswith("_max"):
                st.maxes[key] = max(st.maxes.get(key, -math.inf), value)
            elif key.endswith("_min"):
                st.mins[key] = min(st.mins.get(key, math.inf), value)
            else:
                st.sums[key] = st.sums.get(key, 0.0) + value * n
                st.weights[key] = st.weights.get(key, 0) + n
        return logp.detach(), loss

    def _update(self, loss: float) -> tuple[float, bool]:
        """Clip the accumulated gradient and apply it; a non-finite loss or gradient norm applies
        nothing (under "fail" the run fails). Returns the norm and whether it was applied."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = self.clip_gradients(params)
        finite = math.isfinite(grad_norm) and math.isfinite(loss)
        if finite:
            self._optimizer.step()
        elif self.settings.on_nonfinite == "fail":  # nothing of this step reaches the weights or the optimizer's moments
            self._optimizer.zero_grad(set_to_none=True)
            self._stats, self._kept = _StepStats(), []
            raise NonFiniteStepError(
                f"step {self.version}: the loss ({loss}) or gradient norm ({grad_norm}) is not finite "
                "(train.on_nonfinite = 'fail'; 'skip' skips such a step's update and goes on)"
            )
        self._optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def _later_updates(self) -> tuple[list[tuple[float, bool, float]], list[_StepStats]]:
        """The step's updates after the first (several updates per step), pass by pass, minibatch
        by minibatch, against the kept proximal log-probs: per update (gradient norm, applied,
        loss), and per pass after the first its figures (the first pass's go to `self._stats`)."""
        own: dict[int, int] = {}
        for kept in self._kept:
            own[kept.batch.minibatch] = own.get(kept.batch.minibatch, 0) + 1
        counts = self.agree_counts(own)  # (sharded: the most any rank holds, so the ranks' passes match)
        minibatches = sorted(counts)
        updates: list[tuple[float, bool, float]] = []
        sharded = self.world_size > 1  # (the first pass's figures so far were gathered over the ranks already)
        passes = [_StepStats() if sharded else self._stats] + [_StepStats() for _ in range(1, self.settings.ppo_epochs)]
        for epoch, st in enumerate(passes):
            for k in minibatches[1:] if epoch == 0 else minibatches:  # the first pass's first minibatch: the first update
                loss, ran = 0.0, 0
                for kept in self._kept:
                    if kept.batch.minibatch == k:
                        loss += self._accumulate(kept.batch, self._on_device(kept.batch), st, kept.proximal)[1]
                        ran += 1
                for _ in range(counts[k] - ran):
                    self.idle_step(self._kept[0].batch if self._kept else None)
                loss = self.sum_loss(loss)
                grad_norm, applied = self._update(loss)
                updates.append((grad_norm, applied, loss))
        if sharded:
            passes = [self.gather_stats(st) for st in passes]
            merge_stats([passes[0]], into=self._stats)  # (in place: the caller holds it)
        return updates, passes[1:]

    def optim_step(self) -> int:
        self._stats = self.gather_stats(self._stats)
        if self._stats.microbatches == 0:
            raise RuntimeError("optim_step with no accumulated train_step")
        lr = self._scheduler.get_last_lr()[0]
        first_loss = self._stats.loss
        grad_norm, finite = self._update(first_loss)
        updates = [(grad_norm, finite, first_loss)]
        passes = [self._stats]
        several = self.settings.several_updates
        if several:
            more, later_passes = self._later_updates()
            updates += more
            passes += later_passes
        skipped = [u for u in updates if not u[1]]
        if not skipped:
            self._consecutive_skips = 0
        else:
            self._consecutive_skips += 1
            limit = self.settings.max_consecutive_skips
            if self._consecutive_skips > limit:
                self._stats, self._kept = _StepStats(), []
                norm, _, loss = skipped[0]
                raise NonFiniteStepError(
                    f"step {self.version}: {self._consecutive_skips} steps in a row had a non-finite loss or gradient norm "
                    f"(this one: loss {loss}, gradient norm {norm}), more than train.max_consecutive_skips = {limit}: "
                    "their updates were all skipped (train.on_nonfinite = 'skip'), so the run is not training"
                )
            self._nonfinite_steps += 1
        with warnings.catch_warnings():  # after a skipped update torch warns the schedule ran first: it is meant to
            warnings.simplefilter("ignore", UserWarning)
            self._scheduler.step()  # the schedule follows the run's steps, skipped or not
        self._optimizer.zero_grad(set_to_none=True)
        st = self._stats
        per_pass = len(updates) // len(passes)
        slot: dict[str, float] = {
            "step": float(self.version),
            "loss": st.loss if not several else sum(u[2] for u in updates[:per_pass]) / per_pass,  # the first pass's mean update loss
            "grad_norm": grad_norm if not several else sum(u[0] for u in updates) / len(updates),
            "learning_rate": float(lr),
            "tokens": float(st.tokens),
            "completion_tokens": float(st.loss_tokens),
            "microbatches": float(st.microbatches),
            "skipped_nonfinite": 0.0 if not skipped else 1.0,
            "nonfinite_steps": float(self._nonfinite_steps),
        }
        slot.update({k: v / max(1, st.weights.get(k, 0)) for k, v in st.sums.items() if k != "ppo_kl"})
        slot.update(st.maxes)
        slot.update(st.mins)
        if several:
            slot["updates"] = float(sum(1 for u in updates if u[1]))
            for epoch, pst in enumerate(passes, start=1):
                for key in EPOCH_STATS:
                    if key in pst.sums:
                        slot[f"{key}_epoch{epoch}"] = pst.sums[key] / max(1, pst.weights.get(key, 0))
            last = passes[-1]
            slot["ppo_kl"] = last.sums.get("ppo_kl", 0.0) / max(1, last.weights.get("ppo_kl", 0))
        self._stats, self._kept = _StepStats(), []
        peak = step_peak_gb(self.device)  # GPU memory in telemetry (absent on the CPU)
        if peak is not None:
            slot["gpu_mem_peak_gb"] = peak
        self.version += 1
        snapshot = self.export()
        with self._slot_lock:
            self._slot = slot
            self._snapshot = snapshot
        return self.version

    def export(self) -> Weights:
        """The model's weights now, as the version it holds (with LoRA: its adapters only)."""
        if self._adapters:
            return Weights(version=self.version, payload=adapter_payload(self.model), ready=handoff(self.device))
        state = clone_once(self.model.state_dict())  # a tied weight: one clone under both names
        return Weights(version=self.version, payload=state, ready=handoff(self.device))  # (CUDA: other threads wait for it)


def _setup_trainer_thread(threads: int | None, stream: torch.cuda.Stream | None) -> None:
    """Runs first in the trainer's thread: its torch threads, and on CUDA its own stream."""
    if threads:
        torch.set_num_threads(threads)
    enter_stream(stream)


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
        self._host = ThreadHost("trainer", initializer=_setup_trainer_thread, initargs=(threads, worker_stream(self.compute.device)))

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
