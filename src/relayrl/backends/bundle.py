"""The workers a run uses, as the program receives them: a compute kind's driver-side pieces and
its workers, placed by a host (`relayrl.backends.registry`).

Invariant: the program only sees the protocols; which kind built them, and where its workers run
(threads of this process, Ray actors), is invisible to it. Samplers are numbered by their
position in `samplers` (see `relayrl.orchestrator.replicas.ReplicaPool`), not by asking them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from relayrl.backends.protocols import Collator, GreedyEngine, HostWork, PromptEncoder, Sampler, TextDecoder, TextEncoder, Trainer
from relayrl.backends.transports import WeightBroadcast
from relayrl.telemetry.tracer import Tracer


@dataclass(slots=True, kw_only=True)
class Backend:
    trainer: Trainer
    samplers: list[Sampler]  # replica i is samplers[i]
    collator: Collator  # orchestrator-side, runs in the packing thread
    tokenize: PromptEncoder  # orchestrator-side, runs on the event loop (dispatch)
    encode_text: TextEncoder  # an observation's text → token ids, as plain text (multi-turn episodes)
    decode: TextDecoder  # completion token ids → text (held-out evaluation)
    # prompt tokens the model's context leaves room for after rollout.max_new_tokens (None: no
    # bound); longer prompts are filtered at dispatch, never sampled
    max_prompt_tokens: int | None
    # the engine the orchestrator's held-out evaluator runs on (None: this run does not evaluate:
    # eval.enabled is false, there is no held-out set, or the kind does not evaluate)
    greedy: GreedyEngine | None
    # seconds each start-up phase took before the run began (e.g. "ray_start"); the run traces
    # each as an orchestrator span ending at its time 0
    startup: dict[str, float]
    # runs after the workers closed, even when closing one failed (e.g. shut down a Ray cluster)
    cleanup: Callable[[], None]
    # given the run's tracer once it exists (workers that trace spans of their own: Ray actors)
    attach_tracer: Callable[[Tracer], None]
    host_work: HostWork | None = None  # the sim's simulated bookkeeping cost; None for real backends
    tokenizer: object | None = None  # the model's tokenizer, orchestrator-side (the agents' endpoint); None: sim
    # the largest peak GPU memory (GiB) of the samplers in this process since the last call (each
    # worker's `Sampler.gpu_mem_peak_gb`, asked by the host that built it: the orchestrator only
    # awaits a worker's calls); None: none measured
    sampler_gpu_peak: Callable[[], float | None] = lambda: None
    # rollout.weight_transport = "collective": the broadcast the weight publisher uses for the rounds
    # it covers (None: every version moves by the trainer's export)
    broadcast: WeightBroadcast | None = None

    async def close(self) -> None:
        """Close every worker, even when some fail to close (a retired replica may be broken),
        then run `cleanup`; the first error is raised after all were tried."""
        closers = [s.close for s in self.samplers]
        if self.greedy is not None:
            closers.append(self.greedy.close)
        closers.append(self.trainer.close)
        first: Exception | None = None
        for close in closers:
            try:
                await close()
            except Exception as exc:
                first = first or exc
        try:
            self.cleanup()
        except Exception as exc:
            first = first or exc
        if first is not None:
            raise first
