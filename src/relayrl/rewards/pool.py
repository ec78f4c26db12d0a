"""A pool of worker processes that run user reward functions, each call bounded in time.

Job: run calls `(function index, payload)` in N long-lived worker processes, in parallel, each
bounded by a wall-clock deadline (`timeout_s`) and optionally by CPU seconds per call and by the
process's address space, and give every call one `CallOutcome`: its value, or why it has none.

- timeout: no answer by the deadline; the worker is killed (SIGKILL) and replaced.
- raised: the function raised, or returned something that is not a number; the worker lives on.
- non_finite: it returned an int too large for a float (`as_reward`); the worker lives on. (Other
  values travel as floats, NaN and infinities included: the caller judges them.)
- crashed: the worker process died during the call (a segfault, `os._exit`, a signal), exceeded
  its CPU limit (SIGXCPU) or ran out of memory (a `MemoryError` under `memory_mb` is reported as
  crashed, not raised, since the process may be unusable after it); the worker is replaced.

A worker's stdout and stderr (fd 1 and 2: Python, C and its subprocesses alike) go to one pipe
read by rewards/output.py, which keeps them in the run directory's reward_workers.log up to a
cap (`log_path`; without one, a short head on stderr), never straight to the console.

Workers are fresh interpreters started with subprocess (fork + exec of `sys.executable`, as the
"spawn" start method does, never a bare fork of this process, which has threads and torch) that
import only this module, relayrl.rewards.registry and the user's reward modules; they never import
the parent's `__main__`. Calls and results travel as pickles over a socket pair
(multiprocessing.connection); the caller's thread waits on every busy worker's connection at once
(`multiprocessing.connection.wait`) with the nearest deadline as its timeout, so N calls run in
parallel and the event loop is never involved.

Invariants:
- Every call gets exactly one outcome, at most about `timeout_s` (plus the time to kill a worker)
  after it was sent; a failing call never fails the pool. Only a worker that cannot start (its
  reward module fails to import there, a memory limit below what the interpreter needs) raises
  `RewardPoolError`. The caller may watch outcomes as they arrive (`on_outcome`) and stop the
  batch by raising: the calls in flight are then killed with their workers.
- A value is sent back as `as_reward` makes it: exactly a float (a numpy scalar, an int, a bool or
  a 0-d array returned by the function is converted in the worker).
- Starting the workers stops soon after `abort` is set: the flag is checked before each one is
  spawned, as it is while they start and while calls run.
- No worker outlives the pool: `close()` ends and reaps every process; a worker also dies with the
  thread that started it (PR_SET_PDEATHSIG on Linux: a SIGKILLed parent leaves none behind) and
  exits when its connection closes.
- This is isolation, not a security sandbox: workers run as this user, with this environment,
  file system and network.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from multiprocessing.connection import Connection, wait
from pathlib import Path

from relayrl.errors import RunFailed
from relayrl.rewards.output import WorkerOutput
from relayrl.types import RewardFailure

#: how long a worker may take to start and import the reward modules
START_TIMEOUT_S = 120.0
#: how often a waiting pool checks its abort flag
_POLL_S = 0.1
#: how long an idle worker gets to exit on its own at close before it is killed
_CLOSE_GRACE_S = 0.5
_DETAIL_CHARS = 500
_SRC = str(Path(__file__).resolve().parents[2])  # the directory holding the relayrl package
_BOOT = f"import sys; sys.path.insert(0, {_SRC!r}); from relayrl.rewards.pool import worker_main; worker_main(int(sys.argv[1]))"


class RewardPoolError(RunFailed, RuntimeError):
    """A reward worker could not start; the run cannot score its trajectories."""


class RewardPoolAborted(RuntimeError):
    """The pool's caller set the abort flag (the run is being cancelled)."""


@dataclass(slots=True, frozen=True)
class PoolLimits:
    """`timeout_s`: wall-clock seconds per call. `memory_mb`: each worker's address space
    (RLIMIT_AS, the interpreter and imported modules included; 0 = no limit). `cpu_s`: CPU
    seconds per call (RLIMIT_CPU; 0 = no limit)."""

    timeout_s: float
    memory_mb: int = 0
    cpu_s: float = 0.0


