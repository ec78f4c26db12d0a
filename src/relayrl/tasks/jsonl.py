"""Prompts from a JSONL file: one JSON object per line with ``prompt``, ``answer``, optional ``id``
and any other fields, which become the prompt's ``metadata`` (what a reward function may read).

Job: validate the file up front and serve its rows as `Prompt`s — an endless training stream that
cycles over the rows (shuffled per epoch with a seed, or in file order) and a held-out split (the
last k rows, or a separate file).

Invariants:
- Bad input never half-loads: any problem (unreadable file, not UTF-8, invalid JSON, a row that
  is not an object, a missing field, a wrong type, an unpaired surrogate, a duplicate id, no
  rows) raises one `TaskDataError` whose message names the file and the 1-based row (the line
  number; lines end at "\\n" only) and what is wrong.
- Training item ``i`` is a pure function of (rows, seed, i): each epoch visits every training row
  exactly once, so the stream resumes from a cursor.
- Training and held-out rows never overlap when the split takes the last k rows.
"""

from __future__ import annotations

import codecs
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from relayrl.errors import UserError
from relayrl.tasks.epochs import EpochCycle
from relayrl.types import Prompt


class TaskDataError(UserError):
    """A prompt file cannot be used; the message names the file, the row and the problem."""


@dataclass(slots=True, frozen=True)
class JsonlTaskConfig:
    """Where the prompts come from and how they are split and ordered."""

    path: Path
    heldout_path: Path | None = None  # a separate held-out file ...
    heldout_last: int = 0  # ... or the last k rows of `path` (not both)
    shuffle: bool = True  # reshuffle the training rows every epoch
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.heldout_path is not None:
            object.__setattr__(self, "heldout_path", Path(self.heldout_path))
        if self.heldout_last < 0:
            raise UserError(f"jsonl.heldout_last must be >= 0, got {self.heldout_last}")
        if self.heldout_path is not None and self.heldout_last:
            raise UserError("jsonl: set heldout_path or heldout_last, not both")


