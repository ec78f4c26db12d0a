"""The reward workers' stdout and stderr, captured at the OS level and kept within a cap.

Job: own one pipe whose write end every reward worker process gets as its fd 1 and fd 2 (the
pool passes `write_fd` to subprocess, which dup2s it in the child, so C-level writes and the
worker's own subprocesses are captured too), and one reader thread ("relayrl-reward-output")
that copies what arrives to the log file (the run directory's reward_workers.log) up to
`cap_bytes`, then writes one line saying the cap was reached and discards the rest. Without a log
file (a run without a run directory: the Python API, bench, tests) the first `CONSOLE_CAP_BYTES`
go to this process's stderr and the rest is discarded.

Invariants:
- A worker never blocks on its output for longer than the reader takes to read a chunk: the
  reader keeps reading (and discarding past the cap) until `close()`.
- The log file never holds more than `cap_bytes` of output (a resumed run's earlier output
  counts), plus its header line and a cap line per run segment that reached the cap; it is
  created only when something was written. A log that cannot be written (disk full) is said once
  on the console, and the output is discarded from then on.
- The console hears of the log once, at its first write (where it is and its cap), and once more
  if the cap is reached.
- Nothing is started until a worker needs the pipe; `close()` (after the workers are reaped)
  drains what is left for at most `_DRAIN_S`, ends and joins the thread, and closes the pipe.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, TextIO

#: what reward_workers.log keeps of the workers' output
LOG_CAP_BYTES = 10 * 1024 * 1024
#: what a run without a run directory shows of it on stderr
CONSOLE_CAP_BYTES = 64 * 1024
_CHUNK = 64 * 1024
_POLL_S = 0.1
_DRAIN_S = 1.0


def _size(cap: int) -> str:
    return f"{cap // (1024 * 1024)} MiB" if cap >= 1024 * 1024 else f"{cap // 1024} KiB"


class WorkerOutput:
    """The reward workers' captured output: `write_fd()` for each worker, `close()` at the end."""

    def __init__(self, log_path: Path | None, cap_bytes: int = LOG_CAP_BYTES, console: TextIO | None = None) -> None:
        self.log_path = log_path
        self.cap_bytes = cap_bytes if log_path is not None else min(cap_bytes, CONSOLE_CAP_BYTES)
        self._console = console
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._file: BinaryIO | None = None
        self.kept = 0  # bytes of output kept (in the log, a resumed run's included, or on stderr)
        self._cap_said = False
        self._broken = False  # the log cannot be written: everything is discarded
        self.discarded = 0  # bytes read past the cap

    def write_fd(self) -> int:
        """The pipe's write end, for a worker's stdout and stderr (the reader starts on first use)."""
        if self._pipe is None:
            read_fd, write_fd = os.pipe()  # neither end is inherited by other children
            self._pipe = (read_fd, write_fd)
            self._thread = threading.Thread(target=self._read, args=(read_fd,), name="relayrl-reward-output", daemon=True)
            self._thread.start()
        return self._pipe[1]

    def _say(self, line: str) -> None:
        print(f"relayrl: {line}", file=self._console or sys.stderr, flush=True)

    def _read(self, read_fd: int) -> None:
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        drain_until: float | None = None
        try:
            while True:
                if not poller.poll(_POLL_S * 1000):
                    if self._stop.is_set():
                        return
                    continue
                data = os.read(read_fd, _CHUNK)
                if not data:
                    return
                try:
                    self._take(data)
                except Exception:  # never leave the workers writing to a pipe nobody reads: discard from now on
                    self._broken = True
                if self._stop.is_set():  # something still writes: drain for a bounded time only
                    drain_until = drain_until or time.monotonic() + _DRAIN_S
                    if time.monotonic() > drain_until:
                        return
        finally:
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()

    def _take(self, data: bytes) -> None:
        if self._broken:
            self.discarded += len(data)
            return
        try:
            if self.log_path is not None and self._file is None:
                self._open()
            room = self.cap_bytes - self.kept
            head = data[: max(0, room)]
            if head:
                self._write(head)
                self.kept += len(head)
            if len(head) < len(data):
                self.discarded += len(data) - len(head)
                if not self._cap_said:
                    self._capped()
        except OSError as exc:  # the log's disk is full, its directory gone, ...: the rest is discarded, said once
            self._broken = True
            self.discarded += len(data)
            self._say(f"reward workers' output is no longer kept: {exc}")

    def _write(self, head: bytes) -> None:
        if self._file is not None:
            self._file.write(head)
            self._file.flush()
            return
        if self.kept == 0:
            self._say(f"reward workers' output follows (its first {_size(self.cap_bytes)}; no run directory)")
        view = memoryview(head)
        while view:
            view = view[os.write(2, view) :]

    def _open(self) -> None:
        assert self.log_path is not None
        existing = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._file = open(self.log_path, "ab")  # noqa: SIM115 (closed by the reader thread)
        if existing == 0:
            self._file.write(f"# relayrl: the reward workers' stdout and stderr; the first {_size(self.cap_bytes)} are kept\n".encode())
        self.kept = min(self.cap_bytes, existing)  # a resumed run's earlier output counts
        self._say(f"reward workers' output goes to {self.log_path} (its first {_size(self.cap_bytes)})")

    def _capped(self) -> None:
        self._cap_said = True
        line = f"reward workers' output reached its cap of {_size(self.cap_bytes)}; the rest is discarded"
        if self._file is not None:
            self._file.write(f"\n# relayrl: {line}\n".encode())
            self._file.flush()
            self._say(f"{self.log_path}: {line}")
        else:
            self._say(line)

    def close(self) -> None:
        """End the reader (after draining what is left, bounded) and close the pipe. Call it after
        the workers are reaped. Idempotent."""
        if self._pipe is None:
            return
        read_fd, write_fd = self._pipe
        self._pipe = None
        with contextlib.suppress(OSError):
            os.close(write_fd)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError):
            os.close(read_fd)
