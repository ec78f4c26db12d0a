"""Counting host synchronisations: the calls that make the host wait for the device.

`HostSyncCounter` is a `TorchFunctionMode` that counts, in the thread that enters it, every call
of `Tensor.__bool__`, `item`, `tolist`, `__int__`, `__float__`, `__index__`, `nonzero` (method or
function), `cpu` and `numpy`: on a CUDA device each of these waits for the work queued before it.
The mode sees all of them at the Python level (torch 2.x routes Tensor methods, dunders included,
through `__torch_function__`), so no method needs monkeypatching; what runs inside an operator in
C++ (e.g. `torch.multinomial`'s own input check) is not seen.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.overrides import TorchFunctionMode

SYNC_CALLS = frozenset({"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"})


class HostSyncCounter(TorchFunctionMode):
    """`with HostSyncCounter() as c: ...`, then `c.total` and `c.counts` (call name -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNC_CALLS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
