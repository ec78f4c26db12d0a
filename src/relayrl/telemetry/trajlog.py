"""Parquet trajectory log: one row per trajectory (trained, failed and filtered alike), a few
files per run in `<run_dir>/trajectories/`, one row group per step.

Layout (rundir/trajfiles.py names and lists the files): a closed file is
`steps-FFFFFF-LLLLLL.parquet`, holding the rows of steps FFFFFF to LLLLLL (its first and last step
with rows; names sort in step order). The file being written is hidden,
`.steps-FFFFFF-open.parquet.tmp`, and renamed to its final name when it is closed: after
`MAX_FILE_BYTES` (64 MiB) or `MAX_FILE_STEPS` (32) steps with rows, whichever comes first, when a
checkpoint follows the step (`roll`), and when the run ends (`close`). A step with no rows adds
nothing. The directory is a Parquet dataset with the same columns in every file:
`pandas.read_parquet(run_dir / "trajectories")`, `pyarrow.dataset.dataset(...)`,
`polars.read_parquet(".../trajectories/*.parquet")` and DuckDB's `read_parquet('.../*.parquet')`
read the whole log (all skip the hidden open file), as does `read_trajectories(run_dir)`; a
filter on `step` skips row groups by their statistics.

Invariant: every visible file is complete and readable, at any moment: the open file is written
under its hidden name and renamed (after its footer is written and it is fsynced) only when
closed. A crash or kill -9 therefore loses at most the steps of the open file — never a step a
checkpoint claims: the bookkeeper rolls the file after each step a checkpoint follows, before
that checkpoint is written, so the open file only ever holds steps after the newest checkpoint,
which a resume trains and logs again (rundir/checkpoint.py `rewind_run_dir` cuts the log back to
the checkpoint, so the resumed run's log holds each step once); a run without checkpoints
loses at most `MAX_FILE_STEPS` steps' rows (and no metrics row). An error while writing a step
discards the open file the same way. Temporaries left by a kill are removed when the log is
opened. The log is written in the bookkeeping part `log_trajectories` (telemetry/stepbook.py: the
bookkeeping thread, off the event loop); a step costs one row group, and a file one footer and
one fsync when it is closed. Rows of a step, in the order `trajectory_table` builds them: the step's trajectories with
their own status, then each filtered group's trajectories with status "filtered:<reason>"
(tests/integration/test_trajlog.py checks them against a plain-Python model of these rows).
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from relayrl.rundir.lock import writing
from relayrl.rundir.trajfiles import COMPRESSION, TRAJECTORY_DIR, LogFile, file_name, log_files, open_name, remove_temporaries
from relayrl.types import FilteredGroup, Trajectory

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_FILE_STEPS",
    "TRAJECTORY_DIR",
    "LogFile",
    "ParquetTrajectoryLog",
    "log_files",
    "read_trajectories",
    "trajectory_schema",
    "trajectory_table",
]

MAX_FILE_BYTES = 64 * 2**20  # a file is closed once it holds this many bytes ...
MAX_FILE_STEPS = 32  # ... or this many steps (row groups), whichever comes first
_TURNS = operator.attrgetter("turns")


def _require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the Parquet trajectory log needs pyarrow, which is not installed; install it with: pip install 'relayrl[parquet]'"
        ) from exc


def trajectory_schema() -> pa.Schema:
    """Column names and types of the trajectory log (`trajectory_table` fills them)."""
    _require_pyarrow()
    import pyarrow as pa

    return pa.schema(
        [
            ("step", pa.int64()),
            ("prompt_id", pa.string()),
            ("group_id", pa.int64()),
            ("sample_index", pa.int32()),
            ("prompt", pa.string()),
            ("completion", pa.string()),
            ("answer", pa.string()),
            ("num_tokens", pa.int32()),
            ("prompt_tokens", pa.list_(pa.int32())),
            ("completion_tokens", pa.list_(pa.int32())),
            ("reward", pa.float64()),
            ("advantage", pa.float64()),
            ("policy_version", pa.int64()),
            ("staleness", pa.int64()),
            ("sampler_logprob_sum", pa.float64()),
            ("status", pa.string()),
            ("error", pa.string()),
            ("replica", pa.int32()),
            # multi-turn episodes: policy turns (0: a single completion) and each turn's version
            ("turns", pa.int32()),
            ("turn_versions", pa.list_(pa.int32())),
            # reward shaping (algorithms/shaping.py): DAPO's overlong penalty, already in `reward`;
            # and why the completion ended ("stop" or "length": cut at the token limit)
            ("overlong_penalty", pa.float64()),
            ("finish_reason", pa.string()),
            # algorithm.turn_discount: each policy turn's advantage (empty: one advantage for all)
            ("turn_advantages", pa.list_(pa.float64())),
        ]
    )


def _rows(trajectories: list[Trajectory], filtered: list[FilteredGroup]) -> Iterator[tuple[Trajectory, str]]:
    for t in trajectories:
        yield t, t.status.value
    for item in filtered:
        status = f"filtered:{item.reason.value}"
        for t in item.group.trajectories:
            yield t, status


def _token_lists(lists: list[list[int]]) -> pa.Array:
    import pyarrow as pa

    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(np.fromiter(map(len, lists), dtype=np.int64, count=len(lists)))  # < 2**31 tokens per step
    values = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def trajectory_table(step: int, trained_version: int, trajectories: list[Trajectory], filtered: list[FilteredGroup]) -> pa.Table:
    """One step's rows as a table with `trajectory_schema()`."""
    _require_pyarrow()
    import pyarrow as pa

    pairs = list(_rows(trajectories, filtered))
    ts = [t for t, _ in pairs]
    turns: object = np.zeros(len(ts), dtype=np.int32)  # single completions: no turns, nothing built per trajectory
    turn_versions: list[list[int]] = [[]] * len(ts)
    if any(map(_TURNS, ts)):  # multi-turn episodes
        turns = [len(t.turns) for t in ts]
        turn_versions = [[turn.policy_version for turn in t.turns] for t in ts]
    columns: dict[str, object] = {
        "step": [step] * len(ts),
        "prompt_id": [t.prompt.prompt_id for t in ts],
        "group_id": [t.group_id for t in ts],
        "sample_index": [t.sample_index for t in ts],
        "prompt": [t.prompt.text for t in ts],
        "completion": [t.completion_text for t in ts],
        "answer": [t.prompt.answer for t in ts],
        "num_tokens": [t.num_tokens for t in ts],
        "prompt_tokens": _token_lists([t.prompt_tokens for t in ts]),
        "completion_tokens": _token_lists([t.completion_tokens for t in ts]),
        "reward": [t.reward for t in ts],
        "advantage": [t.advantage for t in ts],
        "policy_version": [t.policy_version for t in ts],
        "staleness": [trained_version - t.policy_version for t in ts],
        "sampler_logprob_sum": [float(sum(t.sampler_logprobs)) for t in ts],
        "status": [status for _, status in pairs],
        "error": [t.error for t in ts],
        "replica": [t.replica for t in ts],
        "turns": turns,
        "turn_versions": _token_lists(turn_versions),
        "overlong_penalty": [t.overlong_penalty for t in ts],
        "finish_reason": [t.finish_reason for t in ts],
        "turn_advantages": [t.turn_advantages or [] for t in ts],
    }
    schema = trajectory_schema()
    arrays = [c if isinstance(c, pa.Array) else pa.array(c, type=schema.field(name).type) for name, c in columns.items()]
    return pa.Table.from_arrays(arrays, schema=schema)


