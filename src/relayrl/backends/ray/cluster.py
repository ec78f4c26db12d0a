"""Start or join the Ray cluster a run uses.

Invariant: a run shuts down only a cluster it started (`ray.address = ""`), and always does, with
its temporary directory; a cluster it joined (`ray.address = "auto"` or "host:port") is left
running. A process already connected to Ray (a notebook, a test) may run with an address: the
run then uses that connection and leaves it open. Ray's usage reporting, auth token and dashboard are off for a cluster the run starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from relayrl.config.schema import RayConfig

# set before ray.init: no usage-stats reporting, no auth token written under the home directory
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


@dataclass(slots=True)
class RayCluster:
    """The connection a run holds; `close()` shuts the cluster down only if `owned`, and
    disconnects unless the run reused a connection it found open."""

    address: str
    owned: bool
    start_seconds: float  # how long starting (or joining) took
    temp_dir: str | None = None
    disconnect: bool = True
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Disconnect; shut down the cluster and remove its temp dir if this run started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.disconnect:
            return
        import ray

        try:
            ray.shutdown()  # a started cluster stops with its driver; a joined one keeps running
        finally:
            if self.temp_dir is not None:
                shutil.rmtree(self.temp_dir, ignore_errors=True)


def connect(cfg: RayConfig) -> RayCluster:
    """Start a local cluster (`cfg.address` empty) or join `cfg.address`. Prints and returns
    (in `start_seconds`) how long it took."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    started = time.perf_counter()
    if ray.is_initialized():
        if not cfg.address:
            raise RuntimeError("this process is already connected to Ray: set ray.address (e.g. 'auto') to run on that cluster")
        address = str(ray.get_runtime_context().gcs_address)
        return RayCluster(address=address, owned=False, start_seconds=time.perf_counter() - started, disconnect=False)
    temp_dir: str | None = None
    if cfg.address:
        ray.init(address=cfg.address, namespace=cfg.namespace, log_to_driver=False)
    else:
        # Ray's socket paths must stay short (AF_UNIX limit): a short prefix under the system temp dir
        temp_dir = tempfile.mkdtemp(prefix="rr-ray-")
        try:
            ray.init(
                num_cpus=cfg.num_cpus or None,
                object_store_memory=cfg.object_store_mb * 1024 * 1024,
                include_dashboard=False,
                namespace=cfg.namespace,
                log_to_driver=False,
                _temp_dir=temp_dir,
            )
        except BaseException:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    seconds = time.perf_counter() - started
    address = str(ray.get_runtime_context().gcs_address)
    what = "joined" if cfg.address else "started a local"
    print(f"relayrl: {what} Ray cluster at {address} in {seconds:.1f}s")
    return RayCluster(address=address, owned=not cfg.address, start_seconds=seconds, temp_dir=temp_dir)
