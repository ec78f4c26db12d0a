"""The vLLM sampler's ordering of calls and weight loads, on a stand-in engine (no engine start):
a load waits for the calls running when it is asked for, calls made after it wait for it, each
result carries the version that sampled it, and a load cancelled while it waits lets the calls
behind it run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.backends.vllm.engine import EngineSettings
from relayrl.backends.vllm.sampler import VllmSampler
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.types import SampleRequest, Weights
from support.vllmoutputs import FakeLogprob, FakeOutput, FakeSample


@dataclass
class FakeEngine:
    """Generates one token (the loaded version) per sample once `release` is set."""

    loaded: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    started: int = 0
    log: list[str] = field(default_factory=list)

    async def generate(self, prompt: dict[str, list[int]], params: Any, request_id: str) -> AsyncIterator[FakeOutput]:
        self.started += 1
        version = self.loaded
        await self.release.wait()
        self.log.append(f"generate v{version}")
        yield FakeOutput(request_id, [FakeSample(i, [version], [{version: FakeLogprob(-1.0)}]) for i in range(params.n)])

    async def collective_rpc(self, method: str, args: tuple[str, ...]) -> list[dict[str, float]]:
        self.loaded += 1
        self.log.append(f"load v{self.loaded}")
        return [{"seconds": 0.0}]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    async def abort(self, ids: list[str]) -> None:
        return None

    def shutdown(self, timeout: float | None = None) -> None:
        return None


def _request() -> SampleRequest:
    return SampleRequest(group_id=0, prompt=None, prompt_tokens=[5, 6], num_samples=2)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def weights() -> dict[str, Any]:
    model, _ = load_model_and_tokenizer(shipped_model_dir())
    return dict(model.state_dict())


def test_a_load_waits_for_running_calls_and_later_calls_wait_for_it(weights: dict[str, Any]) -> None:
    async def go() -> None:
        engine = FakeEngine()
        sampler = VllmSampler(EngineSettings(model=str(shipped_model_dir())), temperature=1.0, max_new_tokens=4, engine=engine)
        first = asyncio.ensure_future(sampler.generate([_request()]))
        while engine.started == 0:
            await asyncio.sleep(0)
        load = asyncio.ensure_future(sampler.load_weights(Weights(version=1, payload=weights)))
        for _ in range(3000):  # its weight file is written first (calls made meanwhile sample v0), then it takes the gate
            if sampler._loading:
                break
            await asyncio.sleep(0.01)
        later = asyncio.ensure_future(sampler.generate([_request()]))
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.log == [] and engine.started == 1  # the load waits for `first`, `later` for the load
        engine.release.set()
        a, _, b = await asyncio.gather(first, load, later)
        assert engine.log == ["generate v0", "load v1", "generate v1"]
        assert (a[0].policy_version, b[0].policy_version) == (0, 1)
        assert a[0].completions[0].tokens == [0] and b[0].completions[0].tokens == [1]

    asyncio.run(go())


def test_a_load_cancelled_while_it_waits_lets_later_calls_run(weights: dict[str, Any]) -> None:
    async def go() -> None:
        engine = FakeEngine()
        sampler = VllmSampler(EngineSettings(model=str(shipped_model_dir())), temperature=1.0, max_new_tokens=4, engine=engine)
        first = asyncio.ensure_future(sampler.generate([_request()]))
        while engine.started == 0:
            await asyncio.sleep(0)
        load = asyncio.ensure_future(sampler.load_weights(Weights(version=1, payload=weights)))
        await asyncio.sleep(0)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        engine.release.set()
        await first
        (result,) = await asyncio.wait_for(sampler.generate([_request()]), 30)
        assert result.policy_version == 0 and engine.log == ["generate v0", "generate v0"]

    asyncio.run(go())
