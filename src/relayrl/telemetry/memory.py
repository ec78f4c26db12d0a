"""Memory release between steps: a young-heap garbage collection and glibc's malloc_trim.

Invariant: after `freeze_long_lived()` (called once set-up is done, and again after the first
step, which imports and caches lazily) a collection only walks objects created since, so it costs
milliseconds instead of ~150 ms of GIL-holding work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable

_malloc_trim: Callable[[int], int] | None = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _malloc_trim = _libc.malloc_trim
except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
    _malloc_trim = None


def freeze_long_lived() -> None:
    gc.collect()
    gc.freeze()


def release_memory(trim: bool = True) -> None:
    gc.collect()
    if trim and _malloc_trim is not None:
        _malloc_trim(0)
