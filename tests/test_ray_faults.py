"""Faults on the Ray backend: a sampler actor's process killed mid-generation is restarted by Ray
and serves again with the current weights (its requests go to the other replica meanwhile); the
trainer actor's process killed fails the run, naming the trainer, and leaves the newest checkpoint
intact. One local cluster for the module."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rayutil import local_cluster  # noqa: E402
from relayrl.backends.ray.actors import RaySampler, RayTrainer  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.checkpoint import complete_checkpoints  # noqa: E402
from relayrl.replicas import SamplerRestartedWarning  # noqa: E402
from relayrl.run import build_program  # noqa: E402
from relayrl.telemetry.checker import check_run_dir  # noqa: E402
from relayrl.types import GenerateResult, SampleRequest  # noqa: E402
from simutil import sim_config  # noqa: E402

cluster = pytest.fixture(scope="module")(local_cluster)


async def _kill_after(pid: int, seconds: float) -> None:
    await asyncio.sleep(seconds)
    os.kill(pid, signal.SIGKILL)


def test_a_killed_sampler_actor_is_restarted_with_the_current_weights_and_nothing_is_lost(cluster: RayCluster, tmp_path: Path) -> None:
    cfg = sim_config("ray.enabled=true", "ray.address=auto", "rollout.num_samplers=2", "run.steps=14", "sim.generate_per_request=0.05")
    # long enough (~10 s) that Ray has restarted the actor (a new worker process) well before the end
    program = build_program(cfg, run_dir=tmp_path / "run")
    sampler = program.backend.samplers[0]
    assert isinstance(sampler, RaySampler)
    pid = ray.get(sampler.actor.pid.remote())
    generate, calls = sampler.generate, []

    async def generate_then_kill(requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        calls.append(len(requests))
        if len(calls) == 3:  # kill the actor's process while this call generates
            asyncio.get_running_loop().call_later(0.02, os.kill, pid, signal.SIGKILL)
        return await generate(requests)

    sampler.generate = generate_then_kill  # type: ignore[method-assign]

    async def go() -> object:
        return await asyncio.wait_for(program.run(), 60)

    with pytest.warns(SamplerRestartedWarning):
        result = asyncio.run(go())
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
    started = time.monotonic()

    async def go() -> None:
        killer = asyncio.create_task(_kill_after(pid, 3.0))
        try:
            await asyncio.wait_for(program.run(), 60)
        finally:
            await killer

    with pytest.raises(Exception, match="trainer actor died"):
        asyncio.run(go())
    assert time.monotonic() - started < 3.0 + 30.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "trainer actor died" in summary["error"]
    assert complete_checkpoints(tmp_path / "run" / "checkpoints"), "no complete checkpoint"


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


def test_sigterm_stops_a_cli_run_on_its_own_ray_cluster_cleanly(cluster: RayCluster, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "160"}
    recipe = Path(__file__).resolve().parents[1] / "src" / "relayrl" / "recipes" / "sim.toml"
    sets = ["ray.num_cpus=1", "run.steps=100000", f"run.output_dir={tmp_path}", "run.name=t", "orchestrator.checkpoint_every=1"]
    args = ["train", str(recipe), "--ray", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", *args], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
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
