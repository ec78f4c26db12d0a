"""The workers a run uses, built for the configured backend (`relayrl.backends.sim.build`,
`relayrl.backends.local.build`).

Invariant: the program only sees the protocols; which backend built them, and where its workers
run (threads of this process, other processes), is invisible to it. Samplers are numbered by
their position in `samplers` (see `relayrl.orchestrator.replicas.ReplicaPool`), not by asking them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.backends.protocols import Collator, Evaluator, HostWork, PromptEncoder, Sampler, Trainer
from relayrl.telemetry.tracer import Tracer


@dataclass(slots=True)
class Backend:
    trainer: Trainer
    samplers: list[Sampler]  # replica i is samplers[i]
    collator: Collator  # orchestrator-side, runs in the packing thread
    tokenize: PromptEncoder  # orchestrator-side, runs on the event loop (dispatch)
    host_work: HostWork | None = None  # the sim's simulated bookkeeping cost; None for real backends
    evaluator: Evaluator | None = None
    # seconds each start-up phase took before the run began (e.g. "ray_start"); the run traces
    # each as an orchestrator span ending at its time 0
    startup: dict[str, float] = field(default_factory=dict)
    # runs after the workers closed, even when closing one failed (e.g. shut down a Ray cluster)
    cleanup: Callable[[], None] | None = None
    # prompt tokens the model's context leaves room for after rollout.max_new_tokens (None: no
    # bound); longer prompts are filtered at dispatch, never sampled
    max_prompt_tokens: int | None = None
    # an observation's text → token ids, no special tokens (multi-turn episodes); None: the
    # backend cannot run them
    encode_text: Callable[[str], list[int]] | None = None
    # given the run's tracer once it exists, by workers that trace spans of their own (Ray actors)
    attach_tracer: Callable[[Tracer], None] | None = None

    async def close(self) -> None:
        """Close every worker, even when some fail to close (a retired replica may be broken),
        then run `cleanup`; the first error is raised after all were tried."""
        closers = [s.close for s in self.samplers]
        if self.evaluator is not None:
            closers.append(self.evaluator.close)
        closers.append(self.trainer.close)
        first: Exception | None = None
        for close in closers:
            try:
                await close()
            except Exception as exc:
                first = first or exc
        if self.cleanup is not None:
            try:
                self.cleanup()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first
