"""Worker interfaces every backend implements (sim, local torch, Ray).

Invariants:
- every call a stage makes on a worker is awaitable, so an in-process object and a Ray actor
  handle look the same to the orchestrator. Heavy compute never runs on the event loop;
- the orchestrator reads no attribute off a worker: everything it learns comes from an awaitable
  call's result or is a plain value fixed when the bundle was built and kept on the orchestrator
  side (a sampler's replica number is its slot in `relayrl.orchestrator.replicas.ReplicaPool`; the version a
  sampler holds is the one the sync stage last loaded into it; results carry their version);
- what a worker receives holds only what it computes on (`SampleRequest`, `Weights`,
  `TrainBatch`: token ids and numbers, no trajectories), so it can be sent to another process.

Orchestrator-side pieces a backend also provides (`Collator`, `PromptEncoder`, `TextEncoder`,
`TextDecoder`, `GreedyEngine`) are protocols too; they run in the orchestrator's process.

`Sampler` and `Trainer` carry the defaults of their optional parts, so a worker that subclasses
them writes only what it computes, and callers never ask what a worker is (`isinstance`): a
sampler that cannot run episodes raises one clear error from `generate_turns`, one that keeps no
caches ignores `end_episodes`, one that cannot be restarted says so (`restartable` is false); a
trainer that cannot queue ahead has `queue_ahead` false, one whose exports samplers cannot wait
for has no `export_ahead`; one that cannot checkpoint raises one clear error from `save_state` /
`load_state`.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from relayrl.types import EvalResult, GenerateResult, MicroBatch, SampleRequest, TrainBatch, TurnRequest, TurnResult, Weights

__all__ = [
    "Collator",
    "Evaluator",
    "GreedyEngine",
    "PendingExport",
    "PromptEncoder",
    "Sampler",
    "TextDecoder",
    "TextEncoder",
    "Trainer",
    "UnsupportedError",
    "Weights",
]


class UnsupportedError(NotImplementedError):
    """A worker or compute kind was asked for something it cannot do; the message names what,
    and the config key that asks for it."""


class Sampler(Protocol):
    """A sampler replica. Subclass it to inherit the defaults of the optional parts
    (`generate_turns`, `end_episodes`, `restartable` / `restart`, `close`)."""

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        """Sample every request with the weights loaded when the call starts; each result carries
        the version of those weights. An interruptible sampler (rollout.interruptible) may take a
        load during the call, between two decode steps, and go on with the new weights: each
        completion then lists its tokens' versions (`Completion.versions`) and the result carries
        the oldest."""
        ...

    async def generate_turns(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Sample the next policy turn of each multi-turn episode (one completion per request),
        with the weights loaded when the call starts. A sampler may keep each episode's KV cache
        after the call, to read only the new tokens of its next turn's context; it must produce
        what re-reading the whole context would (and re-read it when the cache does not cover a
        prefix of the context or was computed with other weights). Default: this sampler cannot
        run episodes (one error naming it)."""
        raise UnsupportedError(f"the {type(self).__name__} sampler cannot run multi-turn episodes (task.environment)")

    async def end_episodes(self, episodes: Sequence[str]) -> None:
        """Forget the caches of these episodes (they are over). Unknown names are ignored.
        Default: nothing to forget (a sampler that keeps no caches)."""
        return None

    async def load_weights(self, weights: Weights) -> None:
        """Swap to `weights` (no reload from disk). Never called while another load runs. An
        interruptible sampler returns once the weights are in, without waiting for a running
        `generate` (which goes on with them)."""
        ...

    def restartable(self, exc: BaseException) -> bool:
        """Whether `exc` means the worker died (or came back without weights) and can be restarted
        with `restart`. Default: never (an in-process worker does not die alone)."""
        return False

    async def restart(self) -> None:
        """Wait (bounded) for the worker to be alive again, holding no weights; raise if it cannot
        be restarted. Called only after `restartable(exc)` said yes. The weight publisher then
        loads the current version into it: a worker never fetches weights itself
        (orchestrator/publisher.py)."""
        raise UnsupportedError(f"the {type(self).__name__} sampler cannot be restarted")

    async def close(self) -> None:
        """Release the worker. Default: nothing to release."""
        return None

    def gpu_mem_peak_gb(self) -> float | None:
        """Peak allocated GPU memory (GiB) of this worker since the last call, the peak then reset;
        None where it is not measured (the CPU, a GPU the trainer's own counter covers, a remote
        worker). Asked once per step by the host that built the worker (`Backend.sampler_gpu_peak`),
        on the event loop: it must not block. Default: None."""
        return None


