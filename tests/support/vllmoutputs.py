"""Stand-ins for the request outputs vLLM's engine yields (`RequestOutput`, `CompletionOutput`,
`Logprob`), with the fields relayrl's vLLM sampler reads: for stand-in engines in tests that need
no vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeSample:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]]
    text: str = ""
    finish_reason: str = "stop"


@dataclass
class FakeOutput:
    request_id: str
    outputs: list[FakeSample]
    finished: bool = True
    num_cached_tokens: int = 0
