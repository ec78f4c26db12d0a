"""Whether a process runs, by its pid (Linux /proc): for the parts that tell their own leftover
processes, or their files, from a live owner's (agents' subprocesses at a run's end, vLLM weight
files of earlier runs). This module imports no other relayrl module."""

from __future__ import annotations

from pathlib import Path

__all__ = ["alive"]


def alive(pid: int) -> bool:
    """Whether `pid` runs: it exists and is no zombie (a zombie has ended: its parent just has not
    reaped it). Another user's process counts (its /proc stat is readable); none without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    return bool(fields) and fields[0] != "Z"
