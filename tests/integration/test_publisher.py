"""The weight publisher (relayrl.orchestrator.publisher): every way weights reach a sampler goes
through it. A resume's first load is bounded and failed over like any sync round's; a restarted
replica gets the current version from the publisher (the sampler never holds the trainer), and the
trainer is asked for a version's weights once."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from relayrl.backends.protocols import PendingExport
from relayrl.backends.sim.workers import SimSampler, SimTrainer
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.deadlines import BoundedTrainer, CallTimeoutError
from relayrl.orchestrator.publisher import WeightPublisher
from relayrl.orchestrator.replicas import ReplicaPool, SamplerRestartedWarning, SamplerRetiredWarning
from relayrl.orchestrator.stages.sync import sync_stage
from relayrl.telemetry.tracer import Tracer
from relayrl.types import GenerateResult, SampleRequest, Weights
from support.simutil import StopAt, Stopped, make_program, run_checked, sim_config

HANGS = "sampler replica 0: load_weights did not return within 0.3s (rollout.weight_load_timeout_s)"


class FirstLoadHangs(SimSampler):
    """A sim sampler whose first `load_weights` never returns (until it is cancelled)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loads = 0
        self.cancelled = False

    async def load_weights(self, weights: Weights) -> None:
        self.loads += 1
        if self.loads == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        await super().load_weights(weights)


def _stopped_run(tmp_path: Path, *sets: str) -> Any:
    """A run with two replicas, stopped at the end of step 5 (steps are numbered from 1; the
    newest checkpoint is step 4's, next step 5); returns its config."""
    cfg = sim_config(
        "rollout.num_samplers=2",
        "rollout.weight_load_timeout_s=0.3",
        "run.steps=6",
        "orchestrator.checkpoint_every=2",
        *sets,
    )
    with pytest.raises(Stopped):
        asyncio.run(asyncio.wait_for(make_program(cfg, tmp_path, [StopAt(5)]).run(), 60))
    return cfg


def test_a_sampler_that_hangs_in_its_first_load_after_a_resume_is_failed_over_within_the_timeout(tmp_path: Path) -> None:
    cfg = _stopped_run(tmp_path)
    program = build_program(cfg, run_dir=tmp_path / "run", resume=True)
    assert program.start_step == 4  # steps 1-4 done
    hangs = FirstLoadHangs(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=0)
    program.backend.samplers[0] = hangs
    with pytest.warns(SamplerRetiredWarning, match="replica 0 retired after load_weights"):
        result = run_checked(program, timeout=30.0)  # without a bound the resume would hang here
    assert hangs.loads == 1 and hangs.cancelled  # the resume's load was given up on and cancelled
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 6
    assert [(r["replica"], r["during"]) for r in summary["samplers_retired"]] == [(0, "load_weights")]
    assert HANGS in summary["samplers_retired"][0]["error"]
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == 6 * cfg.rollout.groups_per_step  # steps 4 and 5 on replica 1 alone
    failed = [e for e in result.tracer.events if e.get("name") == "load_weights_failed"]
    assert [(e["cat"], cast(dict[str, object], e["args"])["version"]) for e in failed] == [("sampler/0", 4)], failed


def test_without_failover_a_resume_whose_load_hangs_fails_naming_the_replica(tmp_path: Path) -> None:
    cfg = _stopped_run(tmp_path, "rollout.sampler_failover=false")
    program = build_program(cfg, run_dir=tmp_path / "run", resume=True)
    program.backend.samplers[0] = FirstLoadHangs(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=0)
    with pytest.raises(CallTimeoutError, match=r"^sampler replica 0: load_weights did not return within 0\.3s"):
        asyncio.run(asyncio.wait_for(program.run(), 30))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and HANGS in summary["error"]


class WorkerDied(RuntimeError):
    pass


