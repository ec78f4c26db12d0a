"""Checkpoints and resume: a run killed with SIGKILL resumes from its newest checkpoint and ends
as if it had never stopped — every step trained once, every prompt trained once, the ledger
balanced, the trace rules holding; the trainer's state round-trips exactly; bad resumes are named."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest
import torch

from relayrl.analysis.checker import check_run_dir
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.window import DispatchWindow
from relayrl.rundir.checkpoint import CHECKPOINTS, CheckpointError, PromptSource, complete_checkpoints
from relayrl.rundir.trajfiles import log_files
from relayrl.types import Drawn, FilterReason, Group, Prompt
from support.cli import child_env, relayrl, relayrl_argv
from support.simutil import StopAt, Stopped, run_checked, sim_config

STEPS = 30
GROUPS_PER_STEP = 4
SIM_RUN = [
    "run.backend=sim",
    f"run.steps={STEPS}",
    "rollout.num_generations=4",
    f"rollout.groups_per_step={GROUPS_PER_STEP}",
    "rollout.prompts_per_request=2",
    "train.row_tokens=64",
    "train.rows_per_microbatch=2",
    "train.share_prompt=false",
    "sim.train_step=0.02",
    "sim.generate_per_request=0.005",
    "orchestrator.checkpoint_every=4",
    "orchestrator.keep_checkpoints=2",
]


def _cli(*args: str) -> list[str]:
    return relayrl_argv("train", *args)


def _env() -> dict[str, str]:
    return child_env({"PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_kill_9_then_resume_trains_every_step_and_prompt_once(tmp_path: Path) -> None:
    sets = [f"--set={s}" for s in [*SIM_RUN, f"run.output_dir={tmp_path}", "run.name=killed"]]
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(_cli(*sets), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / CHECKPOINTS / "step-000008").exists():  # two checkpoints in
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "no checkpoint within 60 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    logged = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(logged) < STEPS  # really interrupted (the last line may be torn)

    resumed = relayrl("train", "--resume", str(run_dir), timeout=120)
    assert resumed.returncode == 0, resumed.stderr

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["steps_completed"] == STEPS
    done = summary["resumed_from_step"]
    assert 8 <= done < STEPS
    assert f"resuming after step {done} (next: step {done + 1} of {STEPS})" in resumed.stdout
    # every step once, in order
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # steps are numbered from 1
    # every trained prompt once; the prompts handed out are a prefix of the stream: none lost
    trajs = pd.read_parquet(run_dir / "trajectories")
    assert sorted(set(trajs["step"])) == list(range(1, STEPS + 1))
    _assert_each_step_logged_once(run_dir, trajs, rows)
    trained = trajs[trajs["status"] == "ok"]
    steps_of: dict[str, set[int]] = defaultdict(set)
    for prompt_id, step in zip(trained["prompt_id"], trained["step"]):
        steps_of[prompt_id].add(int(step))
    assert all(len(s) == 1 for s in steps_of.values())
    assert len(steps_of) == STEPS * GROUPS_PER_STEP
    seen = {int(p.rsplit("-", 1)[1]) for p in trajs["prompt_id"]}  # "arith-train-<stream index>"
    assert seen == set(range(len(seen)))
    ledger = summary["ledger"]
    assert ledger["groups_trained"] == STEPS * GROUPS_PER_STEP
    filtered = sum(ledger["groups_filtered"].values())
    assert ledger["groups_dispatched"] == ledger["groups_trained"] + filtered + ledger["groups_unused"]
    # the resumed segment obeys the boundary rules; the killed one is kept beside it
    report = check_run_dir(run_dir)
    assert report.ok, report.violations
    assert (run_dir / "trace.part-0.json").exists()
    # checkpoints: the newest two, complete, nothing half-written left
    kept = complete_checkpoints(run_dir / CHECKPOINTS)
    assert [p.name for p in kept] == ["step-000028", "step-000030"]
    assert not [p for p in (run_dir / CHECKPOINTS).iterdir() if p.name.startswith(".")]


LORA_RUN = [
    "run.backend=local",
    "task.kind=arithmetic",
    "run.steps=6",
    "rollout.num_generations=4",
    "rollout.groups_per_step=4",
    "rollout.max_staleness=0",
    "eval.enabled=false",
    "orchestrator.release_memory=false",
    "orchestrator.checkpoint_every=2",
    "train.lora.r=4",
    "train.learning_rate=1e-2",
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_killed_and_resumed_lora_run_equals_an_uninterrupted_one(tmp_path: Path, world_size: int) -> None:
    """train.lora (and with train.world_size = 2): a run killed with SIGKILL after its step-2
    checkpoint and resumed trains every step exactly as an uninterrupted run of the same config
    does (the adapters start from run.seed; the checkpoint holds them and AdamW's moments)."""
    base = [*LORA_RUN, f"train.world_size={world_size}", f"run.output_dir={tmp_path}"]
    whole = relayrl("train", *[f"--set={s}" for s in [*base, "run.name=whole"]], timeout=300)
    assert whole.returncode == 0, whole.stderr
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        _cli(*[f"--set={s}" for s in [*base, "run.name=killed"]]), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / CHECKPOINTS / "step-000002").exists():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    resumed = relayrl("train", "--resume", str(run_dir), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from_step"] >= 2

    def by_step(directory: Path) -> dict[int, dict[str, float]]:
        rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return {int(r["step"]): r for r in rows}  # (a step logged before the kill and again after: the resumed one)

    a, b = by_step(tmp_path / "whole"), by_step(run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        for key in ("train/grad_norm", "train/loss", "reward_mean"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])


def test_resume_is_refused_without_a_checkpoint_or_when_done(tmp_path: Path) -> None:
    cfg = sim_config(f"run.output_dir={tmp_path}", "run.name=r", "orchestrator.checkpoint_every=2")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        build_program(cfg, run_dir=tmp_path / "r", resume=True)
    run_checked(build_program(cfg, run_dir=tmp_path / "r"))
    with pytest.raises(CheckpointError, match="already trained 4 steps of run.steps=4; raise run.steps"):
        build_program(cfg, run_dir=tmp_path / "r", resume=True)
    # ... and raising run.steps continues it from the final checkpoint
    longer = sim_config(f"run.output_dir={tmp_path}", "run.name=r", "orchestrator.checkpoint_every=2", "run.steps=6")
    result = run_checked(build_program(longer, run_dir=tmp_path / "r", resume=True))
    assert [r.step for r in result.results] == [5, 6]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert result.summary["steps_completed"] == 6


@pytest.mark.slow
def test_cli_resume_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    proc = relayrl("train", "--resume", str(tmp_path / "nothing"), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: nothing to resume: run directory {tmp_path / 'nothing'} does not exist"]
    # a run without checkpoints
    sets = [f"--set={s}" for s in [*SIM_RUN, f"run.output_dir={tmp_path}", "run.name=r", "run.steps=2", "orchestrator.checkpoint_every=0"]]
    assert relayrl("train", *sets, timeout=60).returncode == 0
    proc = relayrl("train", "--resume", str(tmp_path / "r"), timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: nothing to resume: {tmp_path / 'r'} has no complete checkpoint")
    # a checkpoint whose trainer state is gone: named before anything in the run directory changes
    sets = [f"--set={s}" for s in [*SIM_RUN, f"run.output_dir={tmp_path}", "run.name=r", "run.steps=2"]]
    assert relayrl("train", *sets, timeout=60).returncode == 0
    (tmp_path / "r" / CHECKPOINTS / "step-000002" / "sim_trainer.json").unlink()
    proc = relayrl("train", "--resume", str(tmp_path / "r"), "--set=run.steps=3", timeout=60)
    assert proc.returncode == 2 and "trainer state file(s) missing: sim_trainer.json" in proc.stderr
    assert (tmp_path / "r" / "trace.json").exists() and not (tmp_path / "r" / "trace.part-0.json").exists()


def test_fresh_run_refuses_a_used_run_directory_without_overwrite(tmp_path: Path) -> None:
    cfg = sim_config(f"run.output_dir={tmp_path}", "run.name=r")
    run_checked(build_program(cfg, run_dir=tmp_path / "r"))
    keep = sim_config(f"run.output_dir={tmp_path}", "run.name=r", "run.overwrite=false")
    with pytest.raises(ValueError, match="not empty and run.overwrite=false: resume it with --resume"):
        build_program(keep, run_dir=tmp_path / "r")


def test_repeated_crashes_lose_no_prompt_and_reuse_no_group_id(tmp_path: Path) -> None:
    """Checkpoint every step, groups filtered out of order (dynamic sampling), crash twice, resume
    twice. The first run has a fast sampler and a slow trainer, so 16 groups are in flight at
    its checkpoint (staleness 4); the first resume has a slow sampler behind a one-request
    queue, so replayed prompts are still waiting to be dispatched when its checkpoint is taken."""
    sets = [
        f"run.output_dir={tmp_path}",
        "run.name=r",
        "run.steps=10",
        "rollout.max_staleness=4",
        "orchestrator.queue_size=1",
        "rollout.prompts_per_request=1",
        "algorithm.dynamic_sampling=true",
        "orchestrator.checkpoint_every=1",
        "orchestrator.keep_checkpoints=1",
        "sim.learn_rate=0.0",
    ]
    fast = sim_config(*sets, "sim.generate_per_request=0.001", "sim.train_step=0.05")
    slow = sim_config(*sets, "sim.generate_per_request=0.05", "sim.train_step=0.01")
    run_dir = tmp_path / "r"
    # a crash in on_step_end(N) comes before checkpoint N: the resumes go on after steps 3 and 4
    for crash_at, resume, cfg in ((4, False, fast), (5, True, slow)):
        with pytest.raises(Stopped):
            asyncio.run(build_program(cfg, [StopAt(crash_at)], run_dir=run_dir, resume=resume).run())
    state = json.loads((run_dir / CHECKPOINTS / "step-000004" / "state.json").read_text())
    assert len(state["in_flight"]) > 3  # replays that were still waiting are carried on
    result = run_checked(build_program(fast, run_dir=run_dir, resume=True))
    assert result.summary["steps_completed"] == 10
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    trajs = pd.read_parquet(run_dir / "trajectories")
    _assert_each_step_logged_once(run_dir, trajs, rows)
    assert trajs.groupby("group_id")["prompt_id"].nunique().max() == 1  # an id names one group
    trained = trajs[trajs["status"] == "ok"]
    assert trained.groupby("prompt_id")["step"].nunique().max() == 1  # no prompt trained twice
    logged = {int(p.rsplit("-", 1)[1]) for p in trajs["prompt_id"]}
    in_flight = {int(d.prompt.prompt_id.rsplit("-", 1)[1]) for d in result.ledger.in_flight()}
    # every prompt the stream handed out is trained or filtered (logged) or still in flight: none lost
    assert logged | in_flight == set(range(len(logged | in_flight)))
    assert not logged & in_flight
    assert filtered_count(trajs) > 0  # the case this test is about: groups settled out of order


def test_a_resumed_runs_trajectory_log_has_each_step_once(tmp_path: Path) -> None:
    """A run that fails at the end of step 7 closes its trajectory file (steps 5-7, past its
    newest checkpoint, of step 4); the resume cuts the log back to step 4 and logs steps 5-10
    again: each step once, in files rolled at each checkpoint (so a kill never loses a step a
    checkpoint claims)."""
    sets = [f"run.output_dir={tmp_path}", "run.name=r", "run.steps=10", "orchestrator.checkpoint_every=4"]
    cfg = sim_config(*sets)
    run_dir = tmp_path / "r"
    with pytest.raises(Stopped):
        asyncio.run(build_program(cfg, [StopAt(7)], run_dir=run_dir).run())
    assert [f.path.name for f in log_files(run_dir)] == ["steps-000001-000004.parquet", "steps-000005-000007.parquet"]
    result = run_checked(build_program(cfg, run_dir=run_dir, resume=True))
    assert result.summary["resumed_from_step"] == 4
    names = ["steps-000001-000004.parquet", "steps-000005-000008.parquet", "steps-000009-000010.parquet"]
    assert [f.path.name for f in log_files(run_dir)] == names
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trajs = pd.read_parquet(run_dir / "trajectories")
    assert sorted(set(trajs["step"])) == list(range(1, 11))
    _assert_each_step_logged_once(run_dir, trajs, rows)


def _assert_each_step_logged_once(run_dir: Path, trajs: pd.DataFrame, metrics: list[dict[str, object]]) -> None:
    """The resumed run's trajectory log holds each step exactly once: the files' step ranges are
    disjoint and in name order, no trajectory appears twice, and each step has the rows of the
    trajectories its metrics row counts (its trained groups; filtered groups come on top)."""
    files = log_files(run_dir)
    assert [f.path.name for f in files] == sorted(f.path.name for f in files)
    assert all(a.last < b.first for a, b in itertools.pairwise(files))
    assert not trajs.duplicated(["step", "group_id", "sample_index"]).any()
    assert trajs.groupby("group_id")["step"].nunique().max() == 1  # a group is logged at one step
    logged = trajs[~trajs["status"].str.startswith("filtered")].groupby("step").size().to_dict()
    assert logged == {int(r["step"]): int(r["num_trajectories"]) for r in metrics}  # type: ignore[call-overload]


def filtered_count(trajs: pd.DataFrame) -> int:
    return int(trajs["status"].str.startswith("filtered").sum())


def test_a_checkpoint_on_a_full_disk_names_the_disk_leaves_no_temporary_and_writes_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It said `RuntimeError: [enforce fail at inline_container.cc:672]` and left an empty
    error.txt.tmp behind."""
    import errno

    from relayrl.cli import main as cli
    from relayrl.orchestrator import checkpointing
    from relayrl.orchestrator.checkpointing import CheckpointWriteError

    commit = checkpointing.commit_checkpoint

    def full_disk(staging: Path, final: Path, state: dict[str, object], keep: int) -> None:
        if final.name.endswith("2"):
            (staging / "state.json.tmp").write_text('{"torn')  # a write cut by the full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        commit(staging, final, state, keep)

    monkeypatch.setattr(checkpointing, "commit_checkpoint", full_disk)
    run_dir = tmp_path / "run"
    program = build_program(sim_config("run.steps=4", "orchestrator.checkpoint_every=1"), run_dir=run_dir)
    with pytest.raises(CheckpointWriteError) as info:
        asyncio.run(asyncio.wait_for(program.run(), 120))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"step 2's checkpoint cannot be written to {run_dir / CHECKPOINTS}")
    assert "no space left on the disk at /" in message and "MB free; the checkpoint needs" in message
    assert "the previous checkpoint step-000001 is intact" in message
    assert [p.name for p in complete_checkpoints(run_dir / CHECKPOINTS)] == ["step-000001"]
    assert sorted(p.name for p in (run_dir / CHECKPOINTS).iterdir()) == ["step-000001"]  # no staging directory left
    assert not list(run_dir.rglob("*.tmp"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "no space left on the disk" in summary["error"]

    def no_room(self: Path, *args: object, **kwargs: object) -> int:
        with open(self, "w"):  # created, then the write fails
            pass
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", no_room)
    assert cli._keep_traceback(run_dir, RuntimeError("x")) == ""
    assert not (run_dir / "error.txt.tmp").exists() and not (run_dir / "error.txt").exists()


def test_prompt_source_replays_then_continues_the_stream() -> None:
    stream = (Prompt(f"p{i}", str(i), str(i)) for i in range(100))
    replay = [Drawn(3, Prompt("p3", "3", "3")), Drawn(5, Prompt("p5", "5", "5"))]
    source = PromptSource(stream, replay, skip=7)
    drawn = [next(source) for _ in range(4)]
    assert [(d.index, d.prompt.prompt_id) for d in drawn] == [(3, "p3"), (5, "p5"), (7, "p7"), (8, "p8")]
    assert source.drawn == 9


def test_ledger_checkpoint_keeps_settled_counts_and_in_flight_prompts() -> None:
    ledger = Ledger()
    prompts = [Drawn(i, Prompt(f"p{i}", "", "")) for i in range(5)]
    ids = ledger.dispatch(prompts, 4)
    ledger.trained(ids[0], 4)
    group = Group(ids[2], [])
    ledger.filtered(group, FilterReason.STALE, DispatchWindow(groups_per_step=1, max_staleness=0, total_steps=1))
    assert [(d.index, d.prompt.prompt_id) for d in ledger.in_flight()] == [(1, "p1"), (3, "p3"), (4, "p4")]
    resumed = Ledger.resumed(json.loads(json.dumps(ledger.checkpoint())))
    again = resumed.dispatch(ledger.in_flight(), 4)
    for gid in again:
        resumed.trained(gid, 4)
    d = resumed.as_dict()
    assert d["groups_dispatched"] == 5 and d["groups_trained"] == 4 and d["groups_filtered"] == {"stale": 1}
    assert d["groups_unused"] == 0 and d["trajectories_trained"] == 16 and d["trajectories_dispatched"] == 20
    with pytest.raises(Exception, match="never dispatched"):
        resumed.trained(ids[1], 4)  # an id of the run before the resume


def test_local_trainer_state_round_trips(tmp_path: Path) -> None:
    """Save after one update, load into a fresh trainer: the same weights and version, and the
    next update (which depends on AdamW's moments and the LR schedule) lands on the same weights."""
    from relayrl.algorithms.losses import LossConfig
    from relayrl.backends.local.collate import TorchCollator
    from relayrl.backends.local.trainer import LocalTrainer, TrainerSettings
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
    from relayrl.packing import build_microbatch, plan
    from support.trajectories import trajectory

    def make() -> tuple[LocalTrainer, object]:
        model, tok = load_model_and_tokenizer(shipped_model_dir())
        settings = TrainerSettings(learning_rate=1e-2, total_steps=10, loss=LossConfig(), warmup_steps=3, lr_schedule="cosine")
        return LocalTrainer(model, settings), tok

    trainer, tok = make()
    ids = tok("12+7=", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    trajs = [
        trajectory(sample=i, prompt=Prompt("p", "12+7=", "19"), prompt_tokens=ids, completion_tokens=c, logprob=-1.0, text="", advantage=a)
        for i, (c, a) in enumerate([([5, 6, 1], 1.0), ([5, 7, 1], -1.0)])
    ]
    mb = build_microbatch(0, 0, trajs, plan(trajs, 64, 4, share_prompt=True))
    mb.payload = TorchCollator(pad_token_id=0).collate(mb)

    async def update(t: LocalTrainer) -> int:
        await t.train_step(mb.train_batch())
        return await t.optim_step()

    async def first_part() -> dict[str, torch.Tensor]:
        await update(trainer)
        await trainer.save_state(tmp_path)
        await update(trainer)
        state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        await trainer.close()
        return state

    continued = asyncio.run(first_part())
    fresh, _ = make()

    async def second_part() -> tuple[int, int]:
        version = await fresh.load_state(tmp_path)
        exported = (await fresh.export_weights()).version
        after = await update(fresh)
        await fresh.close()
        return version, exported * 100 + after

    version, both = asyncio.run(second_part())
    assert version == 1 and both == 102
    for name, value in fresh.model.state_dict().items():
        torch.testing.assert_close(value, continued[name], rtol=0, atol=0)


def test_local_run_resumes_with_its_trainer_state_and_evals(tmp_path: Path) -> None:
    """The local backend end to end: a 2-step run with a checkpoint per step, extended to 4 steps
    by a resume that restores the trainer (version 2) and keeps the held-out evaluations."""
    base = [
        "run.backend=local",
        "task.kind=arithmetic",
        "rollout.num_generations=4",
        "rollout.groups_per_step=4",
        "task.heldout_size=16",
        "orchestrator.release_memory=false",
        "orchestrator.checkpoint_every=1",
        "eval.every_steps=2",
    ]
    first = load_config(None, [*base, "run.steps=2"])
    run_checked(build_program(first, run_dir=tmp_path / "run"), timeout=120)
    assert (tmp_path / "run" / CHECKPOINTS / "step-000002" / "trainer.pt").is_file()
    longer = load_config(None, [*base, "run.steps=4"])
    result = run_checked(build_program(longer, run_dir=tmp_path / "run", resume=True), timeout=120)
    assert [r.step for r in result.results] == [3, 4]
    assert [r.policy_version for r in result.results] == [3, 4]  # went on from version 2
    evals = [json.loads(line)["version"] for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals == [0, 2, 4]
    assert result.summary["steps_completed"] == 4 and result.summary["accuracy_before"] is not None


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_names_the_checkpoint(tmp_path: Path) -> None:
    """A scheduler's SIGTERM cancels the run like Ctrl-C: exit 130, summary "cancelled", a
    closed trace that passes the checker, and the line to resume with; the resume completes."""
    sets = [f"--set={s}" for s in [*SIM_RUN, f"run.output_dir={tmp_path}", "run.name=t"]]
    run_dir = tmp_path / "t"
    proc = subprocess.Popen(_cli(*sets), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (run_dir / CHECKPOINTS / "step-000004").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr
    assert f"with: relayrl train --resume {run_dir}" in stderr and "Traceback" not in stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled" and summary["steps_completed"] < STEPS
    assert check_run_dir(run_dir).ok
    resumed = relayrl("train", "--resume", str(run_dir), timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps_completed"] == STEPS


def test_a_signal_checkpoints_the_next_step_so_a_stop_before_the_cadence_resumes(tmp_path: Path) -> None:
    """Ctrl-C before the first checkpoint of the cadence (every 50 steps) still leaves one: the
    next step to commit is checkpointed, the stop names it, and the resume goes on after it."""
    sets = [f"--set={s}" for s in [*SIM_RUN, f"run.output_dir={tmp_path}", "run.name=c", "orchestrator.checkpoint_every=50"]]
    run_dir = tmp_path / "c"
    proc = subprocess.Popen(_cli(*sets), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    names = [p.name for p in complete_checkpoints(run_dir / CHECKPOINTS)]
    assert len(names) == 1, names
    step = int(names[0].removeprefix("step-"))
    assert 3 <= step < STEPS
    assert f"step-{step:06d}" in stderr and f"relayrl train --resume {run_dir}" in stderr
    resumed = relayrl("train", "--resume", str(run_dir), timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming after step {step} " in resumed.stdout + resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps_completed"] == STEPS


def test_default_settings_checkpoint_at_the_cadence_and_the_end_and_resume_after_a_stop(tmp_path: Path) -> None:
    """With the default orchestrator.checkpoint_every (50) and keep_checkpoints (2), a 105-step
    run stopped at the end of step 103 has the checkpoints of steps 50 and 100; its resume goes on
    after step 100 and writes the final checkpoint after step 105, pruning step 50's. Steps are numbered from 1 in every
    file: metrics.jsonl, the trajectory log and the checkpoint directories agree."""
    defaults = load_config(None, [])
    assert (defaults.orchestrator.checkpoint_every, defaults.orchestrator.keep_checkpoints) == (50, 2)
    cfg = sim_config(f"run.output_dir={tmp_path}", "run.name=r", "run.steps=105", "eval.enabled=false")
    run_dir = tmp_path / "r"
    with pytest.raises(Stopped):
        asyncio.run(build_program(cfg, [StopAt(103)], run_dir=run_dir).run())
    assert [p.name for p in complete_checkpoints(run_dir / CHECKPOINTS)] == ["step-000050", "step-000100"]
    state = json.loads((run_dir / CHECKPOINTS / "step-000100" / "state.json").read_text())
    assert (state["format"], state["step"]) == (2, 100)
    result = run_checked(build_program(cfg, run_dir=run_dir, resume=True))
    assert result.summary["resumed_from_step"] == 100 and result.summary["steps_completed"] == 105
    assert [r.step for r in result.results][:1] == [101]
    assert [p.name for p in complete_checkpoints(run_dir / CHECKPOINTS)] == ["step-000100", "step-000105"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 106))
    assert [r["policy_version"] for r in rows] == list(range(1, 106))  # step N's commit makes version N
    trajs = pd.read_parquet(run_dir / "trajectories")
    assert sorted(set(trajs["step"])) == list(range(1, 106))
    assert log_files(run_dir)[0].path.name.startswith("steps-000001-")
    assert log_files(run_dir)[-1].path.name.endswith("-000105.parquet")


def test_keep_checkpoints_prunes_the_oldest(tmp_path: Path) -> None:
    cfg = sim_config(
        f"run.output_dir={tmp_path}", "run.name=r", "run.steps=7", "orchestrator.checkpoint_every=2", "orchestrator.keep_checkpoints=3"
    )
    run_checked(build_program(cfg, run_dir=tmp_path / "r"))
    # after steps 2, 4, 6 and the last (7): the newest three
    assert [p.name for p in complete_checkpoints(tmp_path / "r" / CHECKPOINTS)] == ["step-000004", "step-000006", "step-000007"]
    assert sorted(p.name for p in (tmp_path / "r" / CHECKPOINTS).iterdir()) == ["step-000004", "step-000006", "step-000007"]


def test_checkpoint_every_0_writes_none(tmp_path: Path) -> None:
    cfg = sim_config(f"run.output_dir={tmp_path}", "run.name=r", "orchestrator.checkpoint_every=0")
    run_checked(build_program(cfg, run_dir=tmp_path / "r"))
    assert complete_checkpoints(tmp_path / "r" / CHECKPOINTS) == []


def test_a_checkpoint_numbered_from_0_is_refused_in_one_line(tmp_path: Path) -> None:
    """A checkpoint written before steps were numbered from 1 (state.json without `format`, with
    `next_step`) is refused, never resumed shifted by one step."""
    cfg = sim_config(f"run.output_dir={tmp_path}", "run.name=r", "orchestrator.checkpoint_every=2")
    run_checked(build_program(cfg, run_dir=tmp_path / "r"))
    path = tmp_path / "r" / CHECKPOINTS / "step-000004" / "state.json"
    old = json.loads(path.read_text())
    del old["format"]
    old["next_step"] = old.pop("step")
    path.write_text(json.dumps(old))
    longer = sim_config(f"run.output_dir={tmp_path}", "run.name=r", "orchestrator.checkpoint_every=2", "run.steps=6")
    with pytest.raises(CheckpointError) as err:
        build_program(longer, run_dir=tmp_path / "r", resume=True)
    assert str(err.value) == (
        f"{path}: checkpoint format 1, this relayrl reads format 2 (steps numbered from 1); "
        "resume it with the relayrl version that wrote it, or start the run afresh"
    )


def test_console_and_resume_message_agree_with_the_files(tmp_path: Path) -> None:
    """`relayrl train` prints step N/total as step N's files are named; a run that stopped after
    step 4 resumes saying so, and its next step is 5, as in metrics.jsonl."""
    sets = [f"--set={s}" for s in [*SIM_RUN, f"run.output_dir={tmp_path}", "run.name=r", "run.steps=4", "orchestrator.checkpoint_every=2"]]
    first = relayrl("train", *sets, timeout=120)
    assert first.returncode == 0, first.stderr
    assert [line.split()[1] for line in first.stdout.splitlines() if line.startswith("step ")] == ["1/4", "2/4", "3/4", "4/4"]
    run_dir = tmp_path / "r"
    assert complete_checkpoints(run_dir / CHECKPOINTS)[-1].name == "step-000004"
    resumed = relayrl("train", "--resume", str(run_dir), "--set=run.steps=6", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "relayrl: resuming after step 4 (next: step 5 of 6)" in resumed.stdout
    assert [line.split()[1] for line in resumed.stdout.splitlines() if line.startswith("step ")] == ["5/6", "6/6"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [p.name for p in complete_checkpoints(run_dir / CHECKPOINTS)] == ["step-000004", "step-000006"]
    changes = [json.loads(line) for line in (run_dir / "config_changes.jsonl").read_text().splitlines()]
    assert changes == [{"from_step": 5, "key": "run.steps", "old": 4, "new": 6}]


def test_a_stop_during_a_slow_step_checkpoints_the_last_committed_step_without_waiting(tmp_path: Path) -> None:
    """A SIGTERM in the middle of a slow step (each micro-batch trains 4 s) checkpoints the last
    step that committed at once and stops, instead of waiting for the step in flight to commit;
    the stop names that checkpoint and the resume goes on after it."""
    slow = [*SIM_RUN, "run.steps=4", "sim.train_step=4.0", "orchestrator.checkpoint_every=50", "orchestrator.stop_grace_s=30"]
    sets = [f"--set={s}" for s in [*slow, f"run.output_dir={tmp_path}", "run.name=s"]]
    run_dir = tmp_path / "s"
    proc = subprocess.Popen(_cli(*sets), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):  # step 1 is logged; step 2 is training
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    stopped_after = time.monotonic() - signalled
    assert proc.returncode == 143, stderr
    assert stopped_after < 3.5, f"the stop waited {stopped_after:.1f} s: for the step in flight"
    assert [p.name for p in complete_checkpoints(run_dir / CHECKPOINTS)] == ["step-000001"]
    assert "step-000001" in stderr and f"relayrl train --resume {run_dir}" in stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "cancelled"
    assert check_run_dir(run_dir).ok
    resumed = relayrl("train", "--resume", str(run_dir), "--set", "sim.train_step=0.01", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after step 1 " in resumed.stdout + resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps_completed"] == 4


def test_checkpoint_every_s_checkpoints_by_time_between_the_step_cadence(tmp_path: Path) -> None:
    """orchestrator.checkpoint_every_s: a run whose step cadence (1000) never comes still
    checkpoints the first step to commit after each interval, and a resume from one works."""
    sets = ["run.steps=12", "sim.train_step=0.05", "orchestrator.checkpoint_every=1000", "orchestrator.keep_checkpoints=20"]
    cfg = sim_config(f"run.output_dir={tmp_path}", "run.name=t", *sets, "orchestrator.checkpoint_every_s=0.3")
    run_checked(build_program(cfg, run_dir=tmp_path / "t"))
    steps = [int(p.name.removeprefix("step-")) for p in complete_checkpoints(tmp_path / "t" / CHECKPOINTS)]
    assert steps[-1] == 12 and len(steps) >= 2, steps  # the last step's, and at least one by time
    off = sim_config(f"run.output_dir={tmp_path}", "run.name=u", *sets, "orchestrator.checkpoint_every_s=0")
    run_checked(build_program(off, run_dir=tmp_path / "u"))
    assert [p.name for p in complete_checkpoints(tmp_path / "u" / CHECKPOINTS)] == ["step-000012"]


def test_a_resume_removes_a_checkpoint_left_half_written(tmp_path: Path) -> None:
    """A stop past its bound (or a kill) while a checkpoint was being written leaves its hidden
    staging directory; the resume removes it, never reads it."""
    cfg = sim_config(f"run.output_dir={tmp_path}", "run.name=r", "run.steps=4", "orchestrator.checkpoint_every=2")
    with pytest.raises(Stopped):
        asyncio.run(build_program(cfg, [StopAt(3)], run_dir=tmp_path / "r").run())
    staging = tmp_path / "r" / CHECKPOINTS / ".step-000003.partial"
    staging.mkdir()
    (staging / "trainer.pt").write_bytes(b"half")
    result = run_checked(build_program(cfg, run_dir=tmp_path / "r", resume=True))
    assert result.summary["resumed_from_step"] == 2 and not staging.exists()
