"""Parquet trajectory log: one row per trajectory (trained, failed and filtered alike), one file
per step at `<run_dir>/trajectories/step=000123.parquet`.

Invariant: a step's file appears whole or not at all — it is written to a hidden temporary name
(`.step=000123.parquet.tmp`), fsynced and atomically renamed — so a crash loses at most the step
being written, and every `step=*.parquet` file is complete and readable. The directory is a
Parquet dataset: `pd.read_parquet(dir)` and `pl.read_parquet(dir / "*.parquet")` read it
(both skip the hidden temporaries), as does `read_trajectories(run_dir)`. Rows, in the order
`trajectory_table` builds them: the step's trajectories with their own status, then each filtered
group's trajectories with status "filtered:<reason>" (tests/test_trajlog.py checks them against a
plain-Python model of these rows). Rewriting a step (a resumed run re-booking it) replaces that
step's file.
"""

from __future__ import annotations

import itertools
import operator
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from relayrl.rundir.lock import writing
from relayrl.types import FilteredGroup, Trajectory

if TYPE_CHECKING:
    import pyarrow as pa

TRAJECTORY_DIR = "trajectories"
_TURNS = operator.attrgetter("turns")
_FILE_RE = re.compile(r"^step=(\d+)\.parquet$")
_TMP_GLOB = ".step=*.parquet.tmp"


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
    }
    schema = trajectory_schema()
    arrays = [c if isinstance(c, pa.Array) else pa.array(c, type=schema.field(name).type) for name, c in columns.items()]
    return pa.Table.from_arrays(arrays, schema=schema)


def step_file(directory: Path, step: int) -> Path:
    return directory / f"step={step:06d}.parquet"


class ParquetTrajectoryLog:
    """Writes `<run_dir>/trajectories/step=NNNNNN.parquet`, one file per step with rows.

    Called from the bookkeeping thread; a step with no trajectories and no filtered groups writes
    no file. Temporaries left by an earlier crash are removed when the log is opened.
    """

    def __init__(self, run_dir: Path, *, compression: str = "zstd", fsync: bool = True) -> None:
        _require_pyarrow()
        self.directory = run_dir / TRAJECTORY_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        self.fsync = fsync
        self.rows_written = 0
        for stale in self.directory.glob(_TMP_GLOB):
            stale.unlink(missing_ok=True)

    def write(self, step: int, trained_version: int, trajectories: list[Trajectory], filtered: list[FilteredGroup]) -> None:
        import pyarrow.parquet as pq

        table = trajectory_table(step, trained_version, trajectories, filtered)
        if table.num_rows == 0:
            return
        final = step_file(self.directory, step)
        tmp = final.with_name(f".{final.name}.tmp")
        try:
            with writing(final), open(tmp, "wb") as fh:
                pq.write_table(table, fh, compression=self.compression)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.rows_written += table.num_rows

    def close(self) -> None:
        """Nothing is buffered (each step's file is complete when `write` returns); kept so the
        log is closed like any other writer."""


def step_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete step file, in step order; temporaries are not listed."""
    directory = run_dir / TRAJECTORY_DIR
    found: list[tuple[int, Path]] = []
    if directory.is_dir():
        for path in directory.iterdir():
            match = _FILE_RE.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
    return sorted(found)


def read_trajectories(run_dir: Path) -> pa.Table:
    """Every step's rows in step order as one table (an empty table with the schema if none)."""
    _require_pyarrow()
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = trajectory_schema()
    tables = [pq.read_table(path, schema=schema) for _, path in step_files(run_dir)]
    return pa.concat_tables(tables) if tables else schema.empty_table()
