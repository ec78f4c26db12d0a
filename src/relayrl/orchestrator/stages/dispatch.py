"""Dispatch: prompts → sample requests, as fast as the dispatch window allows.

Invariant: a group is dispatched only with a window credit, and each dispatched group gets a
fresh ledger id, so every dispatched prompt is accounted for downstream. Its random stream is
keyed by the prompt's index in the prompt stream (`Drawn.rng_key`), never by the prompt alone:
a prompt dispatched again (a later epoch, a filtered group replaced, two groups of one prompt in
flight) samples afresh, and a resumed run samples its replayed prompts as before the kill.
Prompts are encoded here, on the event loop, by the backend's `PromptEncoder` (a tokenizer:
cheap, orchestrator-side). A prompt longer than `max_prompt_tokens` (no room left for the
completions in the model's context, or for one action within a multi-turn episode's token
limit) is never sent to a sampler: its group is filtered as `too_long`, once warned about. A
batch whose prompts are all filtered yields to the event loop before the next one (credits come
back at once, so nothing else would await): the stage never spins, and a stop always winds down.
A task whose finite training rows hold no prompt that fits is refused before the run
(orchestrator/build.py `check_prompts_fit`); one where too few fit fails by the filter bound
(`orchestrator.max_filtered_per_step`, orchestrator/ledger.py).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator
from itertools import islice

from relayrl.backends.protocols import PromptEncoder
from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.window import DispatchWindow
from relayrl.types import Drawn, FilterReason, Group, SampleRequest


class PromptTooLongWarning(RuntimeWarning):
    """Prompts too long for the model's context are being filtered (see the module docstring)."""


async def dispatch_stage(
    prompts: Iterator[Drawn],
    tokenize: PromptEncoder,
    window: DispatchWindow,
    ledger: Ledger,
    outbox: asyncio.Queue[list[SampleRequest]],
    *,
    num_generations: int,
    prompts_per_request: int,
    max_prompt_tokens: int | None = None,
) -> None:
    warned = False
    while True:
        n = await window.acquire(prompts_per_request)
        batch = list(islice(prompts, n))
        if len(batch) < n:
            raise RuntimeError("the prompt stream ended before the run's last step (task data exhausted)")
        requests: list[SampleRequest] = []
        for gid, drawn in zip(ledger.dispatch(batch, num_generations), batch):
            prompt = drawn.prompt
            tokens = tokenize(prompt.text)
            if max_prompt_tokens is None or len(tokens) <= max_prompt_tokens:
                requests.append(SampleRequest(gid, prompt, tokens, num_generations, drawn.rng_key))
                continue
            if not warned:
                warnings.warn(
                    f"prompt {prompt.prompt_id!r} has {len(tokens)} tokens, more than the {max_prompt_tokens} a prompt may have "
                    "(the model's context less rollout.max_new_tokens; multi-turn: rollout.max_total_tokens less one): "
                    "such prompts are not sampled (their groups are filtered as too_long)",
                    PromptTooLongWarning,
                    stacklevel=1,
                )
                warned = True
            ledger.filtered(Group(gid, []), FilterReason.TOO_LONG, window)
        if requests:
            await outbox.put(requests)
        else:  # every prompt filtered: a credit came back at once, so nothing here awaited; let the loop
            await asyncio.sleep(0)  # run (a stop, the other stages) between batches, never a spin
