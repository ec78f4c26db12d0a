"""Ray runs a user can trust: per-step figures that agree with the summary, resources the
cluster cannot satisfy refused in one line, start-up said on the console. One local cluster
shared by the module (each cluster start costs seconds)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray._private import state  # noqa: E402

from relayrl.analysis import timeline  # noqa: E402
from relayrl.backends.ray.build import check_resources  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.config.schema import ConfigError  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from support.cli import child_env, relayrl, relayrl_argv  # noqa: E402
from support.rayutil import local_cluster, processes_with  # noqa: E402
from support.simutil import sim_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

cluster = pytest.fixture(scope="module")(local_cluster)


@pytest.mark.slow
def test_per_step_busy_on_ray_is_the_summarys_trainer_busy(cluster: RayCluster, tmp_path: Path) -> None:
    """metrics.jsonl's train_time / step_time_sec (what the progress line, the sinks and the
    report's step-time chart show) agrees with summary.json's trainer_busy_fraction: both come
    from the trainer actor's spans, not from the driver's calls, which return before the work."""
    # the trainer's time is simulated (sleeps in the actor), so the figures hold on a loaded machine
    cfg = sim_config(
        "run.steps=8",
        "ray.enabled=true",
        "ray.address=auto",
        "sim.generate_per_request=0.002",
        "sim.train_step=0.03",
        "sim.optim_step=0.002",
    )
    program = build_program(cfg, run_dir=tmp_path / "run")
    result = asyncio.run(asyncio.wait_for(program.run(), 240))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and len(rows) == 8
    # per-step busy averaged over the steps, weighted by their time (as the step-time chart shows
    # it); the first step's time includes filling the pipeline, which the summary's window (first
    # train_step start → last optim_step end) leaves out
    busy = [r["train_time"] / r["step_time_sec"] for r in rows[1:]]
    mean = sum(r["train_time"] for r in rows[1:]) / sum(r["step_time_sec"] for r in rows[1:])
    assert abs(mean - summary["trainer_busy_fraction"]) <= 0.05, (mean, busy, summary["trainer_busy_fraction"])
    assert all(0.0 < b <= 1.0 for b in busy), busy
    # each step's train_time is the sum of that step's train_step spans in the trainer actor's lane
    spans = timeline.spans(result.tracer.events)
    for row in rows:
        inside = [s.dur for s in spans if s.lane == timeline.ACTOR_TRAINER and s.name == "train_step" and s.step == row["step"]]
        assert inside and row["train_time"] == pytest.approx(sum(inside), abs=1e-5 * len(inside)), (row["step"], row["train_time"], inside)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.5, 2.0, 5.0, 10.0])
def test_sigint_at_any_moment_of_a_ray_start_leaves_no_process_of_the_run(delay: float, tmp_path: Path) -> None:
    """Ctrl-C while relayrl imports, starts its local cluster, starts the actors (which load the
    model) or runs: exit 130, and no process the run started (every one inherits the marker this
    test puts in its environment) is left."""
    marker = f"RELAYRL_TEST_RUN={uuid.uuid4().hex}"
    name, value = marker.split("=")
    args = ["train", "--ray", "--set", "ray.num_cpus=2", "--set", "run.steps=200", "--set", f"run.output_dir={tmp_path}"]
    with open(tmp_path / "out.txt", "w") as out:
        child = subprocess.Popen(relayrl_argv(*args), cwd=tmp_path, env=child_env({name: value}), stdout=out, stderr=subprocess.STDOUT)
        try:
            time.sleep(delay)
            child.send_signal(signal.SIGINT)
            code = child.wait(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    said = (tmp_path / "out.txt").read_text()
    assert code == 130, said[-2000:]
    deadline = time.monotonic() + 10.0  # a process SIGKILLed at the exit may still be tearing down (a loaded machine)
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], said[-2000:]


def test_resources_the_cluster_lacks_are_named_in_one_line() -> None:
    total = {"CPU": 2.0, "memory": 1e9, "object_store_memory": 1e8, "node:10.0.0.1": 1.0}
    trainer = ("the trainer actor", "ray.trainer_resources", {"GPU": 1.0}, 1)
    samplers = ("each sampler actor", "ray.sampler_resources", {"CPU": 1.0}, 2)
    with pytest.raises(ConfigError) as missing:
        check_resources([trainer, samplers], total, [total])
    assert str(missing.value) == (
        "ray.trainer_resources={GPU=1}: the trainer actor asks for GPU=1 but the Ray cluster has no GPU (it has {CPU=2})"
    )
    with pytest.raises(ConfigError) as together:
        check_resources([("the trainer actor", "ray.trainer_resources", {"CPU": 1.0}, 1), samplers], total, [total])
    assert "ask for CPU=3 in all" in str(together.value) and "ray.sampler_resources (CPU=1) × 2" in str(together.value)
    two_nodes = [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0}]
    with pytest.raises(ConfigError, match="no node of the Ray cluster has all that the trainer actor asks for"):
        check_resources([("the trainer actor", "ray.trainer_resources", {"CPU": 2.0, "GPU": 1.0}, 1)], {"CPU": 2.0, "GPU": 1.0}, two_nodes)
    check_resources([samplers, ("the trainer actor", "ray.trainer_resources", {}, 1)], total, [total])  # fits: no error


def test_a_gpu_the_cluster_lacks_is_refused_before_any_actor_waits(cluster: RayCluster, tmp_path: Path) -> None:
    """On the module's cluster (2 CPUs, no GPU): `relayrl train` joining it with
    ray.trainer_resources={GPU=1} exits 2 with one line naming the key and what the cluster has,
    instead of waiting for ever; no actor of the run is left."""
    recipe = ROOT / "src" / "relayrl" / "recipes" / "sim.toml"
    args = ["train", str(recipe), "--ray", "--set", f"ray.address={cluster.address}", "--set", f"run.output_dir={tmp_path}"]
    res = relayrl(*args, "--set", "ray.trainer_resources={GPU=1}", cwd=tmp_path, env={"COLUMNS": "200"}, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [
        "error: ray.trainer_resources={GPU=1}: the trainer actor asks for GPU=1 but the Ray cluster has no GPU (it has {CPU=2})"
    ]
    alive = [a for a in state.actors().values() if a.get("State") == "ALIVE"]
    assert not [a for a in alive if str(a.get("ActorClassName", "")).endswith(("_TrainerActor", "_SamplerActor"))], alive


def test_ray_start_up_says_what_it_does(cluster: RayCluster, tmp_path: Path) -> None:
    """The console says each start-up stage as it happens: the cluster joined, the actors
    starting, each one ready, all ready; then the run."""
    recipe = ROOT / "src" / "relayrl" / "recipes" / "sim.toml"
    args = ["train", str(recipe), "--ray", "--set", f"ray.address={cluster.address}", "--set", f"run.output_dir={tmp_path}"]
    res = relayrl(*args, "--set", "run.steps=2", "--set", "rollout.num_samplers=2", cwd=tmp_path, env={"COLUMNS": "200"}, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("relayrl: ")]
    said = [line.split(" ")[1:3] for line in lines]
    assert said[:3] == [["joining", "the"], ["joined", "Ray"], ["starting", "3"]], lines
    assert sorted(line.split(" ")[1:3] for line in lines[3:6]) == [["sampler", "0"], ["sampler", "1"], ["trainer", "actor"]], lines
    assert lines[6].startswith("relayrl: Ray actors ready in ") and lines[7].startswith("relayrl: 2 steps on the sim backend"), lines
