"""Faults on the Ray backend: a sampler actor's process killed with a generate call in flight is
restarted by Ray and serves again with the current weights, loaded by the weight publisher (its
requests go to the other replica meanwhile); the trainer actor's process killed fails the run, naming the trainer, and leaves the
newest checkpoint intact, from which `relayrl train --resume RUN_DIR --ray` completes the run. One
local cluster for the module.

Each kill is synchronised with what it must interrupt, so what the run sees does not depend on how
fast the machine is: the sampler actor tells the test (through a latch actor) that it is inside a
generate call that cannot return on its own, and the trainer's process is killed from a wrapper of
the driver-side call, before that call goes out. A kill timed by a clock can land after the call
returned instead (a sampler actor killed idle is restarted by Ray and healed unseen by the next
weight load; a trainer killed late may find no checkpoint written yet)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from relayrl.analysis.checker import check_run_dir  # noqa: E402
from relayrl.backends.ray.actors import RaySampler, RayTrainer, TrainerActorDiedError  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.backends.sim.workers import SimTrainer  # noqa: E402
from relayrl.config.schema import Config, load_config  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from relayrl.orchestrator.replicas import SamplerRestartedWarning, SamplerRetiredWarning  # noqa: E402
from relayrl.rundir.checkpoint import checkpoint_dir, complete_checkpoints, load_resume_point  # noqa: E402
from relayrl.types import GenerateResult, SampleRequest, TrainBatch, Weights  # noqa: E402
from support.cli import child_env, relayrl, relayrl_argv  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402
from support.simutil import settled_groups, sim_config  # noqa: E402

cluster = pytest.fixture(scope="module")(local_cluster)


def _latch() -> Any:
    """A Ray actor used as a one-shot event between processes: `wait` returns once `open` was
    called. The class is defined in here so that Ray pickles it by value (an actor's process cannot
    import this test module)."""

    class Latch:
        def __init__(self) -> None:
            self._opened = asyncio.Event()

        async def open(self) -> None:
            self._opened.set()

        async def wait(self) -> None:
            await self._opened.wait()

    return ray.remote(num_cpus=0)(Latch).remote()


def _sim_sampler_stalling_once(latch: Any) -> Callable[[Config, int], Any]:
    """A stand-in for the sim kind's sampler factory (`relayrl.backends.sim.build.sim_sampler`, run in each
    sampler actor's process): replica 0's third generate call opens `latch`, then never returns;
    once Ray has restarted that actor, its sampler does not stall. Pickled by value, as `_latch`."""

    def factory(cfg: Config, replica: int) -> Any:
        from relayrl.backends.sim.workers import SimSampler

        stall = replica == 0 and not ray.get_runtime_context().was_current_actor_reconstructed

        class StallsOnce(SimSampler):
            async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
                if stall and self.generate_calls == 2:
                    await latch.open.remote()
                    await asyncio.Event().wait()  # until the process is killed
                return await super().generate(requests)

        return StallsOnce(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=replica)

    return factory


@pytest.mark.slow
def test_a_killed_sampler_actor_is_restarted_with_the_current_weights_and_nothing_is_lost(
    cluster: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica 0's actor process is killed while it executes a generate call (it told the test so
    through a latch and cannot return on its own), so the call fails whatever the timing; no step
    commits while the replica is down, so the run cannot end before Ray has restarted it."""
    from relayrl.backends.sim import build as sim_build

    latch = _latch()
    monkeypatch.setattr(sim_build, "sim_sampler", _sim_sampler_stalling_once(latch))
    cfg = sim_config("ray.enabled=true", "ray.address=auto", "rollout.num_samplers=2", "run.steps=14", "sim.generate_per_request=0.05")
    program = build_program(cfg, run_dir=tmp_path / "run")
    sampler, trainer = program.backend.samplers[0], program.backend.trainer
    assert isinstance(sampler, RaySampler) and isinstance(trainer, RayTrainer)
    pid = ray.get(sampler.actor.pid.remote())
    restart, load_weights = sampler.restart, sampler.load_weights
    optim_step, optim_step_ahead = trainer.optim_step, trainer.optim_step_ahead

    async def go() -> object:
        killed, alive, back = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def kill_once_stalled() -> None:
            await latch.wait.remote()  # replica 0's actor is inside its third generate call
            os.kill(pid, signal.SIGKILL)
            killed.set()

        async def restart_then_release() -> None:
            try:
                await restart()
            except BaseException:
                back.set()
                raise
            alive.set()  # the weight publisher loads the current weights into it next

        async def load_weights_then_release(weights: Weights) -> None:
            try:
                await load_weights(weights)
            finally:
                if alive.is_set():  # the load that brings the restarted actor back into service
                    back.set()

        async def while_down() -> None:
            if killed.is_set():
                await back.wait()

        async def optim_step_held() -> int:
            await while_down()
            return await optim_step()

        async def optim_step_ahead_held(ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
            await while_down()
            return await optim_step_ahead(ahead)

        sampler.restart = restart_then_release  # type: ignore[method-assign]
        sampler.load_weights = load_weights_then_release  # type: ignore[method-assign]
        trainer.optim_step = optim_step_held  # type: ignore[method-assign]
        trainer.optim_step_ahead = optim_step_ahead_held  # type: ignore[method-assign]
        killer = asyncio.create_task(kill_once_stalled())
        try:
            result = await asyncio.wait_for(program.run(), 120)
        finally:
            killer.cancel()
        assert killed.is_set()
        return result

    try:
        with pytest.warns(SamplerRestartedWarning):
            result = asyncio.run(go())
    finally:
        ray.kill(latch)
    ledger = result.ledger.as_dict()  # type: ignore[attr-defined]
    assert ledger["groups_trained"] == cfg.run.steps * cfg.rollout.groups_per_step  # each group trained once
    settled = ledger["groups_trained"] + sum(ledger["groups_filtered"].values()) + ledger["groups_unused"]
    assert settled == ledger["groups_dispatched"]
    report = check_run_dir(tmp_path / "run")
    assert report.ok, report.violations
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert [r["replica"] for r in summary["samplers_restarted"]] == [0], summary["samplers_restarted"]
    assert summary["samplers_retired"] == []
    assert summary["samplers_restarted"][0]["version"] >= 0


def test_a_sampler_actor_that_cannot_be_restarted_is_retired_and_the_run_completes(cluster: RayCluster, tmp_path: Path) -> None:
    cfg = sim_config("ray.enabled=true", "ray.address=auto", "rollout.num_samplers=2", "run.steps=8", "sim.generate_per_request=0.02")
    program = build_program(cfg, run_dir=tmp_path / "run")
    sampler = program.backend.samplers[0]
    assert isinstance(sampler, RaySampler)
    generate, calls = sampler.generate, []

    async def generate_then_kill(requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        calls.append(len(requests))
        if len(calls) == 3:  # the actor dies for good while this call generates (Ray will not restart it)
            asyncio.get_running_loop().call_later(0.01, functools.partial(ray.kill, sampler.actor, no_restart=True))
        return await generate(requests)

    sampler.generate = generate_then_kill  # type: ignore[method-assign]
    with pytest.warns(SamplerRetiredWarning, match="replica 0"):
        result = asyncio.run(asyncio.wait_for(program.run(), 60))
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == cfg.run.steps * cfg.rollout.groups_per_step  # the other replica did the rest
    assert settled_groups(ledger) == ledger["groups_dispatched"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert [r["replica"] for r in summary["samplers_retired"]] == [0], summary["samplers_retired"]
    assert "dead for good" in summary["samplers_retired"][0]["error"]  # told at once, not after the 60 s restart bound
    report = check_run_dir(tmp_path / "run")
    assert report.ok, report.violations


def test_a_killed_trainer_actor_fails_the_run_naming_it_and_keeps_the_newest_checkpoint(cluster: RayCluster, tmp_path: Path) -> None:
    cfg = sim_config(
        "ray.enabled=true",
        "ray.address=auto",
        "run.steps=200",
        "sim.train_step=0.05",
        "orchestrator.checkpoint_every=1",
    )
    program = build_program(cfg, run_dir=tmp_path / "run")
    trainer = program.backend.trainer
    assert isinstance(trainer, RayTrainer)
    pid = ray.get(trainer.actor.pid.remote())
    optim_step, optim_step_ahead = trainer.optim_step, trainer.optim_step_ahead
    updates: list[int] = []
    killed_at: list[float] = []

    def kill_at_the_third_update() -> None:
        # step 2's update: the checkpoints of steps 0 and 1 were complete before it was issued
        updates.append(len(updates))
        if len(updates) == 3:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    async def optim_step_then_kill() -> int:
        kill_at_the_third_update()
        return await optim_step()

    async def optim_step_ahead_then_kill(ahead: Callable[[], TrainBatch | None]) -> tuple[int, bool]:
        kill_at_the_third_update()
        return await optim_step_ahead(ahead)

    trainer.optim_step = optim_step_then_kill  # type: ignore[method-assign]
    trainer.optim_step_ahead = optim_step_ahead_then_kill  # type: ignore[method-assign]
    with pytest.raises(Exception, match="trainer actor died"):
        asyncio.run(asyncio.wait_for(program.run(), 60))
    assert killed_at and time.monotonic() - killed_at[0] < 30.0  # failed soon after the kill
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "trainer actor died" in summary["error"]
    assert complete_checkpoints(tmp_path / "run" / "checkpoints"), "no complete checkpoint"


SIM_RECIPE = Path(__file__).resolve().parents[2] / "src" / "relayrl" / "recipes" / "sim.toml"


@pytest.mark.slow
def test_a_killed_trainer_actor_leaves_a_checkpoint_from_which_the_cli_resumes_on_ray(cluster: RayCluster, tmp_path: Path) -> None:
    """The trainer actor's process is killed (SIGKILL) as the orchestrator starts writing the
    third checkpoint (steps 2 and 4 are written, step 6's is under way): the run fails within 30 s
    naming the trainer actor, the newest complete checkpoint (step 4, next step 5) loads with
    relayrl's own reader and holds the trainer state of version 4, and the real CLI
    `relayrl train --resume RUN_DIR --ray`, in a subprocess, completes the run from step 5.

    The killed run runs in this process, which is already connected to the module's cluster, so it
    joins it (`ray.address=auto` reuses that connection, as the other tests here do); the resume
    joins the same cluster by its address (`--set ray.address=<the cluster's GCS address>`), a
    resumable key, so it takes the same code path as a resume on a cluster started elsewhere. The
    kill is made from a wrapper of the trainer's `save_state` before the actor call goes out:
    deterministic, no timing race."""
    steps, every = 12, 2
    run_dir = tmp_path / "run"
    sets = [f"run.output_dir={tmp_path}", "run.name=run", f"run.steps={steps}", f"orchestrator.checkpoint_every={every}"]
    cfg = load_config(SIM_RECIPE, [*sets, "orchestrator.release_memory=false", "ray.enabled=true", "ray.address=auto"])
    program = build_program(cfg, run_dir=run_dir)
    trainer = program.backend.trainer
    assert isinstance(trainer, RayTrainer)
    pid = ray.get(trainer.actor.pid.remote())
    save_state, saved, killed_at = trainer.save_state, [], []

    async def save_state_then_kill(directory: Path) -> None:
        saved.append(directory)
        if len(saved) == 3:  # the third checkpoint: the first two are complete by now
            assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step-000002", "step-000004"]
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
        await save_state(directory)

    trainer.save_state = save_state_then_kill  # type: ignore[method-assign]
    with pytest.raises(TrainerActorDiedError, match="trainer actor died"):
        asyncio.run(asyncio.wait_for(program.run(), 60))
    # (a) the run failed soon after the kill, naming the trainer actor
    assert killed_at and time.monotonic() - killed_at[0] < 30.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "trainer actor died" in summary["error"], summary["error"]
    assert summary["steps_completed"] < steps
    # (b) the newest complete checkpoint is intact: relayrl's reader loads it, the trainer state in it
    # is the version it claims; the one being written when the trainer died is not complete
    point = load_resume_point(run_dir)
    assert point.directory == checkpoint_dir(run_dir, 4) and point.step == 4 and point.backend == "sim"
    assert asyncio.run(SimTrainer(cfg.sim).load_state(point.directory)) == point.step
    assert not checkpoint_dir(run_dir, 6).exists()

    # (c) the real CLI resumes it on Ray, joining the module's cluster, and completes the run
    resumed = relayrl(
        "train",
        "--resume",
        str(run_dir),
        "--ray",
        "--set",
        f"ray.address={cluster.address}",
        cwd=tmp_path,
        env={"COLUMNS": "160"},
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"joined Ray cluster at {cluster.address} " in resumed.stdout, resumed.stdout[-2000:]
    assert f"resuming after step {point.step} (next: step {point.step + 1} of {steps})" in resumed.stdout, resumed.stdout[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["resumed_from_step"] == point.step
    assert summary["steps_completed"] == steps
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once, in order
    ledger = summary["ledger"]
    assert ledger["groups_trained"] == steps * cfg.rollout.groups_per_step  # each group trained once
    settled = ledger["groups_trained"] + sum(ledger["groups_filtered"].values()) + ledger["groups_unused"]
    assert settled == ledger["groups_dispatched"]
    report = check_run_dir(run_dir)  # what `relayrl check-trace RUN_DIR` runs
    assert report.ok, report.violations
    assert report.completed
    assert (run_dir / "trace.part-0.json").exists()  # the killed run's trace is kept beside it
    assert complete_checkpoints(run_dir / "checkpoints")[-1] == checkpoint_dir(run_dir, steps)  # the last step's


def _ray_processes_of(root: int) -> set[int]:
    """The Ray cluster processes (raylet, GCS server) descended from process `root`."""
    parents: dict[int, int] = {}
    ray_pids: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        if b"raylet" in cmdline or b"gcs_server" in cmdline:
            ray_pids.add(int(entry))

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return {p for p in ray_pids if descends(p)}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigterm_stops_a_cli_run_on_its_own_ray_cluster_cleanly(cluster: RayCluster, tmp_path: Path) -> None:
    env = child_env({"COLUMNS": "160"})
    recipe = Path(__file__).resolve().parents[2] / "src" / "relayrl" / "recipes" / "sim.toml"
    sets = ["ray.num_cpus=1", "run.steps=100000", f"run.output_dir={tmp_path}", "run.name=t", "orchestrator.checkpoint_every=1"]
    args = ["train", str(recipe), "--ray", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(relayrl_argv(*args), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not complete_checkpoints(tmp_path / "t" / "checkpoints"):  # the run is under way
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        cluster_pids = _ray_processes_of(proc.pid)  # the cluster this run started
        assert cluster_pids
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr
    assert json.loads((tmp_path / "t" / "summary.json").read_text())["status"] == "cancelled"
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in cluster_pids) and time.monotonic() < deadline:  # the cluster's processes exit
        time.sleep(0.2)
    assert not [p for p in cluster_pids if _alive(p)]