class DiesOnce(SimSampler):
    """A restartable sim sampler (as the Ray backend's `RaySampler` is): its worker "dies" in its
    third generate call; `restart()` only brings it back, holding no weights, and it refuses to
    sample until weights are loaded into it. Every call is logged in `events`."""

    def __init__(self, events: list[tuple[str, int]], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events = events
        self.died = False
        self.needs_weights = False

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        if self.needs_weights:
            raise RuntimeError("sampled before the current weights were loaded into the restarted worker")
        if self.generate_calls == 2 and not self.died:
            self.died = True
            self.needs_weights = True
            raise WorkerDied("the worker's process died")
        return await super().generate(requests)

    def restartable(self, exc: BaseException) -> bool:
        return isinstance(exc, WorkerDied)

    async def restart(self) -> None:
        self.events.append(("restart", -1))
        self._version = -1  # a fresh worker: no weights

    async def load_weights(self, weights: Weights) -> None:
        self.events.append(("load", weights.version))
        await super().load_weights(weights)
        self.needs_weights = False


def test_a_restarted_sampler_gets_the_current_version_from_the_publisher(tmp_path: Path) -> None:
    cfg = sim_config("rollout.num_samplers=2", "run.steps=8", "sim.generate_per_request=0.01")
    program = make_program(cfg, tmp_path)
    events: list[tuple[str, int]] = []
    program.backend.samplers[0] = DiesOnce(events, cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=0)
    trainer = program.backend.trainer
    export_weights = trainer.export_weights

    async def logged_export() -> Weights:
        weights = await export_weights()
        events.append(("export", weights.version))
        return weights

    trainer.export_weights = logged_export  # type: ignore[method-assign]
    with pytest.warns(SamplerRestartedWarning, match="replica 0 restarted"):
        result = run_checked(program)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["samplers_retired"] == []
    [restarted] = summary["samplers_restarted"]
    at = events.index(("restart", -1))
    after = events[at + 1 :]
    # right after the restart, the publisher loads the newest version exported (or, before any
    # round, exports the current one): the trainer is asked at most once for it
    loaded = next(v for kind, v in after if kind == "load")
    exported_before = [v for kind, v in events[:at] if kind == "export"]
    between = [e for e in after[: after.index(("load", loaded))] if e[0] == "export"]
    current = max(exported_before, default=0)
    assert loaded == max([current, *(v for _, v in between)])
    assert len(between) <= (0 if exported_before else 1)
    assert restarted["replica"] == 0 and restarted["version"] >= loaded
    exports = [v for kind, v in events if kind == "export"]
    assert len(exports) == len(set(exports))  # each version's weights were fetched from the trainer once
    assert result.ledger.as_dict()["groups_trained"] == cfg.run.steps * cfg.rollout.groups_per_step


def test_sync_stage_takes_keyword_only_settings() -> None:
    params = inspect.signature(sync_stage).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)


