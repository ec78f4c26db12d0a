"""Dispatch: prompts → sample requests, as fast as the dispatch window allows.

Invariant: a group is dispatched only with a window credit, and each dispatched group gets a
fresh ledger id, so every dispatched prompt is accounted for downstream. Prompts are encoded
here, on the event loop, by the backend's `PromptEncoder` (a tokenizer: cheap, orchestrator-side).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from itertools import islice

from relayrl.backends.protocols import PromptEncoder
from relayrl.ledger import Ledger
from relayrl.types import Prompt, SampleRequest
from relayrl.window import DispatchWindow


async def dispatch_stage(
    prompts: Iterator[Prompt],
    tokenize: PromptEncoder,
    window: DispatchWindow,
    ledger: Ledger,
    outbox: asyncio.Queue[list[SampleRequest]],
    num_generations: int,
    prompts_per_request: int,
) -> None:
    while True:
        n = await window.acquire(prompts_per_request)
        batch = list(islice(prompts, n))
        if len(batch) < n:
            raise RuntimeError("the prompt stream ended before the run's last step (task data exhausted)")
        ids = ledger.dispatch(batch, num_generations)
        await outbox.put([SampleRequest(gid, p, tokenize(p.text), num_generations) for gid, p in zip(ids, batch)])
