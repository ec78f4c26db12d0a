"""Append-only JSON-lines files (metrics.jsonl).

Invariant: each write is a whole line followed by a flush, so a crash loses at most the line being
written, and a reader never sees a half-written record except possibly the last line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from relayrl.rundir import writing


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: IO[str] = open(path, "a", encoding="utf-8")

    def write_many(self, rows: list[dict[str, object]]) -> None:
        if rows:
            with writing(self.path):
                self._fh.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
                self._fh.flush()

    def close(self) -> None:
        with writing(self.path):
            self._fh.close()
