"""What agents leave running when a run ends: threads and child processes.

Job: an agent is user code in relayrl's process; it may start a thread (`threading.Thread`, not a
daemon) or a subprocess and return without ending it. `Leftovers.now()` notes the process's
threads and descendant processes before a `task.agent` run; `end(code)` once the run is over
(its summary written, whatever its outcome) names in one line what appeared meanwhile and is still
running, ends those processes, and, when a thread is left, exits the process at once.

Invariants (the contract the README states):
- a descendant process started during the run and alive at its end is ended with it: SIGTERM,
  then SIGKILL to any still alive after `END_GRACE_S` (found through /proc: Linux; elsewhere
  processes are not looked for). relayrl's own are not counted: a local Ray cluster's (they carry
  `RELAYRL_RAY_CLUSTER`, ended by backends/ray/cluster.py) and any that ends by itself within
  `SETTLE_S` of the run's end (an engine's worker finishing its shutdown);
- a non-daemon thread started during the run and alive at its end never keeps relayrl alive: the
  process flushes its output and exits with the run's exit code (`os._exit`) instead of waiting
  for it, as Python would at interpreter shutdown;
- both are said once, on one line on stderr, naming the threads and the processes (pid and
  command); nothing is said when nothing was left.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from relayrl.processes import alive

__all__ = ["END_GRACE_S", "Leftovers"]

#: how long processes left by agents get to end on SIGTERM before SIGKILL
END_GRACE_S = 2.0
#: how long a process started during the run has, after it, to end by itself before it counts as left
SETTLE_S = 1.0
#: in the environment of every process of a local Ray cluster the run started (backends/ray/cluster.py)
RAY_MARKER = b"RELAYRL_RAY_CLUSTER="


def _descendants(pid: int) -> dict[int, str]:
    """The processes below `pid` (pid -> its command, at most ~60 characters) from /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1 and fields[0] != "Z":  # a zombie has ended already
            parents[int(entry.name)] = int(fields[1])
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                try:
                    raw = (proc / str(child) / "cmdline").read_bytes()
                except OSError:
                    raw = b""
                command = " ".join(raw.decode(errors="replace").split("\0")).strip() or "?"
                found[child] = command if len(command) <= 60 else command[:57] + "..."
                frontier.append(child)
    return found


@dataclass(slots=True)
class Leftovers:
    """The threads and descendant processes there were before a run (see the module)."""

    threads: set[int]
    processes: set[int]

    @classmethod
    def now(cls) -> Leftovers:
        return cls({id(t) for t in threading.enumerate()}, set(_descendants(os.getpid())))

    def left(self) -> tuple[list[threading.Thread], dict[int, str]]:
        """(non-daemon threads, descendant processes) started since `now` and still running (see
        the module for the processes that do not count)."""
        threads = [t for t in threading.enumerate() if id(t) not in self.threads and t.is_alive() and not t.daemon]
        processes = {pid: cmd for pid, cmd in _descendants(os.getpid()).items() if pid not in self.processes and not _ray(pid)}
        deadline = time.monotonic() + SETTLE_S
        while processes and time.monotonic() < deadline:
            time.sleep(0.05)
            processes = {pid: cmd for pid, cmd in processes.items() if alive(pid)}
        return threads, processes

    def end(self, code: int | None) -> None:
        """Name what the run left running (one line, stderr), end its processes, and exit with
        `code` at once when a thread is left (see the module; None: the caller exits, e.g. with
        a bug's line); return when nothing was left."""
        threads, processes = self.left()
        if not threads and not processes:
            return
        for pid in processes:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + END_GRACE_S
        while time.monotonic() < deadline and any(alive(pid) for pid in processes):
            time.sleep(0.05)
        killed = [pid for pid in processes if alive(pid)]
        for pid in killed:
            _signal(pid, signal.SIGKILL)
        parts = []
        if threads:
            names = ", ".join(repr(t.name) for t in threads[:5]) + (f" (+{len(threads) - 5} more)" if len(threads) > 5 else "")
            parts.append(f"{len(threads)} non-daemon thread{'s' if len(threads) > 1 else ''} ({names}): not waited for")
        if processes:
            shown = list(processes.items())[:5]
            listed = ", ".join(f"pid {pid} {cmd!r}" for pid, cmd in shown) + (
                f" (+{len(processes) - 5} more)" if len(processes) > 5 else ""
            )
            how = "SIGTERM" + (f", then SIGKILL to {len(killed)}" if killed else "")
            parts.append(f"{len(processes)} process{'es' if len(processes) > 1 else ''} ({listed}): ended ({how})")
        print(
            f"warning: the run's agents left running at its end {'; '.join(parts)} "
            "(an agent's threads and subprocesses end with the run: end them before it returns)",
            file=sys.stderr,
        )
        if threads and code is not None:  # Python would wait for them at shutdown, for ever: exit now, output flushed
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _ray(pid: int) -> bool:
    """Whether `pid` belongs to a local Ray cluster the run started (relayrl ends those itself)."""
    try:
        return RAY_MARKER in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except OSError:  # ended meanwhile
        pass
