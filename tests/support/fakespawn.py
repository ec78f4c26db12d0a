"""A stand-in for `torch.multiprocessing`'s spawn context (`mp.get_context("spawn")`): its
processes record the arguments they were started with and run nothing, so a test can see what
the sharded trainer gives each rank (its device, its flags) without spawning one."""

from __future__ import annotations

from typing import Any


class FakeProcess:
    """A stand-in for a spawned rank: records its arguments, runs nothing."""

    started: list[tuple[Any, ...]] = []

    def __init__(self, target: Any, args: tuple[Any, ...], name: str, daemon: bool) -> None:
        self.args = args
        self.pid = 1000 + len(FakeProcess.started)
        self.exitcode: int | None = None

    def start(self) -> None:
        FakeProcess.started.append(self.args)

    def join(self, timeout: float | None = None) -> None:
        self.exitcode = 0

    def is_alive(self) -> bool:
        return False

    def kill(self) -> None:
        return None


class FakeContext:
    def __init__(self) -> None:
        import multiprocessing

        self.Pipe = multiprocessing.Pipe
        self.Process = FakeProcess