@dataclass(slots=True)
class _OpenFile:
    """The file being written: its hidden path, the writer, the steps it holds so far."""

    tmp: Path
    writer: pq.ParquetWriter
    first: int
    last: int
    steps: int = 0


class ParquetTrajectoryLog:
    """Writes `<run_dir>/trajectories/`: each step's rows as one row group of the open file, which
    is closed and renamed to `steps-FFFFFF-LLLLLL.parquet` when full (`max_file_bytes`,
    `max_file_steps`), on `roll` and on `close`.

    Called from the bookkeeping thread, in step order (a step at or before one already written
    is refused); a step with no trajectories and no filtered groups writes nothing. Temporaries
    left by an earlier crash are removed when the log is opened.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        compression: str = COMPRESSION,
        fsync: bool = True,
        max_file_bytes: int = MAX_FILE_BYTES,
        max_file_steps: int = MAX_FILE_STEPS,
    ) -> None:
        _require_pyarrow()
        if max_file_bytes < 1 or max_file_steps < 1:
            raise ValueError(f"max_file_bytes={max_file_bytes} and max_file_steps={max_file_steps} must be ≥ 1")
        self.directory = run_dir / TRAJECTORY_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        self.fsync = fsync
        self.max_file_bytes = max_file_bytes
        self.max_file_steps = max_file_steps
        self.rows_written = 0
        self._open: _OpenFile | None = None
        self._last_step: int | None = None
        remove_temporaries(self.directory)

    def write(self, step: int, trained_version: int, trajectories: list[Trajectory], filtered: list[FilteredGroup]) -> None:
        """Append `step`'s rows to the open file (opening one if none is), then close the file if
        it is full. On an error the open file is discarded (its steps lost, as by a kill)."""
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"{self.directory}: trajectory log step {step} written after step {self._last_step}")
        self._last_step = step
        table = trajectory_table(step, trained_version, trajectories, filtered)
        if table.num_rows == 0:
            return
        current = self._open if self._open is not None else self._start(step)
        try:
            with writing(current.tmp):
                current.writer.write_table(table, row_group_size=table.num_rows)  # one row group per step
        except BaseException:
            self._discard()
            raise
        current.last = step
        current.steps += 1
        self.rows_written += table.num_rows
        if current.steps >= self.max_file_steps or current.tmp.stat().st_size >= self.max_file_bytes:
            self.roll()

    def roll(self) -> None:
        """Close the open file (footer, fsync) and rename it to `steps-FFFFFF-LLLLLL.parquet`:
        every step written so far is then in a complete, visible file. Nothing when none is open."""
        current, self._open = self._open, None
        if current is None:
            return
        final = self.directory / file_name(current.first, current.last)
        try:
            with writing(final):
                current.writer.close()
                if self.fsync:
                    fd = os.open(current.tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                os.replace(current.tmp, final)
        except BaseException:
            current.tmp.unlink(missing_ok=True)
            raise

    def close(self) -> None:
        """Close the open file (`roll`): when this returns, every written step is in a visible file."""
        self.roll()

    def _start(self, step: int) -> _OpenFile:
        import pyarrow.parquet as pq

        tmp = self.directory / open_name(step)
        try:  # a path, not a Python file object: pyarrow writes it natively, never through the GIL
            writer = pq.ParquetWriter(str(tmp), trajectory_schema(), compression=self.compression)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._open = _OpenFile(tmp, writer, step, step)
        return self._open

    def _discard(self) -> None:
        current, self._open = self._open, None
        if current is None:
            return
        try:
            current.writer.close()
        except Exception:  # the file is being thrown away
            pass
        finally:
            current.tmp.unlink(missing_ok=True)


def read_trajectories(run_dir: Path) -> pa.Table:
    """Every step's rows in step order as one table (an empty table with the schema if none)."""
    _require_pyarrow()
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = trajectory_schema()
    tables = [pq.read_table(f.path, schema=schema) for f in log_files(run_dir)]
    return pa.concat_tables(tables) if tables else schema.empty_table()
