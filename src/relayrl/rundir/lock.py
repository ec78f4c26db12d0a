"""The run directory's ownership: what relayrl may create, lock and delete.

A run directory is relayrl's when it holds the marker file `.relayrl-run`, written when relayrl
creates or first claims it. While a run (or a resume) uses the directory it holds an exclusive
`flock` on that marker and keeps its holder (pid, host, start time, command) in it; the lock goes
with the process, so a process killed with SIGKILL releases it and a reader can tell a live run
from a dead one.

Invariant: relayrl deletes a directory's contents only while holding its lock and only when the
marker proves the directory is a relayrl run directory; anything else is refused with a
`RunDirError` (a ValueError: the command line exits 2) naming the path and the reason. The
marker itself is never deleted, so the lock is never taken on a file another run may recreate.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from relayrl.errors import UserError

MARKER = ".relayrl-run"


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Name `path` in an OSError raised by a write to it (a file object's write on a full disk
    or past a file-size limit raises one without a file name)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


class RunDirError(UserError):
    """The run directory cannot be used: it is not relayrl's, or another run holds it."""


def holder_of(run_dir: Path) -> str:
    """Who holds (or last held) `run_dir`, as written in its marker; "" when unknown."""
    try:
        info = json.loads((run_dir / MARKER).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return ""
    if not isinstance(info, dict) or "pid" not in info:
        return ""
    return f"pid {info.get('pid')} on {info.get('host', '?')}, started {info.get('started', '?')}"


def is_live(run_dir: Path) -> bool | None:
    """True when a process holds `run_dir`'s lock now, False when none does, None when the
    directory has no marker (written by an older relayrl, or not a run directory)."""
    try:
        fh = open(run_dir / MARKER, "rb")
    except FileNotFoundError:
        return None
    except OSError:
        return None
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True
            raise
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        return False


class RunDirLock:
    """An exclusive claim on one run directory for the life of a run. `acquire` creates the
    directory (and its parents) when missing; `release` (idempotent) gives the lock back."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._fh: IO[str] | None = None

    def acquire(self, *, adopt: bool = False) -> None:
        """Lock the directory. An existing non-empty directory without the marker is refused
        unless `adopt` (a resume of a run written before markers existed)."""
        run_dir = self.run_dir
        if run_dir.exists() and not run_dir.is_dir():
            raise RunDirError(f"run directory {run_dir} is a file, not a directory")
        marker = run_dir / MARKER
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if not marker.exists() and any(run_dir.iterdir()) and not adopt:
                raise RunDirError(
                    f"{run_dir} is not empty and is not a relayrl run directory (no {MARKER} marker): "
                    "relayrl will not delete it; choose another run.name or run.output_dir"
                )
            fh = open(marker, "a+", encoding="utf-8")
        except (FileExistsError, NotADirectoryError) as exc:
            raise RunDirError(f"cannot create run directory {run_dir}: {exc.strerror} ({exc.filename})") from None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            fh.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = holder_of(run_dir)
                raise RunDirError(
                    f"run directory {run_dir} is in use by another run ({who or 'holder unknown'}); "
                    "wait for it to end or choose another run.name"
                ) from None
            raise
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv),
        }
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(info) + "\n")
        fh.flush()
        self._fh = fh

    def clear(self) -> None:
        """Delete everything in the held directory except the marker (a fresh run replacing an
        old one). Only allowed while holding the lock of a directory that has the marker."""
        if self._fh is None:
            raise RuntimeError(f"{self.run_dir}: clear() without holding the run directory's lock")
        for entry in self.run_dir.iterdir():
            if entry.name == MARKER:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def release(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()

    def __del__(self) -> None:
        self.release()
