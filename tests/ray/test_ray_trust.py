"""Ray runs a user can trust: per-step figures that agree with the summary, resources the
cluster cannot satisfy refused in one line, start-up said on the console. One local cluster
shared by the module (each cluster start costs seconds)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.config.schema import load_config  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from support.cli import child_env, relayrl_argv  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402

cluster = pytest.fixture(scope="module")(local_cluster)


@pytest.mark.slow
def test_per_step_busy_on_ray_is_the_summarys_trainer_busy(cluster: RayCluster, tmp_path: Path) -> None:
    """metrics.jsonl's train_time / step_time_sec (what the progress line, the sinks and the
    report's step-time chart show) agrees with summary.json's trainer_busy_fraction: both come
    from the trainer actor's spans, not from the driver's calls, which return before the work."""
    cfg = load_config(
        None,
        [
            "run.backend=local",
            "run.steps=6",
            "eval.enabled=false",
            "orchestrator.release_memory=false",
            "ray.enabled=true",
            "ray.address=auto",
        ],
    )
    program = build_program(cfg, run_dir=tmp_path / "run")
    asyncio.run(asyncio.wait_for(program.run(), 240))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and len(rows) == 6
    # the first step's time includes filling the pipeline, which the summary's window (first
    # train_step start → last optim_step end) leaves out
    busy = [r["train_time"] / r["step_time_sec"] for r in rows[1:]]
    mean = sum(busy) / len(busy)
    assert abs(mean - summary["trainer_busy_fraction"]) <= 0.05, (busy, summary["trainer_busy_fraction"])
    assert all(0.0 < b <= 1.0 for b in busy), busy


def _processes_with(marker: str) -> list[str]:
    """The live processes whose environment carries `marker` (NAME=value), as "pid cmdline"."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path("/proc", entry, "environ").read_bytes()
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            program = cmdline.split(b"\0")[0].decode(errors="replace")
            found.append(f"{entry} {program}")
    return found


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
    assert _processes_with(marker) == [], said[-2000:]
