"""`relayrl train --resume RUN_DIR` of a run that left nothing to resume says so in one line
(exit 2): a directory that does not exist, or a run stopped before it wrote its config (a Ctrl-C
while Ray started)."""

from __future__ import annotations

from pathlib import Path

from support import cli


def _resume(run_dir: Path, cwd: Path) -> tuple[int, list[str]]:
    res = cli.relayrl("train", "--resume", str(run_dir), cwd=cwd, env={"COLUMNS": "160"})
    return res.returncode, res.stderr.strip().splitlines()


def test_resuming_a_missing_run_directory_says_it_does_not_exist(tmp_path: Path) -> None:
    code, lines = _resume(tmp_path / "runs" / "nope", tmp_path)
    assert code == 2
    assert lines == [f"error: nothing to resume: run directory {tmp_path / 'runs' / 'nope'} does not exist"]


def test_resuming_a_run_stopped_before_its_config_says_it_stopped_before_its_first_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "early"
    run_dir.mkdir(parents=True)
    (run_dir / ".relayrl-run").write_text("{}")  # what a run claimed before it was stopped
    code, lines = _resume(run_dir, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: nothing to resume: ") and "stopped before its first step" in lines[0]