class GreedyEngine(Protocol):
    """The worker a held-out evaluation runs on (e.g. a sampler replica kept out of rollouts)."""

    async def load_weights(self, weights: Weights) -> None: ...

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...

    async def close(self) -> None: ...


@dataclass(slots=True, frozen=True)
class PendingExport:
    """An export the samplers may start loading before it ended (`Trainer.export_ahead`): `weights`
    (its version, and a payload each sampler resolves where it loads, waiting for the export there)
    to hand to every load now, and `done`, the export's own result, which the caller awaits (it
    raises the export's failure; the loads of a failed export fail too, for that reason)."""

    weights: Weights
    done: Awaitable[Weights]


class Trainer(Protocol):
    """The trainer. Subclass it to inherit the defaults of the optional parts (`queue_ahead` /
    `optim_step_ahead`, `save_state` / `load_state`, `close`).

    Queue ahead (the Ray trainer can): queue the next step's first micro-batch right behind the
    optimizer update, so the trainer starts it the moment the update ends instead of a driver
    round trip later (docs/design.md, rule 10). `queue_ahead` says whether it may be used now
    (false: the trainer cannot, or it is disabled); the caller uses `optim_step_ahead` only then.

    `optim_step_ahead(ahead)` is `optim_step()`, calling `ahead()` once, as late as it can: when
    the update has been sent (every training call before it having ended). `ahead()` returns the
    next step's first micro-batch if it is ready by then (else None); the trainer sends it right
    behind the update, as the next training call. It returns the new version once the update
    returned, and whether a micro-batch was queued so, without waiting for its train step, which is
    then outstanding exactly as if `train_step(batch)` had been called right after `optim_step()`
    returned (its result or error is awaited by the next training call). The trainer must start
    it only after the update ended (so it accumulates only into gradients the update already
    zeroed, and what the update published, the version's weights and metrics, is what it would
    have been without it). The caller does not call `train_step` for a queued micro-batch."""

    async def ready(self) -> None:
        """Wait until the trainer can take calls: its start-up, bounded by the trainer's own
        setting (the sharded trainer: train.rank_startup_timeout_s); the call bound
        (train.call_timeout_s) starts after it. Default: ready once constructed."""
        return None

    @property
    def queue_ahead(self) -> bool:
        """Whether `optim_step_ahead` may be used now. Default: no."""
        return False

    async def optim_step_ahead(self, ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
        """See the class. Default (a trainer that cannot queue): `optim_step()`, queueing nothing."""
        return await self.optim_step(), False

    async def train_step(self, batch: TrainBatch) -> None:
        """Forward + backward on one collated micro-batch, accumulating gradients."""
        ...

    def step_train_time(self, step: int) -> float | None:
        """Seconds `step`'s train_step calls ran where they ran (summed), once its `optim_step`
        returned; None (the default): the caller's timing of each `train_step` call is the
        trainer's own (an in-process trainer). A trainer whose `train_step` returns before the
        work ends (the Ray trainer sends it ahead) answers from its own spans."""
        return None

    def step_optim_time(self, step: int) -> float | None:
        """Seconds `step`'s `optim_step` ran where it ran, once it returned; None (the default):
        the caller's timing of the call is the trainer's own. A trainer whose `optim_step` call
        also waits for train steps sent ahead, or runs held ones, answers from its own spans, so
        no second is counted twice with `step_train_time`."""
        return None

    async def optim_step(self) -> int:
        """Apply the accumulated update; returns the new policy version. Overwrites the metrics
        slot that `get_metrics` reads."""
        ...

    async def get_metrics(self) -> dict[str, float]:
        """Metrics of the last committed step (read from the slot `optim_step` filled). Must not
        wait behind a train step."""
        ...

    async def export_weights(self) -> Weights:
        """The weights of the last committed version. Should not wait behind a train step."""
        ...

    async def export_ahead(self) -> PendingExport | None:
        """Start `export_weights` and return without waiting for it, where samplers can wait for
        an export themselves (the Ray trainer: its loads then start without a driver round trip
        between the export and them); None (the default): the caller awaits `export_weights`."""
        return None

    async def save_state(self, directory: Path) -> None:
        """Write the committed state (weights, optimizer, schedule, version) into `directory`.
        Called between a commit and the next `optim_step`, which waits for it; training may run
        meanwhile, so it must not wait behind a train step. Default: this trainer cannot
        checkpoint (one error naming it)."""
        raise UnsupportedError(f"the {type(self).__name__} trainer cannot save its state (orchestrator.checkpoint_every)")

    async def load_state(self, directory: Path) -> int:
        """Restore what `save_state` wrote (before any training); returns its version. Default:
        this trainer cannot resume (one error naming it)."""
        raise UnsupportedError(f"the {type(self).__name__} trainer cannot load a checkpoint (--resume)")

    async def close(self) -> None:
        """Release the trainer. Default: nothing to release."""
        return None


class Collator(Protocol):
    """Turns a planned micro-batch into the `payload` of the trainer's `TrainBatch`. Runs in the
    orchestrator's packing thread.

    Rows were sized by `relayrl.packing.layout_tokens`: with `mb.share_prompt` a collator must
    lay each row out as `relayrl.packing.segments` (one prompt copy per segment) or it may
    exceed the row budget."""

    def collate(self, mb: MicroBatch) -> object: ...


class HostWork(Protocol):
    """Extra host-side work a backend simulates inside each bookkeeping span (the sim backend
    burns CPU holding the GIL, as a large run's real bookkeeping does). Runs in the bookkeeping
    thread; returns early once `abort` is set."""

    def spend(self, part: str, abort: threading.Event) -> None: ...


class PromptEncoder(Protocol):
    """Prompt text → prompt token ids (the task's template applied). Orchestrator-side: called
    on the event loop by the dispatch stage, so it must be cheap (a tokenizer, not a model)."""

    def __call__(self, text: str) -> list[int]: ...


class TextEncoder(Protocol):
    """An observation's text → token ids (multi-turn episodes), no special tokens added, and as
    plain text: a special token's string in it (`<eos>`, a chat model's role markers) is split
    into ordinary tokens, never read as that token, unless `special_tokens` (the environment's
    opt-in). Orchestrator-side, in the `env` thread, one call at a time. `max_token_chars`: no
    token stands for more characters than this, so a text of n characters has at least
    n / max_token_chars tokens (the size check made before tokenizing). A kind that cannot run
    episodes gives one that raises `UnsupportedError`."""

    @property
    def max_token_chars(self) -> int: ...

    def __call__(self, text: str, *, special_tokens: bool = False) -> list[int]: ...


class TextDecoder(Protocol):
    """Completion token ids → text, cut at the end-of-sequence token (held-out evaluation).
    Orchestrator-side, on the event loop."""

    def __call__(self, tokens: list[int]) -> str: ...


class Evaluator(Protocol):
    """Held-out evaluation of a policy version (`relayrl.eval.heldout.HeldoutEvaluator`)."""

    async def evaluate(self, weights: Weights | None) -> EvalResult:
        """Accuracy of `weights` (None: of the weights the evaluator's engine holds now); the
        result names the version it measured."""
        ...

    async def close(self) -> None: ...
