"""The trajectory log's files in `<run_dir>/trajectories/`: their names, listing them, and cutting
the log back to a checkpoint when a run resumes (telemetry/trajlog.py writes and reads the rows).

A closed file is `steps-FFFFFF-LLLLLL.parquet`: the rows of steps FFFFFF to LLLLLL (first and last
step with rows, zero-padded, so names sort in step order), one row group per step. The file being
written is hidden (`.steps-FFFFFF-open.parquet.tmp`) and renamed when it is closed; readers
(pyarrow datasets, pandas) skip hidden files. `step=NNNNNN.parquet` files (one step each, written
before the log rolled files) are listed as one-step files.

Invariant: every listed file is complete (its footer written); `truncate` leaves every step
before the cut in exactly one listed file and no row of a later step, and a kill while it runs
leaves it to be done again (it is idempotent).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

TRAJECTORY_DIR = "trajectories"
COMPRESSION = "zstd"
_FILE_RE = re.compile(r"^steps-(\d+)-(\d+)\.parquet$")
_LEGACY_RE = re.compile(r"^step=(\d+)\.parquet$")  # one file per step (earlier versions)
_TMP_GLOB = ".*.parquet.tmp"  # the open file, a truncation in progress, an earlier version's temporary


@dataclass(frozen=True, slots=True)
class LogFile:
    """A complete file of the log and the steps it holds (`first` to `last`, both with rows)."""

    first: int
    last: int
    path: Path


def file_name(first: int, last: int) -> str:
    return f"steps-{first:06d}-{last:06d}.parquet"


def open_name(first: int) -> str:
    """The hidden name of the file being written, whose first step is `first`."""
    return f".steps-{first:06d}-open.parquet.tmp"


def log_files(run_dir: Path) -> list[LogFile]:
    """Every complete file of `run_dir`'s log, in step order; hidden temporaries are not listed."""
    directory = run_dir / TRAJECTORY_DIR
    found: list[LogFile] = []
    if directory.is_dir():
        for path in directory.iterdir():
            if match := _FILE_RE.match(path.name):
                found.append(LogFile(int(match.group(1)), int(match.group(2)), path))
            elif match := _LEGACY_RE.match(path.name):
                found.append(LogFile(int(match.group(1)), int(match.group(1)), path))
    return sorted(found, key=lambda f: (f.first, f.last, f.path.name))


def remove_temporaries(directory: Path) -> None:
    """Remove the hidden temporaries a killed writer or truncation left in `directory`."""
    for stale in directory.glob(_TMP_GLOB):
        stale.unlink(missing_ok=True)


def truncate(run_dir: Path, next_step: int) -> None:
    """Drop every row of a step ≥ `next_step` from the log: a file of later steps only is removed,
    a file holding steps on both sides is rewritten with the earlier ones (renamed after its new
    last step, the old file removed after the new one is in place)."""
    directory = run_dir / TRAJECTORY_DIR
    if not directory.is_dir():
        return
    remove_temporaries(directory)
    for f in log_files(run_dir):
        if f.first >= next_step:
            f.path.unlink()
        elif f.last >= next_step:
            _rewrite_before(f, next_step)


def _rewrite_before(f: LogFile, next_step: int) -> None:
    """`f` without its rows of steps ≥ `next_step`, each row group kept as it was otherwise."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tmp = f.path.with_name(f".{f.path.name}.cut.parquet.tmp")
    last = f.first
    try:
        with pq.ParquetFile(f.path) as source, open(tmp, "wb") as fh:
            with pq.ParquetWriter(fh, source.schema_arrow, compression=COMPRESSION) as writer:
                for index in range(source.num_row_groups):
                    group = source.read_row_group(index)
                    kept = group.filter(pc.less(group["step"], next_step))
                    if kept.num_rows:
                        writer.write_table(kept, row_group_size=kept.num_rows)
                        last = max(last, int(pc.max(kept["step"]).as_py()))
            fh.flush()
            os.fsync(fh.fileno())
        final = f.path.with_name(file_name(f.first, last))
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if final != f.path:
        f.path.unlink()
