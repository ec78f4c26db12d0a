"""Start or join the Ray cluster a run uses.

Invariant: a run shuts down only a cluster it started (`ray.address = ""`), and always does, with
its temporary directory; a cluster it joined (`ray.address = "auto"` or "host:port") is left
running. A process already connected to Ray (a notebook, a test) may run with an address: the
run then uses that connection and leaves it open. Ray's usage reporting, auth token and dashboard are off for a cluster the run starts.

No process of a cluster the run started outlives it: every process the cluster starts (GCS
server, raylet, and the raylet's agents and workers, which run in process groups of their own)
inherits a marker in its environment (`MARKER_ENV`, unique per cluster), and the run ends every
process carrying it: after `ray.shutdown` when it closes the cluster, and from a hook
(`relayrl.exits`) when the process exits at once on a signal, at any moment of `ray.init`
included.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.config.schema import RayConfig
from relayrl.config.sizing import DEFAULT_OBJECT_STORE_MB
from relayrl.exits import on_hard_exit

# set before ray.init: no usage-stats reporting, no auth token written under the home directory
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
MARKER_ENV = "RELAYRL_RAY_CLUSTER"  # in the environment of every process of a cluster the run started
END_BOUND_S = 5.0  # ending a cluster's processes gives up after this long
QUIET_S = 1.0  # ...and ends once no process of the cluster was found for this long


def marked_processes(token: str) -> list[int]:
    """The processes (other than this one) whose environment carries `MARKER_ENV=token` (Linux
    /proc; none elsewhere). A process that already died (a zombie) has no environment left."""
    needle = f"{MARKER_ENV}={token}".encode()
    me = os.getpid()
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            environ = Path("/proc", entry, "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every live descendant of theirs (Linux /proc parent links; `pids` elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])  # (after the command, which may hold spaces)
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(pids), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def end_processes(token: str, bound_s: float = END_BOUND_S) -> int:
    """SIGKILL every process carrying `token`, and their descendants (an agent the raylet starts
    is found by its parent too, whatever its environment holds by then), until none was found for
    QUIET_S (a process being spawned while the others die, e.g. an agent the raylet forked just
    before its kill, is found by a later scan), for at most `bound_s`; returns how many were killed."""
    now = time.monotonic()
    deadline, quiet_since = now + bound_s, now
    killed: set[int] = set()
    while True:
        pids = marked_processes(token)
        pids = with_descendants(pids) if pids else pids
        now = time.monotonic()
        if pids:
            quiet_since = now
        if now - quiet_since >= QUIET_S or now >= deadline:
            return len(killed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:  # already gone
                pass
        time.sleep(0.01)


@dataclass(slots=True)
class RayCluster:
    """The connection a run holds; `close()` shuts the cluster down only if `owned`, and
    disconnects unless the run reused a connection it found open."""

    address: str
    owned: bool
    start_seconds: float  # how long starting (or joining) took
    temp_dir: str | None = None
    disconnect: bool = True
    token: str | None = None  # MARKER_ENV's value in the processes of a cluster this run started
    _unregister: Callable[[], None] | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Disconnect; shut down the cluster, end every process left of it and remove its temp dir
        if this run started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.disconnect:
            return
        import ray

        try:
            ray.shutdown()  # a started cluster stops with its driver; a joined one keeps running
        finally:
            _end_started(self.token, self.temp_dir, self._unregister)


def _end_started(token: str | None, temp_dir: str | None, unregister: Callable[[], None] | None) -> None:
    """End a started cluster's remaining processes (its agents may outlive the raylet), remove its
    temp dir and drop its exit hook."""
    if token is not None:
        end_processes(token)
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
    if unregister is not None:
        unregister()


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
    token: str | None = None
    unregister: Callable[[], None] | None = None
    if not cfg.address:
        # Ray's socket paths must stay short (AF_UNIX limit): a short prefix under the system temp dir
        temp_dir = tempfile.mkdtemp(prefix="rr-ray-")
        token = uuid.uuid4().hex
        # a signal from here on (relayrl.cli.signals exits at once) still ends the cluster's processes
        unregister = on_hard_exit(functools.partial(_end_started, token, temp_dir, None))
        say(f"starting a local Ray cluster ({f'ray.num_cpus={cfg.num_cpus}' if cfg.num_cpus else 'all CPUs'})")
        os.environ[MARKER_ENV] = token  # inherited by the GCS server and the raylet, and by what the raylet starts
        try:
            ray.init(
                num_cpus=cfg.num_cpus or None,
                object_store_memory=(cfg.object_store_mb or DEFAULT_OBJECT_STORE_MB) * 1024 * 1024,  # (0: place_on_ray sizes it)
                include_dashboard=False,
                namespace=cfg.namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,  # its "Started a local Ray instance" line: said by `say` instead
                _temp_dir=temp_dir,
            )
        except BaseException:
            try:
                ray.shutdown()
            finally:
                _end_started(token, temp_dir, unregister)
            raise
        finally:
            os.environ.pop(MARKER_ENV, None)  # processes this one starts later are not the cluster's
    else:
        say(f"joining the Ray cluster at {cfg.address}")
        ray.init(address=cfg.address, namespace=cfg.namespace, log_to_driver=False, logging_level=logging.WARNING)
    seconds = time.perf_counter() - started
    address = str(ray.get_runtime_context().gcs_address)
    what = "joined" if cfg.address else "started a local"
    say(f"{what} Ray cluster at {address} in {seconds:.1f}s")
    if token is None:
        return RayCluster(address=address, owned=False, start_seconds=seconds)
    return RayCluster(address=address, owned=True, start_seconds=seconds, temp_dir=temp_dir, token=token, _unregister=unregister)


def say(message: str) -> None:
    """One line of start-up progress on the console (stdout, where the run's progress goes)."""
    print(f"relayrl: {message}", flush=True)
