"""The command line as a user drives it: train (sim), check-trace, report, runs; bad input exits 2
with one line naming what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "160"}


def relayrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relayrl.cli", *args], cwd=cwd, capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("cli")
    res = relayrl("train", "--backend", "sim", "--set", "task.kind=synthetic", "--set", "run.steps=5", "--set", "run.name=cli-sim", cwd=cwd)
    assert res.returncode == 0, res.stderr
    assert "step 5/5" in res.stdout and "done: 5 steps" in res.stdout
    return cwd


def test_train_writes_a_run_that_checks_reports_and_lists(trained: Path) -> None:
    run_dir = trained / "runs" / "cli-sim"
    assert json.loads((run_dir / "summary.json").read_text())["steps_completed"] == 5
    check = relayrl("check-trace", str(run_dir), cwd=trained)
    assert check.returncode == 0 and "5 committed steps" in check.stdout
    report = relayrl("report", str(run_dir), cwd=trained)
    assert report.returncode == 0 and (run_dir / "report.html").exists()
    listing = relayrl("runs", cwd=trained)
    assert listing.returncode == 0
    assert "cli-sim" in listing.stdout and "completed" in listing.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "rollout.num_gens=3"], "error: unknown config key 'rollout.num_gens' (from --set)"),
        (["--set", "train.learning_rate=-1"], "error: invalid config key 'train.learning_rate' (from --set)"),
        (["--set", "task.kind=jsonl", "--set", "task.path=missing.jsonl"], "missing.jsonl"),
        (["--set", "model.path=no-such-model-dir"], "no-such-model-dir"),
        (["--set", 'task.reward_functions=["nope"]'], "task.reward_functions[0]: unknown reward function 'nope'"),
        (["no-such-recipe.toml"], "config file not found: no-such-recipe.toml"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    res = relayrl("train", *args, cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing half-written


def test_bad_jsonl_row_is_named(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\n')
    res = relayrl("train", "--backend", "sim", "--set", "task.kind=jsonl", "--set", "task.path=data.jsonl", cwd=tmp_path)
    assert res.returncode == 2 and "data.jsonl, row 2: missing field 'answer'" in res.stderr
