"""The one JSON-lines reader and writer (relayrl.rundir.jsonl): the checkpoint rewind and the report read a
file the same way — a torn last line is dropped by both — and only differ on other damage, which
the rewind refuses (naming file and line) and the report counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from relayrl.analysis.report import read_jsonl
from relayrl.rundir.checkpoint import CheckpointError, ResumePoint, rewind_run_dir
from relayrl.rundir.jsonl import JsonlError, JsonlWriter, append_rows, read_rows, rewrite_rows

ROWS = [{"step": s, "reward_mean": s / 10, "note": "a\u2028b"} for s in range(1, 4)]  # steps are numbered from 1
WHOLE = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS).encode()
TORN = {
    "mid-json": WHOLE + b'{"step": 4, "rew',
    "mid-character": WHOLE + '{"step": 4, "note": "\u2028'.encode()[:-1],
    "trailing blank lines": WHOLE + b'{"step": 4\n\n  \n',
}


def _point(directory: Path, step: int) -> ResumePoint:
    return ResumePoint(
        directory=directory,
        step=step,
        backend="sim",
        prompts_drawn=0,
        in_flight=[],
        ledger={},
        evals=[],
        elapsed_s=0.0,
        reward_mean_first=None,
        metrics_rows=[],
    )


@pytest.mark.parametrize("tail", sorted(TORN))
def test_rewind_and_report_drop_the_same_torn_last_line(tmp_path: Path, tail: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_bytes(TORN[tail])
    (run_dir / "evals.jsonl").write_bytes(b'{"version": 0, "accuracy": 0.5}\n{"version": 1, "acc')
    shutil.copy(run_dir / "metrics.jsonl", tmp_path / "report-copy.jsonl")

    reported, bad = read_jsonl(tmp_path / "report-copy.jsonl")
    assert (reported, bad) == (ROWS, 0)
    assert read_rows(tmp_path / "report-copy.jsonl", strict=True) == (ROWS, 0)

    point = _point(tmp_path / "ckpt", step=3)
    rewind_run_dir(run_dir, point)  # keeps steps 1-3: exactly the rows the report reads
    assert read_jsonl(run_dir / "metrics.jsonl") == (reported, 0)
    assert (run_dir / "metrics.jsonl").read_bytes().endswith(b"}\n")  # the torn line is gone
    assert point.evals == read_jsonl(run_dir / "evals.jsonl")[0] == [{"version": 0, "accuracy": 0.5}]


def test_other_damage_is_counted_by_the_report_and_refused_by_the_rewind(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = WHOLE.split(b"\n")
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join([lines[0], b"{not json", *lines[1:]]))
    assert read_jsonl(run_dir / "metrics.jsonl") == (ROWS, 1)
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl:2: not a JSON line; cannot rewind"):
        rewind_run_dir(run_dir, _point(tmp_path / "ckpt", step=3))
    for damage, message in [(b"[1, 2]", "not a JSON object"), (b"\xff\xfe", r"not UTF-8 text \(byte 0\)"), (b"", "blank line")]:
        path = tmp_path / "damaged.jsonl"
        path.write_bytes(b"\n".join([lines[0], damage, lines[1], b""]))
        with pytest.raises(JsonlError, match=rf"damaged\.jsonl:2: {message}"):
            read_rows(path, strict=True)
        assert read_rows(path, strict=False) == (ROWS[:2], 0 if not damage else 1)


def test_writers_write_whole_compact_lines(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    writer = JsonlWriter(path)
    writer.write_many(ROWS[:1])
    writer.write_many([])
    append_rows(path, ROWS[1:])
    writer.close()
    assert path.read_text(encoding="utf-8").count("\n") == 3
    assert read_rows(path, strict=True) == (ROWS, 0)
    rewrite_rows(path, ROWS[:1])
    assert path.read_text(encoding="utf-8") == '{"step":1,"reward_mean":0.1,"note":"a\\u2028b"}\n'
    assert not (tmp_path / "rows.jsonl.tmp").exists()
