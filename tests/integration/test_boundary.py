"""The step-boundary rules (docs/design.md rules 1–10), pinned on sim runs."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import cast

import pytest

from relayrl.backends.sim.workers import SimTrainer
from relayrl.telemetry.callbacks import Callback
from relayrl.types import StepResult
from support.simutil import find, make_program, run_checked, sim_config, trace_spans


def test_next_train_step_issued_while_fetch_outstanding_and_fetch_lands_before_next_optim(tmp_path: Path) -> None:
    cfg = sim_config("sim.get_metrics=0.15", "sim.train_step=0.05", "sim.optim_step=0.01")
    result = run_checked(make_program(cfg, tmp_path))
    s = trace_spans(result)
    for n in range(1, cfg.run.steps):  # steps are numbered from 1
        fetch = find(s, "get_metrics", n)
        mb0_next = find(s, "train_step", n + 1, microbatch=0)
        optim_next = find(s, "optim_step", n + 1)
        assert fetch.start >= find(s, "optim_step", n).end
        assert mb0_next.start < fetch.end, "mb0(N+1) waited for get_metrics(N)"  # rule 1
        assert fetch.end <= optim_next.start  # rule 2


def test_on_step_end_runs_after_next_first_train_step_on_a_worker_thread(tmp_path: Path) -> None:
    seen: list[tuple[int, str, list[tuple[str, int]]]] = []
    cfg = sim_config("sim.train_step=0.02")
    program = make_program(cfg, tmp_path)

    class Spy(Callback):
        def on_step_end(self, step: int, result: StepResult) -> None:
            trainer = program.backend.trainer
            seen.append((step, threading.current_thread().name, list(trainer.calls)))  # type: ignore[attr-defined]

    program.bookkeeper._callbacks.append(Spy())
    run_checked(program)
    assert [step for step, _, _ in seen] == list(range(1, cfg.run.steps + 1))
    for step, thread, calls in seen:
        assert thread != threading.main_thread().name and thread.startswith("relayrl-bookkeeping")
        if step < cfg.run.steps:
            # the trainer had already been handed step N+1's first micro-batch (trained from version N)
            assert ("train_step", step) in calls


def test_raising_on_step_end_fails_the_run_and_leaves_nothing_running(tmp_path: Path) -> None:
    class Boom(Callback):
        def on_step_end(self, step: int, result: StepResult) -> None:
            if step == 1:
                raise ValueError("callback exploded at step 1")

    program = make_program(sim_config("run.steps=6"), tmp_path, [Boom()])

    async def main() -> None:
        with pytest.raises(ValueError, match="callback exploded"):
            await asyncio.wait_for(program.run(), 30)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name.startswith("relayrl-")]
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"status": "failed"' in summary and "callback exploded" in summary


def test_metric_reduction_runs_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import relayrl.telemetry.stepbook as stepbook

    threads: list[str] = []
    original = stepbook.reduce_step

    def spy(record):
        threads.append(threading.current_thread().name)
        return original(record)

    monkeypatch.setattr(stepbook, "reduce_step", spy)
    run_checked(make_program(sim_config(), tmp_path))
    assert len(threads) == 4
    assert all(name != threading.main_thread().name for name in threads)


def test_single_microbatch_steps_do_not_deadlock(tmp_path: Path) -> None:
    cfg = sim_config("train.rows_per_microbatch=100", "train.row_tokens=512", "sim.get_metrics=0.02")
    result = run_checked(make_program(cfg, tmp_path), timeout=20)
    s = trace_spans(result)
    assert all(sp.args.get("final") for sp in s if sp.name == "train_step")  # each step: one, final mb
    assert len(result.results) == cfg.run.steps


def test_cancellation_mid_step_leaves_no_task_or_thread(tmp_path: Path) -> None:
    cfg = sim_config("run.steps=50", "sim.train_step=0.02", "sim.reduce_metrics=0.05", "sim.pack_per_microbatch=0.01")
    program = make_program(cfg, tmp_path)

    async def main() -> None:
        task = asyncio.create_task(program.run())
        trainer = program.backend.trainer
        assert isinstance(trainer, SimTrainer)
        while sum(1 for c in trainer.calls if c[0] == "optim_step") < 2:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.03)  # mid-step: bookkeeping of the previous step is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name.startswith("relayrl-")]
    assert '"status": "cancelled"' in (tmp_path / "run" / "summary.json").read_text()


def test_step_time_taken_at_commit_and_fetch_time_reported_separately(tmp_path: Path) -> None:
    cfg = sim_config("sim.get_metrics=0.1", "sim.train_step=0.06", "sim.optim_step=0.01")
    result = run_checked(make_program(cfg, tmp_path))
    s = trace_spans(result)
    for n in range(2, cfg.run.steps + 1):
        m = cast(dict[str, float], result.results[n - 1].metrics)  # every one of these is set on a completed step
        commit_gap = find(s, "optim_step", n).end - find(s, "optim_step", n - 1).end
        assert m["step_time_sec"] == pytest.approx(commit_gap, abs=2e-3)
        assert m["metrics_fetch_time"] >= 0.1
        # the fetch overlapped the next step's training: it is not inside the step time
        assert m["step_time_sec"] < m["train_time"] + m["metrics_fetch_time"]


def test_next_step_first_microbatch_is_packed_while_final_one_trains(tmp_path: Path) -> None:
    cfg = sim_config("sim.pack_per_microbatch=0.03", "sim.train_step=0.06", "sim.generate_per_request=0.001")
    result = run_checked(make_program(cfg, tmp_path))
    s = trace_spans(result)
    gaps = [r.metrics["boundary_gap_sec"] for r in result.results[1:]]
    for n in range(1, cfg.run.steps):  # steps are numbered from 1
        pack0 = find(s, "pack", n + 1, microbatch=0)
        assert pack0.end <= find(s, "optim_step", n).start  # rule 9: packed before the commit
    assert max(g for g in gaps if g is not None) < 0.03  # never paid a pack at the boundary


def test_next_step_is_packed_when_its_groups_arrive_during_the_final_microbatch(tmp_path: Path) -> None:
    """One micro-batch per step, and generation shorter than training but not done when that
    micro-batch is issued: N+1 is taken and packed the moment its groups land, inside N's
    training, so the boundary pays neither the wait nor the pack."""
    cfg = sim_config(
        "run.steps=5",
        "train.rows_per_microbatch=100",
        "sim.train_step=0.2",
        "sim.generate_per_request=0.025",
        "sim.pack_per_microbatch=0.03",
    )
    result = run_checked(make_program(cfg, tmp_path))
    s = trace_spans(result)
    late = 0
    for n in range(2, cfg.run.steps):
        train = find(s, "train_step", n, microbatch=0)
        assert train.args["final"]
        pack0 = find(s, "pack", n + 1, microbatch=0)
        late += pack0.start >= train.start + 0.04  # the groups were not there when it was issued
        assert pack0.end <= find(s, "optim_step", n).start  # ... and still packed before the commit
    assert late >= 1  # the case this test is about happened
    gaps = [r.metrics["boundary_gap_sec"] for r in result.results[2:]]
    assert max(g for g in gaps if g is not None) < 0.03
    assert all(r.metrics["exposed_generation_time"] == 0.0 for r in result.results[2:])


def test_inline_baseline_pays_the_boundary_on_the_event_loop(tmp_path: Path) -> None:
    cfg = sim_config("orchestrator.overlap_bookkeeping=false", "sim.get_metrics=0.05", "sim.reduce_metrics=0.03")
    result = run_checked(make_program(cfg, tmp_path))
    s = trace_spans(result)
    for n in range(1, cfg.run.steps):  # steps are numbered from 1
        assert find(s, "train_step", n + 1, microbatch=0).start >= find(s, "get_metrics", n).end
        assert find(s, "reduce_metrics", n).args["thread"] == threading.main_thread().name
    gaps = [r.metrics["boundary_gap_sec"] for r in result.results[1:]]
    assert min(g for g in gaps if g is not None) >= 0.08  # fetch + reduction at least
    lag = max(float(r.metrics["loop_lag_max_ms"] or 0) for r in result.results)
    assert lag >= 25  # 30 ms of reduction on the loop shows as loop lag