_FIELDS = ("prompt", "answer", "id")  # a row's other fields are the prompt's metadata
_JSON_WHITESPACE = " \t\r"  # what may surround a JSON value on a row besides the "\n" that ends it


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _answer_text(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TaskDataError(f"{where}: field 'answer' must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise TaskDataError(f"{where}: field 'answer' must be finite, got {value!r}")
    return str(value)


def load_jsonl_prompts(path: str | os.PathLike[str], id_prefix: str | None = None) -> list[Prompt]:
    """Read and validate every row of a JSONL prompt file.

    Rows end at ``"\\n"`` only; blank ones are skipped; rows are numbered by their 1-based line
    number. A UTF-8 byte-order mark is ignored. ``prompt`` must be a
    non-empty string; ``answer`` a string or a number (numbers become ``str(value)``); ``id``, if
    present, a string or an integer, unique in the file. Rows without ``id`` get
    ``"<id_prefix>-<row>"`` (``id_prefix`` defaults to the file's stem). Every other field is
    kept, as parsed, in the prompt's ``metadata``.
    """
    p = Path(path)
    prefix = id_prefix if id_prefix is not None else p.stem
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise TaskDataError(f"{p}: cannot read prompt file: {e.strerror or e}") from e
    raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark some editors write
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        row = raw[: e.start].count(b"\n") + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise TaskDataError(f"{p}, row {row}: not valid UTF-8 (byte {col} of the row: {e.reason})") from e

    prompts: list[Prompt] = []
    first_row_of_id: dict[str, int] = {}
    # Rows end at "\n" only (a "\r" before it is JSON whitespace): JSON strings may hold raw
    # U+2028, U+2029, U+0085, which str.splitlines() would take for line breaks, and since "\n"
    # alone ends a row, raw control characters (\t, \x0c, ...) are taken inside strings too.
    for row, line in enumerate(content.split("\n"), start=1):
        if not line.strip(_JSON_WHITESPACE):
            continue
        where = f"{p}, row {row}"
        try:
            obj: object = json.loads(line, strict=False)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
        except (ValueError, RecursionError) as e:  # an integer too long to convert; nesting too deep
            raise TaskDataError(f"{where}: invalid JSON ({_one_line(e) if isinstance(e, ValueError) else 'nested too deeply'})") from e
        if not isinstance(obj, dict):
            raise TaskDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for key in ("prompt", "answer"):
            if key not in obj:
                raise TaskDataError(f"{where}: missing field {key!r}")
        text = obj["prompt"]
        if not isinstance(text, str):
            raise TaskDataError(f"{where}: field 'prompt' must be a string, got {type(text).__name__}")
        if not text:
            raise TaskDataError(f"{where}: field 'prompt' is empty")
        answer = _answer_text(obj["answer"], where)
        for key, value in (("prompt", text), ("answer", answer), ("id", obj.get("id"))):
            if isinstance(value, str) and not _encodable(value):
                raise TaskDataError(f"{where}: field {key!r} holds an unpaired surrogate escape (\\ud800-\\udfff), not text")
        raw_id = obj.get("id")
        if raw_id is None:
            prompt_id = f"{prefix}-{row}"
        elif isinstance(raw_id, str) or (isinstance(raw_id, int) and not isinstance(raw_id, bool)):
            prompt_id = str(raw_id)
        else:
            raise TaskDataError(f"{where}: field 'id' must be a string or an integer, got {type(raw_id).__name__}")
        if prompt_id in first_row_of_id:
            raise TaskDataError(f"{where}: duplicate id {prompt_id!r} (first used in row {first_row_of_id[prompt_id]})")
        first_row_of_id[prompt_id] = row
        metadata = {k: v for k, v in obj.items() if k not in _FIELDS}
        prompts.append(Prompt(prompt_id=prompt_id, text=text, answer=answer, metadata=metadata))
    if not prompts:
        raise TaskDataError(f"{p}: no prompts (the file is empty or has only blank lines)")
    return prompts


class JsonlTask:
    """Prompts of a JSONL file: ``stream()`` for training, ``heldout(n)`` for evaluation."""

    __slots__ = ("config", "train_prompts", "heldout_prompts", "_cycle")

    def __init__(self, config: JsonlTaskConfig) -> None:
        self.config: JsonlTaskConfig = config
        rows = load_jsonl_prompts(config.path)
        heldout: list[Prompt] = []
        if config.heldout_path is not None:
            heldout = load_jsonl_prompts(config.heldout_path)
        elif config.heldout_last:
            if config.heldout_last >= len(rows):
                raise TaskDataError(f"{config.path}: heldout_last={config.heldout_last} leaves no training rows (the file has {len(rows)})")
            rows, heldout = rows[: -config.heldout_last], rows[-config.heldout_last :]
        self.train_prompts: tuple[Prompt, ...] = tuple(rows)
        self.heldout_prompts: tuple[Prompt, ...] = tuple(heldout)
        self._cycle = EpochCycle(self.train_prompts, f"jsonl:{config.seed}" if config.shuffle else None)

    def train_prompt(self, index: int) -> Prompt:
        """Training item number ``index`` (epoch ``index // rows``; random access for resuming)."""
        return self._cycle.prompt_at(index)

    def stream(self, start: int = 0) -> Iterator[Prompt]:
        """Endless training prompts from item ``start`` on, cycling over the training rows."""
        return self._cycle.stream(start)

    def heldout(self, n: int | None = None) -> list[Prompt]:
        """The first ``n`` held-out prompts (all of them when ``n`` is None); fixed order."""
        if n is None:
            return list(self.heldout_prompts)
        if n < 0:
            raise ValueError(f"heldout size must be >= 0, got {n}")
        if n > len(self.heldout_prompts):
            raise TaskDataError(f"{self.config.path}: {n} held-out prompts requested, {len(self.heldout_prompts)} available")
        return list(self.heldout_prompts[:n])
