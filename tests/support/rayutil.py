"""One local Ray cluster per test module (starting one costs seconds): use as
`cluster = pytest.fixture(scope="module")(local_cluster)` after `pytest.importorskip("ray")`;
and the processes a child run left (`processes_with` a marker the test put in its environment,
which every process the run starts inherits: Ray's raylet, its agents and workers included)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from relayrl.backends.ray.cluster import RayCluster, connect
from relayrl.config.schema import RayConfig


def local_cluster() -> Iterator[RayCluster]:
    c = connect(RayConfig(num_cpus=2, object_store_mb=128))
    try:
        yield c
    finally:
        c.close()


def processes_with(marker: str) -> list[str]:
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
