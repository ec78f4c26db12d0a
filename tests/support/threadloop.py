"""An event loop on a thread of its own, for tests whose engines (vLLM's output handler) belong to
the loop of their first call: every test of a module drives them from the same loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Loop:
    """The loop and its thread; `run` runs a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def thread_loop() -> Iterator[Loop]:
    """A module fixture's body: the loop, stopped after the module."""
    looper = Loop()
    yield looper
    looper.close()
