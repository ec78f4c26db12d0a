"""Parquet trajectory log: rows match `trajectory_rows`, readers (pyarrow, pandas, polars) see
every complete step, and a crash mid-step leaves only whole step files behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pc = pytest.importorskip("pyarrow.compute")

from relayrl.telemetry.trajlog import ParquetTrajectoryLog, read_trajectories, step_files, trajectory_schema  # noqa: E402
from relayrl.types import FilteredGroup, FilterReason, Group, Prompt, Trajectory, TrajectoryStatus  # noqa: E402


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
    }


def _traj(group_id: int, index: int, version: int, *, reward: float = 0.0, failed: bool = False) -> Trajectory:
    prompt = Prompt(prompt_id=f"p{group_id}", text=f"{group_id} + {index} =", answer=str(group_id + index))
    return Trajectory(
        group_id=group_id,
        sample_index=index,
        prompt=prompt,
        prompt_tokens=[100 + group_id, 7, 8],
        completion_tokens=[200 + index] * (index + 1),
        sampler_logprobs=[-0.5] * (index + 1),
        completion_text=f"answer {index}",
        policy_version=version,
        replica=group_id % 2,
        reward=reward,
        advantage=reward - 0.5,
        status=TrajectoryStatus.FAILED if failed else TrajectoryStatus.OK,
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


def _write_steps(run_dir: Path, steps: range) -> ParquetTrajectoryLog:
    log = ParquetTrajectoryLog(run_dir)
    for step in steps:
        version, trained, filtered = _step(step)
        log.write(step, version, trained, filtered)
    return log


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
    assert [s for s, _ in step_files(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "trajectories" / "step=000002.parquet").is_file()


def test_pandas_reads_the_directory(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    _write_steps(tmp_path, range(1, 3)).close()
    df = pd.read_parquet(tmp_path / "trajectories").sort_values(["step", "group_id", "sample_index"], kind="stable")
    assert len(df) == 12
    assert list(df.columns) == trajectory_schema().names
    assert sorted(df["step"].unique().tolist()) == [1, 2]
    first = df.iloc[0]
    assert list(first["prompt_tokens"]) == [110, 7, 8]
    assert list(first["completion_tokens"]) == [200]
    assert set(df["status"]) == {"ok", "failed", "filtered:zero_variance", "filtered:stale"}


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
    assert step_files(tmp_path) == []
    table = read_trajectories(tmp_path)
    assert table.num_rows == 0 and table.schema == trajectory_schema()
    assert read_trajectories(tmp_path / "no-such-run").num_rows == 0


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    log = _write_steps(tmp_path, range(1, 3))
    version, trained, _ = _step(2)
    log.write(2, version, trained[:1], [])
    table = read_trajectories(tmp_path)
    assert table.filter(pc.equal(table["step"], 2)).num_rows == 1
    assert table.num_rows == 6 + 1


def test_error_mid_write_leaves_earlier_steps_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _write_steps(tmp_path, range(1, 3))

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)  # between the complete temporary and the rename
    version, trained, filtered = _step(3)
    with pytest.raises(OSError, match="No space left"):
        log.write(3, version, trained, filtered)
    assert sorted(p.name for p in (tmp_path / "trajectories").iterdir()) == ["step=000001.parquet", "step=000002.parquet"]
    assert read_trajectories(tmp_path).num_rows == 12


def test_hard_crash_mid_step_loses_only_that_step(tmp_path: Path) -> None:
    """A process killed while writing step 4 (after the temporary is complete, before the rename)
    leaves steps 1–3 readable by every reader; the temporary is never read as data and is
    removed when the log is reopened."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_trajlog import _write_steps, _step
        log = _write_steps(Path({str(tmp_path)!r}), range(1, 4))
        os.replace = lambda src, dst: os._exit(9)  # killed between write and rename
        version, trained, filtered = _step(4)
        log.write(4, version, trained, filtered)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    names = sorted(p.name for p in (tmp_path / "trajectories").iterdir())
    assert names == [".step=000004.parquet.tmp", "step=000001.parquet", "step=000002.parquet", "step=000003.parquet"]

    table = read_trajectories(tmp_path)
    assert sorted(set(table["step"].to_pylist())) == [1, 2, 3]
    assert table.num_rows == 18
    assert pq.read_table(tmp_path / "trajectories").num_rows == 18  # dataset reader skips the hidden temporary
    pd = pytest.importorskip("pandas")
    assert sorted(pd.read_parquet(tmp_path / "trajectories")["step"].unique().tolist()) == [1, 2, 3]

    ParquetTrajectoryLog(tmp_path)  # reopening (e.g. a resumed run) clears the leftover
    assert not list((tmp_path / "trajectories").glob(".*.tmp"))


def test_missing_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"relayrl\[parquet\]"):
        ParquetTrajectoryLog(tmp_path)
    with pytest.raises(ImportError, match="pyarrow"):
        read_trajectories(tmp_path)