class LoadsWhenLetGo(SimSampler):
    """A restartable sim sampler whose first load waits for `gate`."""

    def __init__(self, gate: asyncio.Event, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.loaded: list[int] = []

    def restartable(self, exc: BaseException) -> bool:
        return True

    async def restart(self) -> None:
        return None

    async def load_weights(self, weights: Weights) -> None:
        self.loaded.append(weights.version)
        if len(self.loaded) == 1:
            await self.gate.wait()
        await super().load_weights(weights)


def test_a_restart_overtaken_by_a_newer_round_loads_that_round_s_version_before_it_serves() -> None:
    """A round for version 1 starts while the publisher loads version 0 into a restarting replica:
    the round skips it, and the restart ends only once the replica holds version 1."""

    async def main() -> None:
        cfg = sim_config()
        trainer = SimTrainer(cfg.sim)
        gate = asyncio.Event()
        sampler = LoadsWhenLetGo(gate, cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed)
        pool = ReplicaPool.of([sampler], failover=True)
        publisher = WeightPublisher(trainer, pool, Tracer(None, {}), load_timeout_s=5.0)
        [slot] = pool.slots
        restarting = asyncio.create_task(publisher.restart(slot, RuntimeError("died"), "generate"))
        while not sampler.loaded:
            await asyncio.sleep(0)
        trainer.version = 1  # a commit while the restarted replica loads version 0
        assert (await publisher.publish_newest()).version == 1
        assert sampler.loaded == [0] and pool.target == 1  # the round skipped the restarting replica
        gate.set()
        assert await restarting is None
        assert sampler.loaded == [0, 1] and slot.version == 1 and not slot.restarting
        assert [(r["replica"], r["version"]) for r in pool.restarted] == [(0, 1)]

    with pytest.warns(SamplerRestartedWarning, match="it loaded version 1"):
        asyncio.run(main())


class ExportsAhead(SimTrainer):
    """A trainer whose export the samplers wait for themselves (`export_ahead`): it returns at once
    with weights of its committed version whose payload is a future the export fills, version
    `exported` (a commit may land before the export runs), once `gate` is set; or fails with `error`."""

    def __init__(self, cfg: Any, gate: asyncio.Event, exported: int, error: Exception | None = None) -> None:
        super().__init__(cfg)
        self.gate, self.exported, self.error = gate, exported, error

    async def export_ahead(self) -> PendingExport:
        payload: asyncio.Future[Weights] = asyncio.get_running_loop().create_future()

        async def done() -> Weights:
            await self.gate.wait()
            if self.error is not None:
                payload.set_exception(RuntimeError(f"the samplers' copy of: {self.error}"))  # as each Ray process gets its own
                raise self.error
            weights = Weights(self.exported, payload=self.exported)
            payload.set_result(weights)
            return weights

        return PendingExport(Weights(self.version, payload), done())


class WaitsForTheExport(SimSampler):
    """Records whether its load started before the export ended, then waits for it and loads it."""

    def __init__(self, gate: asyncio.Event, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.started_before_export: list[bool] = []

    async def load_weights(self, weights: Weights) -> None:
        self.started_before_export.append(not self.gate.is_set())
        await super().load_weights(await cast(asyncio.Future[Weights], weights.payload))


def _ahead(
    error: Exception | None = None, seconds: float = 0.0
) -> tuple[WeightPublisher, ReplicaPool, list[WaitsForTheExport], asyncio.Event]:
    cfg = sim_config()
    gate = asyncio.Event()
    trainer = ExportsAhead(cfg.sim, gate, exported=2, error=error)
    trainer.version = 1
    samplers = [WaitsForTheExport(gate, cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=i) for i in range(2)]
    pool = ReplicaPool.of(samplers, failover=True)
    bounded = BoundedTrainer(trainer, seconds) if seconds else trainer
    return WeightPublisher(bounded, pool, Tracer(None, {}), load_timeout_s=30.0), pool, samplers, gate


def test_loads_start_before_an_export_ahead_ends_and_hold_the_version_it_exported() -> None:
    async def main() -> None:
        publisher, pool, samplers, gate = _ahead()
        round_ = asyncio.create_task(publisher.publish_newest())
        while not all(s.started_before_export for s in samplers):
            await asyncio.sleep(0)
        gate.set()
        weights = await round_
        assert weights.version == 2 and pool.target == 2  # a commit landed before the export ran: its version
        assert [s.started_before_export for s in samplers] == [[True], [True]]
        assert [slot.version for slot in pool.slots] == [2, 2]
        assert pool.retired == []

    asyncio.run(main())


def test_an_export_ahead_that_fails_fails_the_round_with_its_error_and_retires_no_replica() -> None:
    async def main() -> None:
        publisher, pool, samplers, gate = _ahead(error=RuntimeError("the export broke"))
        gate.set()
        with pytest.raises(RuntimeError, match="the export broke"):
            await publisher.publish_newest()
        assert pool.retired == [] and len(pool.slots) == 2 and [slot.version for slot in pool.slots] == [0, 0]

    asyncio.run(main())


def test_an_export_ahead_past_train_call_timeout_s_fails_at_its_bound_and_cancels_the_loads() -> None:
    async def main() -> None:
        publisher, pool, samplers, _ = _ahead(seconds=0.2)  # the export never ends; the loads wait 30 s
        with pytest.raises(CallTimeoutError, match="trainer call export_weights"):
            await asyncio.wait_for(publisher.publish_newest(), 5.0)
        assert pool.retired == [] and [s.started_before_export for s in samplers] == [[True], [True]]

    asyncio.run(main())


def test_a_slow_export_ahead_does_not_count_against_the_load_bound() -> None:
    async def main() -> None:
        publisher, pool, samplers, gate = _ahead()
        publisher._load_timeout_s = 0.2  # the export below takes 0.5 s; each load itself is instant

        async def let_go() -> None:
            await asyncio.sleep(0.5)
            gate.set()

        releasing = asyncio.create_task(let_go())
        assert (await publisher.publish_newest()).version == 2
        await releasing
        assert pool.retired == [] and [slot.version for slot in pool.slots] == [2, 2]

    asyncio.run(main())


class RestartsAtOnce(WaitsForTheExport):
    def restartable(self, exc: BaseException) -> bool:
        return True

    async def restart(self) -> None:
        return None

    async def load_weights(self, weights: Weights) -> None:
        if isinstance(weights.payload, asyncio.Future):
            await super().load_weights(weights)
        else:
            await SimSampler.load_weights(self, weights)


def test_a_replica_whose_restart_ends_during_an_export_ahead_loads_that_version_too() -> None:
    """Its restart loaded the newest version exported before the round's (the round skipped it, as
    it was restarting): the round loads the new one into it before the window learns it."""

    async def main() -> None:
        cfg = sim_config()
        gate = asyncio.Event()
        trainer = ExportsAhead(cfg.sim, gate, exported=1)
        trainer.version = 1
        samplers = [RestartsAtOnce(gate, cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=i) for i in range(2)]
        pool = ReplicaPool.of(samplers, failover=True)
        publisher = WeightPublisher(trainer, pool, Tracer(None, {}), load_timeout_s=30.0)
        gate.set()
        assert (await publisher.publish_newest()).version == 1
        gate.clear()
        trainer.version = trainer.exported = 2
        restarting = asyncio.create_task(publisher.restart(pool.slots[1], RuntimeError("died"), "generate"))
        await asyncio.sleep(0)  # replica 1 is restarting: the round leaves it out
        round_ = asyncio.create_task(publisher.publish_newest())
        assert await restarting is None and pool.slots[1].version == 1  # restarted on the newest export so far
        gate.set()
        assert (await round_).version == 2
        assert [slot.version for slot in pool.slots] == [2, 2]

    with pytest.warns(SamplerRestartedWarning):
        asyncio.run(main())
