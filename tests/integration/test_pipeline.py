"""Pipeline behaviour on the sim backend: errors, failing rewards, staleness, filtering, ledger."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from relayrl.backends.sim import SimSampler
from relayrl.rewards import registry as rewards
from relayrl.telemetry.trajlog import read_trajectories
from relayrl.types import GenerateResult, SampleRequest, Trajectory
from support.simutil import make_program, run_checked, settled_groups, sim_config, trace_spans


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _trajectories(run_dir: Path) -> list[dict[str, Any]]:
    return read_trajectories(run_dir).to_pylist()


def test_run_writes_run_directory_with_required_metrics(tmp_path: Path) -> None:
    result = run_checked(make_program(sim_config(), tmp_path))
    run = tmp_path / "run"
    for name in ("config.toml", "metrics.jsonl", "trace.json", "summary.json", "trajectories"):
        assert (run / name).exists(), name
    rows = _lines(run / "metrics.jsonl")
    # steps are numbered from 1 wherever a user sees one: step N's commit makes version N, and the
    # default settings checkpoint after the last step, as checkpoints/step-N
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert sorted({t["step"] for t in _trajectories(run)}) == [1, 2, 3, 4]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000004"]
    assert [f.name for f in (run / "trajectories").iterdir()] == ["steps-000001-000004.parquet"]
    required = {
        "step",
        "policy_version",
        "step_time_sec",
        "metrics_fetch_time",
        "boundary_gap_sec",
        "exposed_generation_time",
        "weight_sync_time",
        "packing_time",
        "reward_mean",
        "reward_std",
        "num_trajectories",
        "filtered_groups",
        "staleness_mean",
        "staleness_max",
        "loop_lag_max_ms",
    }
    assert required <= rows[0].keys()
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["num_trajectories"] == 16 for r in rows)
    assert len(_trajectories(run)) == 64
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger"]["groups_trained"] == 16
    assert (result.results[0].metrics["reward_std"] or 0) > 0  # synthetic rewards have variance


def test_a_failing_sampler_cancels_everything_and_propagates(tmp_path: Path) -> None:
    class Broken(SimSampler):
        async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
            if self.generate_calls >= 3:
                raise ConnectionError("sampler replica 0 died")
            return await super().generate(requests)

    cfg = sim_config("run.steps=10", "sim.train_step=0.01", "sim.reduce_metrics=0.02")
    program = make_program(cfg, tmp_path)
    program.backend.samplers[0] = Broken(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed)

    async def main() -> None:
        with pytest.raises(ConnectionError, match="replica 0 died"):
            await asyncio.wait_for(program.run(), 30)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name.startswith("relayrl-")]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "ConnectionError" in summary["error"]


def test_raising_reward_function_marks_trajectory_failed_and_counts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def flaky(t: Trajectory) -> float:
        if t.sample_index == 0:
            raise KeyError("no answer field")
        return 1.0

    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "flaky", flaky)
    result = run_checked(make_program(sim_config('task.reward_functions=["flaky"]'), tmp_path))
    rows = _trajectories(tmp_path / "run")
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(failed) == 16 and all(r["reward"] == 0.0 and "KeyError" in str(r["error"]) for r in failed)
    assert all(r["reward"] == 1.0 for r in rows if r["status"] == "ok")
    assert result.ledger.reward_errors["flaky"] >= 16
    assert all(r.metrics["failed_trajectories"] == 4 for r in result.results)


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_staleness_never_exceeds_the_window(tmp_path: Path, max_staleness: int) -> None:
    cfg = sim_config("run.steps=6", f"rollout.max_staleness={max_staleness}", "sim.train_step=0.02")
    result = run_checked(make_program(cfg, tmp_path))
    worst = max(int(r.metrics["staleness_max"]) for r in result.results)  # type: ignore[arg-type]
    assert worst <= max_staleness
    if max_staleness:
        assert worst > 0  # generation ran ahead of training: the window was used
    # dispatch never ran further ahead than the window allows
    assert result.ledger.groups_dispatched <= cfg.run.steps * cfg.rollout.groups_per_step + max_staleness * cfg.rollout.groups_per_step


def test_dynamic_sampling_filters_zero_variance_groups_and_the_ledger_balances(tmp_path: Path) -> None:
    cfg = sim_config("run.steps=5", "algorithm.dynamic_sampling=true", "sim.base_success=0.85", "sim.learn_rate=0.0")
    result = run_checked(make_program(cfg, tmp_path))
    ledger = result.ledger.as_dict()
    filtered = cast(dict[str, int], ledger["groups_filtered"])["zero_variance"]
    assert filtered > 0
    assert sum(int(r.metrics["filtered_groups"] or 0) for r in result.results) <= filtered
    assert ledger["groups_trained"] == 20
    assert settled_groups(ledger) == ledger["groups_dispatched"]
    rows = _trajectories(tmp_path / "run")
    assert any(r["status"] == "filtered:zero_variance" for r in rows)
    for r in result.results:  # every trained group had reward variance
        assert float(r.metrics["reward_std"]) > 0  # type: ignore[arg-type]


def test_several_sampler_replicas_all_contribute(tmp_path: Path) -> None:
    cfg = sim_config("rollout.num_samplers=3", "sim.generate_per_request=0.01", "run.steps=4")
    result = run_checked(make_program(cfg, tmp_path))
    replicas = {r["replica"] for r in _trajectories(tmp_path / "run")}
    assert replicas == {0, 1, 2}
    lanes = {s.lane for s in trace_spans(result)}
    assert {"sampler/0", "sampler/1", "sampler/2"} <= lanes


class _DiesOnCall(SimSampler):
    """A replica whose `fail_on` call (generate, or load_weights) raises."""

    def __init__(self, cfg: object, max_new_tokens: int, seed: int, replica: int, fail_on: str, after: int) -> None:
        super().__init__(cfg, max_new_tokens, seed, replica)  # type: ignore[arg-type]
        self.name, self.fail_on, self.after, self.loads = replica, fail_on, after, 0

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        if self.fail_on == "generate" and self.generate_calls >= self.after:
            raise ConnectionError(f"replica {self.name} lost its device")
        return await super().generate(requests)

    async def load_weights(self, weights: object) -> None:
        self.loads += 1
        if self.fail_on == "load_weights" and self.loads > self.after:
            raise MemoryError(f"replica {self.name} out of memory loading weights")
        await super().load_weights(weights)  # type: ignore[arg-type]


@pytest.mark.parametrize("fail_on", ["generate", "load_weights"])
def test_a_failed_sampler_replica_is_retired_and_nothing_is_lost(tmp_path: Path, fail_on: str) -> None:
    cfg = sim_config("rollout.num_samplers=3", "sim.generate_per_request=0.01", "run.steps=6")
    program = make_program(cfg, tmp_path)
    program.backend.samplers[1] = _DiesOnCall(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, 1, fail_on, after=2)
    with pytest.warns(Warning, match="sampler replica 1 retired after " + fail_on):
        result = run_checked(program)
    summary = result.summary
    assert summary["status"] == "completed"
    assert [r["replica"] for r in cast(list[dict[str, object]], summary["samplers_retired"])] == [1]
    assert summary["ledger"]["groups_trained"] == 6 * cfg.rollout.groups_per_step  # type: ignore[index]
    trajs = _trajectories(tmp_path / "run")
    assert len({r["group_id"] for r in trajs}) == len(trajs) // cfg.rollout.num_generations  # no group sampled twice
    spans = trace_spans(result)
    if fail_on == "generate":
        failed = [s for s in spans if s.name == "generate_failed"]
        assert [s.lane for s in failed] == ["sampler/1"]
        assert not [s for s in spans if s.lane == "sampler/1" and s.name == "generate" and s.start > failed[0].end]


def test_without_failover_or_replicas_left_a_sampler_failure_fails_the_run(tmp_path: Path) -> None:
    cfg = sim_config("rollout.num_samplers=2", "rollout.sampler_failover=false", "run.steps=6")
    program = make_program(cfg, tmp_path)
    program.backend.samplers[0] = _DiesOnCall(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, 0, "generate", after=1)
    with pytest.raises(ConnectionError, match="replica 0 lost its device"):
        asyncio.run(asyncio.wait_for(program.run(), 30))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["samplers_retired"][0]["replica"] == 0


def test_configured_sinks_receive_metrics_and_a_failing_sink_does_not_stop_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.telemetry import sinks

    class Broken:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def log(self, step: int, metrics: object) -> None:
            raise OSError("No space left on device")

        def close(self) -> None:
            return None

    monkeypatch.setattr(sinks, "TensorBoardSink", Broken)
    cfg = sim_config('telemetry.sinks=["mlflow", "tensorboard"]')
    with pytest.warns(sinks.SinkDisabledWarning, match="tensorboard.*No space left"):
        result = run_checked(make_program(cfg, tmp_path))
    run = tmp_path / "run"
    assert len(_lines(run / "metrics.jsonl")) == 4  # never lost
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{run / 'mlruns'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "relayrl"]
    [mlrun] = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(mlrun.info.run_id, "reward_mean")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert [m.value for m in history] == pytest.approx([r.metrics["reward_mean"] for r in result.results])


def test_requests_that_fail_on_two_replicas_fail_the_run_instead_of_retiring_them_all(tmp_path: Path) -> None:
    class PoisonGroup(SimSampler):
        async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
            if any(r.group_id == 5 for r in requests):
                raise ValueError("token id out of range")
            return await super().generate(requests)

    cfg = sim_config("rollout.num_samplers=3", "run.steps=4")
    program = make_program(cfg, tmp_path)
    program.backend.samplers[:] = [PoisonGroup(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=i) for i in range(3)]
    with pytest.warns(Warning, match="retired after generate"):
        with pytest.raises(RuntimeError, match=r"failed on group\(s\) \[(\d+, )*5(, \d+)*\], which already failed on another replica"):
            asyncio.run(asyncio.wait_for(program.run(), 30))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["samplers_retired"]) == 2  # the second failure stopped the run, not a third retirement


def test_a_replica_is_retired_once_however_often_it_fails() -> None:
    from relayrl.orchestrator.replicas import ReplicaPool

    pool = ReplicaPool.of([SimSampler(sim_config().sim, 4, 0, replica=i) for i in range(2)], failover=True)
    a, b = pool.slots
    assert (a.replica, b.replica) == (0, 1)
    with pytest.warns(Warning):
        pool.retire(a, MemoryError("load"), "load_weights")
    pool.retire(a, ConnectionError("gen"), "generate", [1])  # already retired: no second record or warning
    assert [r["replica"] for r in pool.retired] == [0] and pool.alive == [b]
    with pytest.raises(ConnectionError):
        pool.retire(b, ConnectionError("last"), "generate", [2])


def test_a_steps_record_has_the_weight_syncs_that_ended_since_the_last_commit(tmp_path: Path) -> None:
    # the run's commit-time figures reach the record through the train loop's commit
    # (StepHooks.commit_figures), the record's one writer: each step's weight_sync_time is the
    # time of the sync rounds that ended between the previous step's commit and its own
    result = run_checked(make_program(sim_config("run.steps=6", "sim.weight_sync=0.005", "sim.train_step=0.002"), tmp_path))
    spans = trace_spans(result)
    commits = [s.end for s in spans if s.name == "optim_step"]
    syncs = [s for s in spans if s.name == "weight_sync"]
    rows = _lines(tmp_path / "run" / "metrics.jsonl")
    assert len(commits) == len(rows) == 6
    for step, (row, commit) in enumerate(zip(rows, commits)):
        since = commits[step - 1] if step else float("-inf")
        expected = sum(s.dur for s in syncs if since < s.end <= commit)
        assert row["weight_sync_time"] == pytest.approx(expected, abs=1e-4), step
    assert sum(float(r["weight_sync_time"]) for r in rows) > 0


@pytest.mark.parametrize(("ms", "during"), [(1.0, 0.001), (0.0, 0.004)])
def test_the_run_sets_the_switch_interval_while_it_runs_and_restores_it(tmp_path: Path, ms: float, during: float) -> None:
    import sys

    from relayrl.telemetry.callbacks import Callback

    class Seen(Callback):
        def __init__(self) -> None:
            self.intervals: list[float] = []

        def on_step_end(self, step: int, result: object) -> None:
            self.intervals.append(sys.getswitchinterval())

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        seen = Seen()
        run_checked(make_program(sim_config("run.steps=2", f"orchestrator.switch_interval_ms={ms}"), tmp_path, [seen]))
        assert seen.intervals == [pytest.approx(during)] * 2
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)
