"""Parquet trajectory log: rows match `trajectory_rows`; files roll by steps and bytes with one row
group per step, named after the steps they hold; readers (pyarrow, pandas, polars) see every step
of the closed files; a crash leaves only complete files behind, losing at most the open file's
steps; cutting the log back to a checkpoint keeps each earlier step exactly once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pc = pytest.importorskip("pyarrow.compute")

from relayrl.rundir.trajfiles import file_name, truncate  # noqa: E402
from relayrl.telemetry.trajlog import (  # noqa: E402
    ParquetTrajectoryLog,
    log_files,
    read_trajectories,
    trajectory_schema,
    trajectory_table,
)
from relayrl.types import FilteredGroup, FilterReason, Group, Prompt, Trajectory  # noqa: E402
from support.cli import run_python  # noqa: E402
from support.trajectories import trajectory  # noqa: E402


# The row semantics the Parquet log must reproduce (the former JSON-lines log's rows).
def trajectory_rows(step: int, trained_version: int, trajs: list[Trajectory], filtered: list[FilteredGroup]) -> list[dict[str, object]]:
    rows = [_row(step, trained_version, t, t.status.value) for t in trajs]
    for item in filtered:
        rows.extend(_row(step, trained_version, t, f"filtered:{item.reason.value}") for t in item.group.trajectories)
    return rows


def _row(step: int, trained_version: int, t: Trajectory, status: str) -> dict[str, object]:
    return {
        "step": step,
        "prompt_id": t.prompt.prompt_id,
        "group_id": t.group_id,
        "sample_index": t.sample_index,
        "prompt": t.prompt.text,
        "completion": t.completion_text,
        "answer": t.prompt.answer,
        "num_tokens": t.num_tokens,
        "reward": t.reward,
        "advantage": t.advantage,
        "policy_version": t.policy_version,
        "staleness": trained_version - t.policy_version,
        "sampler_logprob_sum": sum(t.sampler_logprobs),
        "status": status,
        "error": t.error,
        "replica": t.replica,
        "overlong_penalty": t.overlong_penalty,
        "finish_reason": t.finish_reason,
        "turn_advantages": t.turn_advantages or [],
    }


def _traj(group_id: int, index: int, version: int, *, reward: float = 0.0, failed: bool = False) -> Trajectory:
    return trajectory(
        group=group_id,
        sample=index,
        prompt=Prompt(prompt_id=f"p{group_id}", text=f"{group_id} + {index} =", answer=str(group_id + index)),
        prompt_tokens=[100 + group_id, 7, 8],
        completion_tokens=[200 + index] * (index + 1),
        text=f"answer {index}",
        version=version,
        replica=group_id % 2,
        reward=reward,
        advantage=reward - 0.5,
        failed=failed,
        error="ValueError: bad" if failed else None,
    )


def _step(step: int) -> tuple[int, list[Trajectory], list[FilteredGroup]]:
    """(trained_version, trained trajectories, filtered groups) for a step: one trained group with
    a failed member, one zero-variance group and one stale group."""
    version = step - 1
    trained = [_traj(10 * step, i, version, reward=float(i % 2), failed=(i == 2)) for i in range(3)]
    zero_var = FilteredGroup(
        Group(10 * step + 1, [_traj(10 * step + 1, i, version, reward=1.0) for i in range(2)]), FilterReason.ZERO_VARIANCE
    )
    stale = FilteredGroup(Group(10 * step + 2, [_traj(10 * step + 2, 0, version - 3)]), FilterReason.STALE)
    return version, trained, [zero_var, stale]


def _write_steps(run_dir: Path, steps: range, **limits: Any) -> ParquetTrajectoryLog:
    log = ParquetTrajectoryLog(run_dir, **limits)
    for step in steps:
        version, trained, filtered = _step(step)
        log.write(step, version, trained, filtered)
    return log


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "trajectories").iterdir())


def _steps(table: pyarrow.Table) -> list[int]:
    return sorted(set(table["step"].to_pylist()))


def test_rows_match_trajectory_rows_and_carry_token_lists(tmp_path: Path) -> None:
    log = _write_steps(tmp_path, range(1, 4))
    log.close()
    table = read_trajectories(tmp_path)
    assert table.schema == trajectory_schema()
    assert table.schema.field("prompt_tokens").type == pa.list_(pa.int32())
    assert table.schema.field("completion_tokens").type == pa.list_(pa.int32())

    expected: list[dict[str, object]] = []
    tokens: list[tuple[list[int], list[int]]] = []
    for step in range(1, 4):
        version, trained, filtered = _step(step)
        expected += trajectory_rows(step, version, trained, filtered)
        tokens += [(t.prompt_tokens, t.completion_tokens) for t in trained + [t for f in filtered for t in f.group.trajectories]]
    rows = table.to_pylist()
    assert len(rows) == len(expected) == 3 * 6
    for row, want, (prompt_tokens, completion_tokens) in zip(rows, expected, tokens, strict=True):
        assert {k: row[k] for k in want} == want
        assert row["prompt_tokens"] == prompt_tokens
        assert row["completion_tokens"] == completion_tokens
        assert row["num_tokens"] == len(prompt_tokens) + len(completion_tokens)

    statuses = [r["status"] for r in rows if r["step"] == 2]
    assert statuses == ["ok", "ok", "failed", "filtered:zero_variance", "filtered:zero_variance", "filtered:stale"]
    stale = [r for r in rows if r["status"] == "filtered:stale"]
    assert all(r["staleness"] == 3 for r in stale)
    assert [r["error"] for r in rows if r["status"] == "failed"] == ["ValueError: bad"] * 3
    assert log.rows_written == 18
    # one file for the three steps, named after them, one row group per step
    assert _names(tmp_path) == ["steps-000001-000003.parquet"]
    assert [(f.first, f.last) for f in log_files(tmp_path)] == [(1, 3)]
    meta = pq.ParquetFile(tmp_path / "trajectories" / "steps-000001-000003.parquet").metadata
    assert meta.num_row_groups == 3
    assert [meta.row_group(i).num_rows for i in range(3)] == [6, 6, 6]


def test_files_roll_after_max_steps_and_sort_in_step_order(tmp_path: Path) -> None:
    log = _write_steps(tmp_path, range(0, 8), max_file_steps=3)
    # steps 6 and 7 are in the open file: hidden, not read
    assert _names(tmp_path) == [".steps-000006-open.parquet.tmp", "steps-000000-000002.parquet", "steps-000003-000005.parquet"]
    assert _steps(read_trajectories(tmp_path)) == list(range(6))
    log.close()
    names = ["steps-000000-000002.parquet", "steps-000003-000005.parquet", "steps-000006-000007.parquet"]
    assert _names(tmp_path) == names
    assert [f.path.name for f in log_files(tmp_path)] == names  # name order is step order
    table = read_trajectories(tmp_path)
    assert table["step"].to_pylist() == sorted(table["step"].to_pylist())
    assert _steps(table) == list(range(8)) and table.num_rows == 8 * 6
    log.close()  # closing twice changes nothing
    assert _names(tmp_path) == names


def test_files_roll_after_max_bytes(tmp_path: Path) -> None:
    _write_steps(tmp_path, range(0, 3), max_file_bytes=1).close()  # every step fills a file
    assert _names(tmp_path) == [file_name(s, s) for s in range(3)]
    assert read_trajectories(tmp_path).num_rows == 3 * 6


def test_roll_makes_every_written_step_visible_and_skips_empty_steps(tmp_path: Path) -> None:
    log = _write_steps(tmp_path, range(0, 3))
    log.write(3, 2, [], [])  # no rows: nothing written, the file keeps its name
    log.roll()
    assert _names(tmp_path) == ["steps-000000-000002.parquet"]
    log.roll()  # nothing open: nothing happens
    _, trained, filtered = _step(5)
    log.write(5, 4, trained, filtered)
    log.close()
    assert _names(tmp_path) == ["steps-000000-000002.parquet", "steps-000005-000005.parquet"]


def test_pandas_reads_the_directory(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    _write_steps(tmp_path, range(1, 4), max_file_steps=2).close()  # two files
    df = pd.read_parquet(tmp_path / "trajectories").sort_values(["step", "group_id", "sample_index"], kind="stable")
    assert len(df) == 18
    assert list(df.columns) == trajectory_schema().names
    assert sorted(df["step"].unique().tolist()) == [1, 2, 3]
    first = df.iloc[0]
    assert list(first["prompt_tokens"]) == [110, 7, 8]
    assert list(first["completion_tokens"]) == [200]
    assert set(df["status"]) == {"ok", "failed", "filtered:zero_variance", "filtered:stale"}


def test_pyarrow_dataset_reads_the_directory_and_filters_by_step(tmp_path: Path) -> None:
    ds = pytest.importorskip("pyarrow.dataset")
    _write_steps(tmp_path, range(0, 5), max_file_steps=2).close()  # three files
    dataset = ds.dataset(tmp_path / "trajectories", format="parquet")
    assert dataset.schema == trajectory_schema()
    table = dataset.to_table()
    assert table.num_rows == 5 * 6 and _steps(table) == list(range(5))
    late = dataset.to_table(filter=ds.field("step") >= 3, columns=["step", "status"])
    assert _steps(late) == [3, 4] and late.num_rows == 12


def test_polars_reads_the_glob(tmp_path: Path) -> None:
    pl = pytest.importorskip("polars")
    _write_steps(tmp_path, range(1, 3)).close()
    df = pl.read_parquet(tmp_path / "trajectories" / "*.parquet")
    assert df.height == 12
    assert df.columns == trajectory_schema().names
    assert df.filter(pl.col("status") == "filtered:stale").height == 2
    assert df["completion_tokens"].to_list()[1] == [201, 201]


def test_empty_step_writes_nothing_and_empty_log_reads_empty(tmp_path: Path) -> None:
    log = ParquetTrajectoryLog(tmp_path)
    log.write(1, 0, [], [])
    log.close()
    assert log_files(tmp_path) == [] and _names(tmp_path) == []
    table = read_trajectories(tmp_path)
    assert table.num_rows == 0 and table.schema == trajectory_schema()
    assert read_trajectories(tmp_path / "no-such-run").num_rows == 0


def test_a_step_at_or_before_a_written_one_is_refused(tmp_path: Path) -> None:
    log = _write_steps(tmp_path, range(1, 3))
    version, trained, _ = _step(2)
    with pytest.raises(ValueError, match="trajectory log step 2 written after step 2"):
        log.write(2, version, trained[:1], [])
    log.close()
    assert read_trajectories(tmp_path).num_rows == 12


def test_error_mid_write_discards_only_the_open_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _write_steps(tmp_path, range(1, 5), max_file_steps=2)  # 1-2 closed, 3-4 closed
    version, trained, filtered = _step(5)
    log.write(5, version, trained, filtered)  # open

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", fail)
    version, trained, filtered = _step(6)
    with pytest.raises(OSError, match="No space left.*steps-000005-open"):
        log.write(6, version, trained, filtered)
    monkeypatch.undo()
    assert _names(tmp_path) == ["steps-000001-000002.parquet", "steps-000003-000004.parquet"]  # step 5 went with its file
    log.close()
    assert _steps(read_trajectories(tmp_path)) == [1, 2, 3, 4]


def test_error_at_the_rename_leaves_earlier_files_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _write_steps(tmp_path, range(1, 3), max_file_steps=2)
    _, trained, filtered = _step(3)
    log.write(3, 2, trained, filtered)

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)  # between the complete temporary and the rename
    with pytest.raises(OSError, match="No space left"):
        log.close()
    assert _names(tmp_path) == ["steps-000001-000002.parquet"]
    assert read_trajectories(tmp_path).num_rows == 12


def test_hard_crash_loses_only_the_open_files_steps(tmp_path: Path) -> None:
    """A process killed while its open file holds steps 4 and 5 (the file being written, no
    footer yet) leaves steps 1–3 readable by every reader; the open file is never read as data
    and is removed when the log is reopened."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from test_trajlog import _write_steps
        log = _write_steps(Path({str(tmp_path)!r}), range(1, 6), max_file_steps=3)
        os._exit(9)  # killed: no close
        """
    )
    proc = run_python("-c", script, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert _names(tmp_path) == [".steps-000004-open.parquet.tmp", "steps-000001-000003.parquet"]
    assert (tmp_path / "trajectories" / ".steps-000004-open.parquet.tmp").stat().st_size > 0  # steps 4, 5 were written

    table = read_trajectories(tmp_path)
    assert _steps(table) == [1, 2, 3] and table.num_rows == 18
    assert pq.read_table(tmp_path / "trajectories").num_rows == 18  # dataset reader skips the hidden open file
    pd = pytest.importorskip("pandas")
    assert sorted(pd.read_parquet(tmp_path / "trajectories")["step"].unique().tolist()) == [1, 2, 3]

    ParquetTrajectoryLog(tmp_path)  # reopening (e.g. a resumed run) clears the leftover
    assert _names(tmp_path) == ["steps-000001-000003.parquet"]


def test_truncate_keeps_each_step_before_the_cut_exactly_once(tmp_path: Path) -> None:
    """Cutting at step 5: the file of steps 0–3 stays, the one of steps 4–7 (both sides) is
    rewritten as steps 4–4 with its row group, later files and a leftover open file go."""
    _write_steps(tmp_path, range(0, 12), max_file_steps=4).close()
    _, trained, filtered = _step(12)
    log = ParquetTrajectoryLog(tmp_path)
    log.write(12, 11, trained, filtered)  # left open, as by a kill
    before = read_trajectories(tmp_path)
    truncate(tmp_path, 5)
    assert _names(tmp_path) == ["steps-000000-000003.parquet", "steps-000004-000004.parquet"]
    table = read_trajectories(tmp_path)
    assert _steps(table) == [0, 1, 2, 3, 4]
    assert table.to_pylist() == before.filter(pc.less(before["step"], 5)).to_pylist()
    assert pq.ParquetFile(tmp_path / "trajectories" / "steps-000004-000004.parquet").metadata.num_row_groups == 1
    truncate(tmp_path, 5)  # idempotent
    assert read_trajectories(tmp_path).to_pylist() == table.to_pylist()


def test_truncate_finishes_one_a_kill_interrupted(tmp_path: Path) -> None:
    """A kill between the rewritten file's rename and the old file's removal leaves both: the
    rewind, run again, leaves one copy of each step."""
    _write_steps(tmp_path, range(0, 6)).close()
    directory = tmp_path / "trajectories"
    shutil.copy(directory / "steps-000000-000005.parquet", tmp_path / "whole.parquet")
    truncate(tmp_path, 3)
    shutil.copy(tmp_path / "whole.parquet", directory / "steps-000000-000005.parquet")  # the old file not yet removed
    truncate(tmp_path, 3)
    assert _names(tmp_path) == ["steps-000000-000002.parquet"]
    table = read_trajectories(tmp_path)
    assert _steps(table) == [0, 1, 2] and table.num_rows == 3 * 6


def test_one_file_per_step_logs_of_earlier_versions_are_read_and_cut(tmp_path: Path) -> None:
    directory = tmp_path / "trajectories"
    directory.mkdir()
    for step in range(3):
        version, trained, filtered = _step(step)
        pq.write_table(trajectory_table(step, version, trained, filtered), directory / f"step={step:06d}.parquet")
    assert [(f.first, f.last) for f in log_files(tmp_path)] == [(0, 0), (1, 1), (2, 2)]
    assert _steps(read_trajectories(tmp_path)) == [0, 1, 2]
    truncate(tmp_path, 2)
    assert _names(tmp_path) == ["step=000000.parquet", "step=000001.parquet"]


def test_missing_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"relayrl\[parquet\]"):
        ParquetTrajectoryLog(tmp_path)
    with pytest.raises(ImportError, match="pyarrow"):
        read_trajectories(tmp_path)
