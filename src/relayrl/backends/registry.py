"""Compute kinds and hosts: what computes (`run.backend`) and where its workers run (`ray.enabled`),
chosen once, here.

A *compute kind* is one entry of `KINDS`: the import path (`module:function`, imported only when
the kind is used, so the sim never imports torch) of a function `(cfg, abort) -> Compute`. A
`Compute` holds the kind's driver-side pieces (collator, prompt and text encoders, text decoder,
prompt bound, greedy engine factory, optional host work) and picklable factories for its trainer
and its sampler replicas. A *host* (`HOSTS`, picked by `ray.enabled`) places those factories:
`inprocess` calls them in this process (workers on threads), `ray` calls each in its own Ray actor
(`relayrl.backends.ray.build`). Either returns the `Backend` the program receives.

Adding an engine (e.g. a vLLM sampler with an FSDP trainer) is one new `KINDS` entry and its
module; neither the orchestrator nor a host changes.

Invariant: every driver-side piece is required except `host_work`; a kind that cannot do
something says so when it is asked (e.g. a text encoder that raises `UnsupportedError`), not by
a missing field the program must test. The one exception is `greedy_engine`: None means the kind
does not run held-out evaluations (the sim), so `eval.enabled` has no effect with it.
A factory is called once, in the process that hosts its worker, before the run starts.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from relayrl.backends.bundle import Backend
from relayrl.backends.protocols import Collator, GreedyEngine, HostWork, PromptEncoder, Sampler, TextDecoder, TextEncoder, Trainer
from relayrl.backends.transports import WeightBroadcast
from relayrl.config.schema import Config, ConfigError
from relayrl.telemetry.tracer import Tracer

# run.backend -> "module:function" returning the kind's `Compute` for a config
KINDS: dict[str, str] = {
    "sim": "relayrl.backends.sim.build:compute",
    "local": "relayrl.backends.local.build:compute",
}
# ray.enabled -> "module:function" placing a `Compute`'s workers (see `Host`)
HOSTS: dict[bool, str] = {
    False: "relayrl.backends.registry:place_in_process",
    True: "relayrl.backends.ray.build:place_on_ray",
}


@dataclass(slots=True, kw_only=True)
class Compute:
    """What a compute kind provides for one run (see the module)."""

    collator: Collator  # orchestrator-side, runs in the packing thread
    tokenize: PromptEncoder  # orchestrator-side, runs on the event loop (dispatch)
    encode_text: TextEncoder  # an observation's text → token ids (multi-turn episodes)
    decode: TextDecoder  # completion token ids → text (held-out evaluation)
    # prompt tokens the model's context leaves room for after rollout.max_new_tokens (None: no
    # bound); longer prompts are filtered at dispatch, never sampled
    max_prompt_tokens: int | None
    # builds the held-out evaluation's engine in the driver's process (None: the kind does not
    # evaluate, see the module)
    greedy_engine: Callable[[], GreedyEngine] | None
    trainer: Callable[[], Trainer]  # picklable: a host may call it in another process
    samplers: list[Callable[[], Sampler]]  # picklable; replica i is built by samplers[i]
    host_work: HostWork | None = None  # the sim's simulated bookkeeping cost; None for real backends
    tokenizer: object | None = None  # the model's tokenizer, orchestrator-side (the agents' endpoint); None: sim
    # in-process only: the collective weight transport over the trainer and samplers built here
    # (rollout.weight_transport = "collective" with vLLM engines); None: every version by export
    broadcast: Callable[[Trainer, list[Sampler]], WeightBroadcast] | None = None

    def backend(
        self,
        *,
        trainer: Trainer,
        samplers: list[Sampler],
        greedy: GreedyEngine | None,
        startup: dict[str, float],
        cleanup: Callable[[], None],
        attach_tracer: Callable[[Tracer], None],
        broadcast: WeightBroadcast | None = None,
    ) -> Backend:
        """The `Backend` of these driver-side pieces and the workers a host placed."""
        return Backend(
            trainer=trainer,
            samplers=samplers,
            collator=self.collator,
            tokenize=self.tokenize,
            encode_text=self.encode_text,
            decode=self.decode,
            max_prompt_tokens=self.max_prompt_tokens,
            greedy=greedy,
            host_work=self.host_work,
            tokenizer=self.tokenizer,
            startup=startup,
            cleanup=cleanup,
            attach_tracer=attach_tracer,
            sampler_gpu_peak=functools.partial(largest_gpu_peak, list(samplers)),
            broadcast=broadcast,
        )


def largest_gpu_peak(samplers: Sequence[Sampler]) -> float | None:
    """The largest `gpu_mem_peak_gb` of `samplers` (each read and reset); None when none measures
    one (the CPU, a GPU the trainer's counter covers, a remote worker)."""
    peaks = [p for p in (s.gpu_mem_peak_gb() for s in samplers) if p is not None]
    return max(peaks) if peaks else None


# a host: (config, the kind's compute, whether the run evaluates) -> the backend, workers placed
Host = Callable[[Config, Compute, bool], Backend]


def _load(spec: str) -> object:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def compute_kind(name: str) -> Callable[[Config, threading.Event], Compute]:
    """The kind `run.backend` names, imported now."""
    if name not in KINDS:
        raise ConfigError(f"run.backend: no compute kind named {name!r} (known: {', '.join(sorted(KINDS))})")
    kind: Callable[[Config, threading.Event], Compute] = _load(KINDS[name])  # type: ignore[assignment]
    return kind


def build_backend(cfg: Config, abort: threading.Event, *, evaluate: bool) -> Backend:
    """The backend of `cfg`: the `run.backend` kind's compute, its workers placed by the
    `ray.enabled` host. `abort` is the orchestrator's abort flag (host-side CPU work checks it);
    `evaluate`: the run has held-out evaluations (its greedy engine is built only then)."""
    compute = compute_kind(cfg.run.backend)(cfg, abort)
    host: Host = _load(HOSTS[cfg.ray.enabled])  # type: ignore[assignment]
    return host(cfg, compute, evaluate)


def _untraced(tracer: Tracer) -> None:
    """In-process workers trace no spans of their own."""


def _nothing() -> None:
    """In-process workers leave nothing to clean up after closing."""


def place_in_process(cfg: Config, compute: Compute, evaluate: bool) -> Backend:
    """The in-process host: every factory called here (workers on this process's threads), the
    samplers first, then the greedy engine, then the trainer."""
    samplers = [factory() for factory in compute.samplers]
    greedy = compute.greedy_engine() if evaluate and compute.greedy_engine is not None else None
    trainer = compute.trainer()
    return compute.backend(
        trainer=trainer,
        samplers=samplers,
        greedy=greedy,
        startup={},
        cleanup=_nothing,
        attach_tracer=_untraced,
        broadcast=compute.broadcast(trainer, samplers) if compute.broadcast is not None else None,
    )


__all__ = ["HOSTS", "KINDS", "Compute", "Host", "build_backend", "compute_kind", "place_in_process"]