@dataclass(slots=True, frozen=True)
class CallOutcome:
    """A call's value (a float, possibly NaN or infinite: the caller judges it) or its failure."""

    value: float = 0.0
    failure: RewardFailure | None = None
    detail: str = ""


class _State(Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"


@dataclass(slots=True)
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: Connection
    state: _State
    deadline: float  # STARTING: start deadline; BUSY: the call's deadline
    call: int = -1  # BUSY: index of the call it runs


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 1] + "…"


def describe(exc: BaseException) -> str:
    """An exception as one short line: `Type: message`."""
    text = str(exc)
    return _short(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _exit_detail(returncode: int | None, limits: PoolLimits) -> str:
    if returncode is None:
        return "the worker process stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode == signal.SIGXCPU:
            return f"the worker process exceeded its CPU limit (task.reward_cpu_s = {limits.cpu_s:g}; killed by SIGXCPU)"
        return f"the worker process was killed by {name}"
    return f"the worker process exited with code {returncode}"


class RewardPool:
    """N worker processes running the functions named by `specs` (`module:function` or
    `/abs/file.py:function`); `run(calls)` is thread-safe (one batch at a time) and blocking. The
    workers' stdout and stderr go to `log_path` (its first `log_cap_bytes`; None: a short head on
    stderr)."""

    def __init__(
        self, specs: Sequence[str], workers: int, limits: PoolLimits, log_path: Path | None = None, log_cap_bytes: int | None = None
    ) -> None:
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.specs = list(specs)
        self.size = workers
        self.limits = limits
        self._threads: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.started_pids: list[int] = []  # every worker process started, replacements included
        self.replaced = 0  # workers replaced after a timeout or a crash
        self._on_outcome: Callable[[int, CallOutcome], None] | None = None  # the running batch's
        self.output = WorkerOutput(log_path) if log_cap_bytes is None else WorkerOutput(log_path, log_cap_bytes)

    # -- parent side -------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        try:
            fd = child_sock.fileno()
            out = self.output.write_fd()
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=out, stderr=out, close_fds=True
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
        init = {"parent_pid": os.getpid(), "sys_path": list(sys.path), "specs": self.specs, "memory_mb": self.limits.memory_mb}
        worker = _Worker(proc, conn, _State.STARTING, time.monotonic() + START_TIMEOUT_S)
        try:
            conn.send(init)
        except OSError:
            pass  # it died at once: its EOF is seen while it starts
        self.started_pids.append(proc.pid)
        return worker

    def pids(self) -> list[int]:
        """The worker processes' ids (for tests and diagnostics)."""
        return [w.proc.pid for w in self._threads]

    @staticmethod
    def _end(worker: _Worker) -> int | None:
        """Kill (if still running) and reap a worker; its exit status."""
        with contextlib.suppress(OSError):
            worker.conn.close()
        if worker.proc.poll() is None:
            with contextlib.suppress(OSError):
                worker.proc.kill()
        try:
            return worker.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a process in uninterruptible sleep; the kernel ends it
            return None

    def _replace(self, worker: _Worker) -> int | None:
        status = self._end(worker)
        self._threads[self._threads.index(worker)] = self._spawn()
        self.replaced += 1
        return status

    def _started_or_raise(self, worker: _Worker, message: object) -> None:
        if isinstance(message, tuple) and message and message[0] == "ready":
            worker.state = _State.IDLE
            return
        detail = message[1] if isinstance(message, tuple) and len(message) == 2 else repr(message)
        self._end(worker)
        raise RewardPoolError(f"a reward worker process could not start: {detail}")

    def run(
        self,
        calls: Sequence[tuple[int, object]],
        abort: threading.Event | None = None,
        on_outcome: Callable[[int, CallOutcome], None] | None = None,
    ) -> list[CallOutcome]:
        """Run every call (`(index into specs, payload)`), up to `size` at a time, and return their
        outcomes in order. Blocks; raises RewardPoolAborted soon after `abort` is set and
        RewardPoolError if a worker cannot start. `on_outcome(k, outcome)` sees each call's outcome
        as it arrives (in this thread); if it raises, the batch stops there and its exception
        propagates. However `run` ends early, the calls in flight are killed with their workers
        (replaced at the next batch)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward pool is closed")
            self._on_outcome = on_outcome
            try:
                return self._run(calls, abort)
            except BaseException:  # the calls in flight are moot: end their workers
                for w in [w for w in self._threads if w.state is not _State.IDLE]:
                    self._end(w)
                    self._threads.remove(w)
                raise
            finally:
                self._on_outcome = None

    def _run(self, calls: Sequence[tuple[int, object]], abort: threading.Event | None) -> list[CallOutcome]:
        while len(self._threads) < self.size:
            if abort is not None and abort.is_set():
                raise RewardPoolAborted("the reward pool's caller is stopping")
            self._threads.append(self._spawn())
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        queue = deque(range(len(calls)))
        resent: dict[int, int] = {}  # call → times sent again after its worker died idle
        while True:
            if abort is not None and abort.is_set():
                raise RewardPoolAborted("the reward pool's caller is stopping")
            for w in [w for w in self._threads if w.state is _State.IDLE][: len(queue)]:
                self._send(w, queue, calls, outcomes, resent)
            waiting = [w for w in self._threads if w.state is not _State.IDLE]
            if not waiting or (not queue and not any(w.state is _State.BUSY for w in waiting)):
                break
            self._wait(waiting, outcomes)
        return [o if o is not None else CallOutcome(failure=RewardFailure.CRASHED, detail="lost") for o in outcomes]

    def _set(self, outcomes: list[CallOutcome | None], k: int, outcome: CallOutcome) -> None:
        """Record call k's outcome (after its worker's state is updated) and show it to the caller."""
        outcomes[k] = outcome
        if self._on_outcome is not None:
            self._on_outcome(k, outcome)

    def _send(
        self,
        w: _Worker,
        queue: deque[int],
        calls: Sequence[tuple[int, object]],
        outcomes: list[CallOutcome | None],
        resent: dict[int, int],
    ) -> None:
        k = queue.popleft()
        try:
            w.conn.send((calls[k][0], calls[k][1], self.limits.cpu_s))
        except OSError:  # the worker died while idle: not this call's fault, so it is sent again
            self._replace(w)
            if resent.get(k, 0) >= 3:
                self._set(outcomes, k, CallOutcome(failure=RewardFailure.CRASHED, detail="the worker processes kept dying before the call"))
            else:
                resent[k] = resent.get(k, 0) + 1
                queue.appendleft(k)
            return
        except Exception as exc:  # the payload cannot be pickled (nothing was written)
            self._set(outcomes, k, CallOutcome(failure=RewardFailure.RAISED, detail=f"cannot send the call to a worker: {describe(exc)}"))
            return
        w.state, w.call, w.deadline = _State.BUSY, k, time.monotonic() + self.limits.timeout_s

    def _wait(self, waiting: list[_Worker], outcomes: list[CallOutcome | None]) -> None:
        """Wait for the first answer or deadline among `waiting` (at most _POLL_S), then handle
        every answer that arrived and every deadline that passed."""
        now = time.monotonic()
        nearest = min(w.deadline for w in waiting)
        ready = set(wait([w.conn for w in waiting], timeout=max(0.0, min(nearest - now, _POLL_S))))
        now = time.monotonic()
        for w in waiting:
            if w.conn in ready:
                self._answer(w, outcomes)
            elif w.deadline <= now:
                if w.state is _State.STARTING:
                    self._end(w)
                    raise RewardPoolError(f"a reward worker process did not start within {START_TIMEOUT_S:g} s")
                call = w.call
                self._replace(w)
                self._set(
                    outcomes,
                    call,
                    CallOutcome(
                        failure=RewardFailure.TIMEOUT,
                        detail=f"no result within {self.limits.timeout_s:g} s (task.reward_timeout_s); the worker was killed",
                    ),
                )

    def _answer(self, w: _Worker, outcomes: list[CallOutcome | None]) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            if w.state is _State.STARTING:
                status = self._end(w)
                raise RewardPoolError(f"a reward worker process could not start: {_exit_detail(status, self.limits)}") from None
            call = w.call
            status = self._replace(w)
            self._set(outcomes, call, CallOutcome(failure=RewardFailure.CRASHED, detail=_exit_detail(status, self.limits)))
            return
        if w.state is _State.STARTING:
            self._started_or_raise(w, message)
            return
        kind, payload = message
        call = w.call
        if kind == "oom":  # the worker exits after a MemoryError
            self._replace(w)
            detail = f"out of memory ({payload}; task.reward_memory_mb = {self.limits.memory_mb})"
            self._set(outcomes, call, CallOutcome(failure=RewardFailure.CRASHED, detail=detail))
            return
        w.state, w.call = _State.IDLE, -1
        if kind == "ok":
            self._set(outcomes, call, CallOutcome(value=payload))
        elif kind == "non_finite":
            self._set(outcomes, call, CallOutcome(failure=RewardFailure.NON_FINITE, detail=payload))
        else:  # "raised"
            self._set(outcomes, call, CallOutcome(failure=RewardFailure.RAISED, detail=payload))

    def close(self) -> None:
        """End every worker: idle ones get their connection closed (they exit), the others and any
        still running after a short grace are killed; all are reaped. Idempotent."""
        with self._lock:
            self._closed = True
            workers, self._threads = self._threads, []
        for w in workers:
            with contextlib.suppress(OSError):
                w.conn.close()
            if w.state is not _State.IDLE and w.proc.poll() is None:
                with contextlib.suppress(OSError):
                    w.proc.kill()
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    w.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=10)
        self.output.close()


# -- worker side -------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux), and exit now if the
    parent is already gone."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _address_space_mb() -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _limit_cpu(seconds: float) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if seconds <= 0:
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    limit = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (limit, hard))


def worker_main(fd: int) -> None:
    """A reward worker: import the functions, then answer calls until the connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent ends us
    for stream in (sys.stdout, sys.stderr):  # fd 1 and 2 are a pipe: lines go out as written, not at exit
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    conn = Connection(fd)
    try:
        init = conn.recv()
    except (EOFError, OSError):
        return
    _die_with_parent(int(init["parent_pid"]))
    import resource

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashing reward leaves no core file
    sys.path[:] = list(init["sys_path"])
    try:
        from relayrl.rewards.registry import NonFiniteReward, as_reward, import_function

        fns = [import_function(spec) for spec in init["specs"]]
    except BaseException as exc:
        conn.send(("error", f"importing the reward functions failed: {describe(exc)}"))
        return
    memory_mb = int(init["memory_mb"])
    if memory_mb:
        used = _address_space_mb()
        if used >= memory_mb:
            conn.send(
                (
                    "error",
                    f"task.reward_memory_mb = {memory_mb} is below the address space a reward process uses "
                    f"after importing its functions ({used:.0f} MB)",
                )
            )
            return
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = memory_mb * 2**20 if hard == resource.RLIM_INFINITY else min(memory_mb * 2**20, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    conn.send(("ready", os.getpid()))
    while True:
        try:
            index, payload, cpu_s = conn.recv()
        except (EOFError, OSError):
            return
        out_of_memory = False
        try:
            if cpu_s:
                _limit_cpu(cpu_s)
            reply: tuple[str, object] = ("ok", as_reward(fns[index](payload)))
        except NonFiniteReward as exc:  # an int too large for a float
            reply = ("non_finite", str(exc))
        except MemoryError as exc:
            out_of_memory = True
            reply = ("oom", describe(exc))
        except BaseException as exc:  # SystemExit too: a reward that calls sys.exit() raised
            reply = ("raised", describe(exc))
        finally:
            if cpu_s:
                _limit_cpu(0)
        try:
            conn.send(reply)
        except (OSError, MemoryError):
            return
        if out_of_memory:
            return  # the parent replaces this process
