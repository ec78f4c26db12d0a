"""Bounds on worker calls (relayrl.orchestrator.deadlines): a generate or weight load that never returns fails
its replica over; a trainer call that never returns fails the run naming the call; the bound
itself cancels what it gave up on and leaves no task or unretrieved error behind. The stall
watchdog (relayrl.orchestrator.watchdog) ends a run in which no step commits, saying where it is stuck."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from relayrl.backends.sim.workers import SimSampler
from relayrl.orchestrator.deadlines import CallTimeoutError, bounded
from relayrl.orchestrator.replicas import SamplerRetiredWarning
from relayrl.orchestrator.watchdog import StallError
from relayrl.types import GenerateResult, SampleRequest, Weights
from support.cli import run_python
from support.simutil import make_program, run_checked, settled_groups, sim_config


class HangsAfter(SimSampler):
    """A sim sampler whose generate calls from number `calls` + 1 on never return."""

    def __init__(self, calls: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = calls

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        if self.generate_calls >= self.calls:
            await _forever()
        return await super().generate(requests)


async def _forever() -> None:
    await asyncio.Event().wait()


def _ledger_balanced(ledger: dict[str, object], steps: int, groups_per_step: int) -> None:
    assert ledger["groups_trained"] == steps * groups_per_step
    assert settled_groups(ledger) == ledger["groups_dispatched"]


def test_a_generate_that_never_returns_fails_its_replica_over(tmp_path: Path) -> None:
    cfg = sim_config("rollout.num_samplers=2", "rollout.generate_timeout_s=0.3", "run.steps=6")
    program = make_program(cfg, tmp_path)
    program.backend.samplers[0] = HangsAfter(2, cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed)
    with pytest.warns(SamplerRetiredWarning):
        result = run_checked(program)
    _ledger_balanced(result.ledger.as_dict(), 6, cfg.rollout.groups_per_step)
    retired = json.loads((tmp_path / "run" / "summary.json").read_text())["samplers_retired"]
    assert [r["replica"] for r in retired] == [0]
    assert "sampler replica 0: generate did not return within 0.3s (rollout.generate_timeout_s)" in retired[0]["error"]


def test_a_weight_load_that_never_returns_fails_its_replica_over(tmp_path: Path) -> None:
    class LoadHangs(SimSampler):
        async def load_weights(self, weights: Weights) -> None:
            if weights.version >= 2:
                await _forever()
            await super().load_weights(weights)

    cfg = sim_config("rollout.num_samplers=2", "rollout.weight_load_timeout_s=0.3", "run.steps=6")
    program = make_program(cfg, tmp_path)
    program.backend.samplers[1] = LoadHangs(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=1)
    with pytest.warns(SamplerRetiredWarning):
        result = run_checked(program)
    _ledger_balanced(result.ledger.as_dict(), 6, cfg.rollout.groups_per_step)
    retired = json.loads((tmp_path / "run" / "summary.json").read_text())["samplers_retired"]
    assert [(r["replica"], r["during"]) for r in retired] == [(1, "load_weights")]
    assert "(rollout.weight_load_timeout_s)" in retired[0]["error"]


def test_a_trainer_call_that_never_returns_fails_the_run_naming_it(tmp_path: Path) -> None:
    cfg = sim_config("train.call_timeout_s=0.5", "run.steps=6")
    program = make_program(cfg, tmp_path)
    trainer = program.backend.trainer
    get_metrics = trainer.get_metrics

    async def hangs_at_step_2() -> dict[str, float]:
        metrics = await get_metrics()
        if metrics.get("step") == 2.0:
            await _forever()
        return metrics

    trainer.get_metrics = hangs_at_step_2  # type: ignore[method-assign]
    with pytest.raises(CallTimeoutError, match=r"trainer call get_metrics did not return within 0.5s \(train.call_timeout_s\)"):
        asyncio.run(asyncio.wait_for(program.run(), 30))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "get_metrics" in summary["error"]
    assert not [t for t in threading.enumerate() if t.name.startswith("relayrl-")]


def test_bounded_cancels_what_it_gives_up_on_and_abandons_only_what_ignores_cancellation() -> None:
    async def main() -> None:
        cancelled = asyncio.Event()

        async def polite() -> None:
            try:
                await _forever()
            finally:
                cancelled.set()

        with pytest.raises(CallTimeoutError, match="polite did not return within 0.05s"):
            await bounded(polite(), 0.05, "polite", "some.key")
        assert cancelled.is_set()

        release = threading.Event()

        async def stubborn() -> None:  # a call whose worker is stuck: cancellation cannot stop it
            while not release.is_set():
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    continue
            raise ValueError("ended late")

        with pytest.raises(CallTimeoutError):
            await bounded(stubborn(), 0.05, "stubborn", "some.key")
        release.set()
        await asyncio.sleep(0.05)  # it ends; its error is retrieved, not reported as lost
        assert await bounded(asyncio.sleep(0, result=7), 1.0, "quick", "some.key") == 7
        assert await bounded(asyncio.sleep(0, result=8), 0.0, "unbounded", "some.key") == 8
        assert asyncio.all_tasks() == {asyncio.current_task()}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(main())
        gc.collect()


# -- the stall watchdog (orchestrator.stall_timeout_s) ------------------------------------------


def test_a_stalled_run_writes_where_it_is_stuck_and_fails(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # no bound on generate here: only the watchdog can end this run
    cfg = sim_config("orchestrator.stall_timeout_s=1", "rollout.generate_timeout_s=0", "run.steps=6")
    program = make_program(cfg, tmp_path)
    program.backend.samplers[0] = HangsAfter(3, cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed)
    with pytest.raises(StallError, match=r"no step committed for \ds \(orchestrator.stall_timeout_s = 1\)"):
        asyncio.run(asyncio.wait_for(program.run(), 30))
    stall = (tmp_path / "run" / "stall.txt").read_text()
    assert "=== threads ===" in stall and "MainThread" in stall
    assert "=== asyncio tasks ===" in stall and "_forever" in stall  # the stuck await, by name
    assert "tasks are at:" in capfd.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "StallError" in summary["error"]
    assert not [t for t in threading.enumerate() if t.name.startswith("relayrl-")]


BLOCKED_LOOP = """
import sys, time
sys.path.insert(0, {tests!r})
from relayrl.telemetry.callbacks import Callback
from support.simutil import make_program, sim_config
from pathlib import Path
import asyncio

class Blocks(Callback):
    def on_step_begin(self, step):
        if step == 2:
            time.sleep(600)  # blocks the event loop itself

cfg = sim_config("orchestrator.stall_timeout_s=1", "orchestrator.stop_grace_s=1")
asyncio.run(make_program(cfg, Path({tmp!r}), [Blocks()]).run())
"""


def test_a_stall_that_blocks_the_event_loop_ends_the_process(tmp_path: Path) -> None:
    script = BLOCKED_LOOP.format(tests=str(Path(__file__).parents[1]), tmp=str(tmp_path))
    res = run_python("-c", script, timeout=60)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "the event loop is blocked" in res.stderr
    stall = (tmp_path / "run" / "stall.txt").read_text()
    assert "in on_step_begin" in stall  # the loop thread's stack shows what blocks it (the callback)
