"""One local Ray cluster per test module (starting one costs seconds): use as
`cluster = pytest.fixture(scope="module")(local_cluster)` after `pytest.importorskip("ray")`."""

from __future__ import annotations

from collections.abc import Iterator

from relayrl.backends.ray.cluster import RayCluster, connect
from relayrl.config.schema import RayConfig


def local_cluster() -> Iterator[RayCluster]:
    c = connect(RayConfig(num_cpus=2, object_store_mb=128))
    try:
        yield c
    finally:
        c.close()
