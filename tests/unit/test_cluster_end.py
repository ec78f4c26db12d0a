"""Ending a local Ray cluster's processes (relayrl.backends.ray.cluster.end_processes), without Ray:
a process carrying the cluster's marker is killed with its descendants, even one whose own
environment lacks the marker, and nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.backends.ray.cluster import MARKER_ENV, end_processes, with_descendants

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

# a "raylet": carries the marker, starts a child without it, and both sleep
PARENT = """
import os, subprocess, sys, time
env = {k: v for k, v in os.environ.items() if k != "RELAYRL_RAY_CLUSTER"}
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
print(child.pid, flush=True)
time.sleep(120)
"""


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rfind(")") + 2 :].split()[0]


def test_a_marked_process_dies_with_its_unmarked_descendants_and_nothing_else() -> None:
    token = "t" + os.urandom(6).hex()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env={**os.environ, MARKER_ENV: token}, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert with_descendants([parent.pid]) == sorted([parent.pid, child])
        assert end_processes(token, bound_s=10.0) == 2
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _state(child) not in ("Z", "gone") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(child) in ("Z", "gone")  # killed (a zombie until it is reaped)
        assert bystander.poll() is None  # not the cluster's
    finally:
        for p in (bystander, parent):
            if p.poll() is None:
                p.kill()
                p.wait()
