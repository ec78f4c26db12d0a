"""JSON-lines files (metrics.jsonl, evals.jsonl, config_changes.jsonl): the one writer and the one
reader; and the atomic replacement of a whole file (config.toml, summary.json).

Writing: every row is one line of compact JSON ended by "\\n". `JsonlWriter` (held open, for
metrics.jsonl) and `append_rows` (open, append, close) write a batch of whole lines in one write
followed by a flush, so a crash loses at most the line being written; `rewrite_rows` and
`write_text_atomic` write a temporary file and rename it over the old one, so a reader sees the
old file or the new one, never a mix. An OSError names the file (rundir.writing).

Reading (`read_rows`): rows end at "\\n" only (str.splitlines() would also split a JSON string at
a raw U+2028 or \\x0c); trailing blank lines are ignored. A last line that does not decode or
parse is the line a writer or a kill interrupted (a torn write) and is dropped silently. Any other
bad line (not UTF-8, not JSON, not a JSON object, or blank) is damage: `strict=True` raises a
`JsonlError` (a ValueError) naming the file and line; `strict=False` skips it and counts it (the
report, which must show a damaged run rather than refuse it; it skips blank lines uncounted).

Invariant: a torn last line is the only damage either mode forgives silently, so both modes return
the same rows for a file whose only damage is a torn last line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from relayrl.errors import UserError
from relayrl.rundir.lock import writing

Row = dict[str, object]


class JsonlError(UserError):
    """A JSON-lines file is damaged beyond a torn last line."""


def _lines(rows: Iterable[Row]) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


class JsonlWriter:
    """An append-only JSON-lines file held open for the run (metrics.jsonl)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: IO[str] = open(path, "a", encoding="utf-8")

    def write_many(self, rows: list[Row]) -> None:
        if rows:
            with writing(self.path):
                self._fh.write(_lines(rows))
                self._fh.flush()

    def close(self) -> None:
        with writing(self.path):
            self._fh.close()


def append_rows(path: Path, rows: Iterable[Row]) -> None:
    """Append whole lines to `path` (created if absent), in one write."""
    text = _lines(rows)
    if text:
        with writing(path), open(path, "a", encoding="utf-8") as fh:
            fh.write(text)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: a temporary file renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(tmp):
            tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def rewrite_rows(path: Path, rows: Iterable[Row]) -> None:
    """Replace `path` with exactly `rows`, atomically."""
    write_text_atomic(path, _lines(rows))


def read_rows(path: Path, *, strict: bool) -> tuple[list[Row], int]:
    """The rows of `path` and the number of damaged lines skipped (always 0 when `strict`, which
    raises JsonlError on the first instead). A torn last line is dropped in both modes."""
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    rows: list[Row] = []
    bad = 0
    last = len(lines)
    for number, raw in enumerate(lines, 1):
        try:
            text = raw.decode("utf-8") if strict else raw.decode("utf-8", errors="replace")
        except UnicodeDecodeError as exc:
            if number == last:  # a kill cut the line inside a character
                break
            raise JsonlError(f"{path}:{number}: not UTF-8 text (byte {exc.start})") from None
        if not text.strip():
            if strict:
                raise JsonlError(f"{path}:{number}: blank line")
            continue
        try:
            value: object = json.loads(text.strip())
        except ValueError:
            if number == last:  # the line a writer or a kill interrupted
                break
            if strict:
                raise JsonlError(f"{path}:{number}: not a JSON line") from None
            bad += 1
            continue
        if isinstance(value, dict):
            rows.append(value)
        elif strict:
            raise JsonlError(f"{path}:{number}: not a JSON object")
        else:
            bad += 1
    return rows, bad
