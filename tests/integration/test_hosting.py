"""Host-agnostic workers: the one thread host, what crosses to a worker, what the orchestrator
reads off one (nothing but awaited results)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from relayrl.backends.registry import build_backend
from relayrl.backends.sim import SimSampler, SimTrainer
from relayrl.eval.heldout import HeldoutEvaluator
from relayrl.orchestrator.build import build_program
from relayrl.threads import OrchestratorThreads, ThreadHost
from relayrl.types import GenerateResult, Prompt, SampleRequest, TrainBatch, Trajectory, Weights
from support.simutil import make_program, run_checked, sim_config, trace_spans

# -- ThreadHost ---------------------------------------------------------------------------------


def test_thread_host_runs_calls_in_order_in_its_named_thread() -> None:
    seen: list[tuple[int, str]] = []

    def work(i: int) -> int:
        time.sleep(0.002 * (5 - i))  # earlier calls are slower: order must still hold
        seen.append((i, threading.current_thread().name))
        return i

    async def main() -> list[int]:
        host = ThreadHost("unit-host")
        try:
            return list(await asyncio.gather(*(host.call(functools.partial(work, i)) for i in range(5))))
        finally:
            await host.aclose()

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert {name for _, name in seen} == {"relayrl-unit-host_0"}


def test_thread_host_initializer_runs_first_in_the_thread() -> None:
    marks: list[str] = []

    async def main() -> str:
        host = ThreadHost("init-host", initializer=lambda tag: marks.append(f"{tag}:{threading.current_thread().name}"), initargs=("init",))
        try:
            return await host.call(lambda: threading.current_thread().name)
        finally:
            host.close()

    name = asyncio.run(main())
    assert marks == [f"init:{name}"]


@pytest.mark.parametrize("per_call", [False, True])
def test_a_cancelled_call_returns_only_after_its_work_stopped(per_call: bool) -> None:
    started, stopped = threading.Event(), threading.Event()
    ticks: list[float] = []

    def cooperative(abort: threading.Event) -> str:
        started.set()
        while not abort.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)
        time.sleep(0.05)  # winding down takes a while: the caller must wait for it
        stopped.set()
        return "stopped"

    async def main() -> None:
        host = ThreadHost("cancel-host")
        call_abort = threading.Event() if per_call else None
        flag = call_abort if call_abort is not None else host.abort
        try:
            task = asyncio.create_task(host.call(lambda: cooperative(flag), call_abort))
            await asyncio.to_thread(started.wait, 5.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stopped.is_set(), "the cancelled call returned while its work was still running"
            assert flag.is_set()
            n = len(ticks)
            await asyncio.sleep(0.03)
            assert len(ticks) == n  # nothing runs behind the caller's back
            # with a per-call flag the host is not aborted: the next call runs normally
            assert host.abort.is_set() is not per_call
            assert await host.call(lambda: 42) == 42
        finally:
            await host.aclose()

    asyncio.run(main())


def test_a_closed_host_refuses_calls_and_orchestrator_threads_share_one_abort_flag() -> None:
    async def main() -> None:
        host = ThreadHost("closed-host")
        await host.aclose()
        await host.aclose()  # idempotent
        with pytest.raises(RuntimeError, match="closed-host is closed"):
            await host.call(lambda: 1)
        threads = OrchestratorThreads(("a", "b"))
        assert await threads.run("a", lambda: threading.current_thread().name) == "relayrl-a_0"
        threads.shutdown()
        assert threads.abort.is_set()
        with pytest.raises(RuntimeError, match="closed"):
            await threads.run("b", lambda: 1)

    asyncio.run(main())


# -- what crosses to a worker -------------------------------------------------------------------


def _holds(value: object, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, kinds):
        return True
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds(getattr(value, f.name), kinds) for f in dataclasses.fields(value))
    if isinstance(value, (list, tuple, set)):
        return any(_holds(v, kinds) for v in value)
    if isinstance(value, dict):
        return any(_holds(k, kinds) or _holds(v, kinds) for k, v in value.items())
    return False


class _SpyTrainer(SimTrainer):
    """Asserts that train_step receives a TrainBatch holding no trajectory and no text."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.batches: list[TrainBatch] = []

    async def train_step(self, batch: TrainBatch) -> None:
        assert type(batch) is TrainBatch, type(batch)
        assert not _holds(batch, (Trajectory, Prompt, str)), batch
        self.batches.append(batch)
        await super().train_step(batch)


def test_train_step_receives_only_the_collated_payload_and_counts(tmp_path: Path) -> None:
    cfg = sim_config()
    spy = _SpyTrainer(cfg.sim)
    backend = build_backend(cfg, threading.Event(), evaluate=False)
    backend.trainer = spy
    program = build_program(cfg, run_dir=tmp_path / "run", backend=backend)
    result = run_checked(program)
    assert result.summary["status"] == "completed"
    assert spy.batches and all(b.num_sequences == len(b.advantages) > 0 for b in spy.batches)
    per_step = cfg.rollout.groups_per_step * cfg.rollout.num_generations
    assert sum(b.num_sequences for b in spy.batches) == cfg.run.steps * per_step


# -- nothing is read off a worker ---------------------------------------------------------------


class _Opaque:
    """A worker as a remote handle looks: only its awaitable methods; reading anything else
    (e.g. `.replica`, `.version`) fails the test."""

    __slots__ = ("_inner",)

    def __init__(self, inner: object) -> None:
        object.__setattr__(self, "_inner", inner)

    def __getattribute__(self, name: str) -> object:
        if name in ("generate", "load_weights", "close", "greedy", "_inner", "__class__"):
            return object.__getattribute__(self, name)
        raise AssertionError(f"the orchestrator read {name!r} off a worker")

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        return await self._inner.generate(requests)  # type: ignore[attr-defined]

    async def load_weights(self, weights: Weights) -> None:
        await self._inner.load_weights(weights)  # type: ignore[attr-defined]

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return await self._inner.greedy(prompts_tokens, max_new_tokens)  # type: ignore[attr-defined]

    async def close(self) -> None:
        await self._inner.close()  # type: ignore[attr-defined]


def test_no_stage_reads_replica_or_version_off_a_sampler(tmp_path: Path) -> None:
    cfg = sim_config("rollout.num_samplers=2", "sim.generate_per_request=0.01")
    program = make_program(cfg, tmp_path)
    program.backend.samplers[:] = [
        _Opaque(  # type: ignore[misc]  # deliberately not a Sampler: it hides replica and version
            SimSampler(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=i)
        )
        for i in range(2)
    ]
    result = run_checked(program)
    assert result.summary["status"] == "completed"
    lanes = {s.lane for s in trace_spans(result) if s.name == "generate"}
    assert lanes == {"sampler/0", "sampler/1"}


def test_the_evaluator_reports_the_version_it_loaded_without_asking_the_engine() -> None:
    class Engine:
        async def load_weights(self, weights: Weights) -> None:
            return None

        async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
            return [[1] for _ in prompts_tokens]

        async def close(self) -> None:
            return None

    prompts = [Prompt("p0", "1+1=", "2"), Prompt("p1", "2+2=", "4")]
    evaluator = HeldoutEvaluator(
        _Opaque(Engine()), prompts, lambda text: [ord(c) for c in text], lambda tokens: "2", max_new_tokens=4, version=3
    )

    async def main() -> tuple[int, int, float]:
        first = await evaluator.evaluate(None)
        later = await evaluator.evaluate(Weights(version=7, payload=None))
        await evaluator.close()
        return first.version, later.version, later.accuracy

    assert asyncio.run(main()) == (3, 7, 0.5)
