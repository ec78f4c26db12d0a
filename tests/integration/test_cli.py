"""The command line as a user drives it: train (sim), check-trace, report, runs; bad input exits 2
with one line naming what is wrong."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from support import cli

WIDE = {"COLUMNS": "160"}  # one line per error, whatever the terminal


def relayrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return cli.relayrl(*args, cwd=cwd, env=WIDE)


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
        pytest.param(["--set", "model.path=no-such-model-dir"], "no-such-model-dir", marks=pytest.mark.slow),
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


def test_runs_piped_prints_whole_values(trained: Path) -> None:
    """stdout is a pipe here (capture_output) and the terminal narrow: no value is cut."""
    from relayrl.analysis.runlist import RUN_COLUMNS, run_figures, runs_cells

    res = cli.relayrl("runs", cwd=trained, env={"COLUMNS": "40"})
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout
    header, row = res.stdout.splitlines()
    assert header.split() == " ".join(RUN_COLUMNS.values()).split()
    expected = runs_cells([run_figures(trained / "runs" / "cli-sim")])[1]
    assert row.split() == expected
    assert header.index("samples/s") + len("samples/s") == row.index(expected[4]) + len(expected[4])  # right-aligned


BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Block())
sys.argv = ["relayrl", *sys.argv[1:]]
from relayrl.cli.main import main
main()
"""


@pytest.mark.parametrize(
    ("module", "args", "extra"),
    [
        ("transformers", [], "local"),  # the default recipe: local backend
        ("torch", ["--set", "task.kind=synthetic"], "local"),
        ("wandb", ["--backend", "sim", "--set", 'telemetry.sinks=["wandb"]'], "wandb"),
        ("tensorboardX", ["--backend", "sim", "--set", 'telemetry.sinks=["tensorboard"]'], "tensorboard"),
        ("mlflow", ["--backend", "sim", "--set", 'telemetry.sinks=["mlflow"]'], "mlflow"),
    ],
)
def test_missing_extra_exits_2_naming_it(tmp_path: Path, module: str, args: list[str], extra: str) -> None:
    code = BLOCK.format(module=module)
    res = cli.run_python("-c", code, "train", *args, cwd=tmp_path, env=WIDE)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and repr(module) in lines[0]
    assert f"pip install 'relayrl[{extra}]'" in lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()


def test_a_stalled_run_ends_in_one_error_line_with_its_traceback_kept(tmp_path: Path) -> None:
    """A run that fails for a reason without a handler of its own (here the stall watchdog: a
    reward that never returns, bounded only far beyond the stall timeout) prints one error line
    naming the exception, no traceback; the traceback is in RUN_DIR/error.txt."""
    (tmp_path / "hang.py").write_text("import time\n\ndef reward(t):\n    time.sleep(3600)\n    return 0.0\n")
    sets = ["task.kind=synthetic", "task.reward_functions=['hang.py:reward']", "task.reward_timeout_s=600"]
    sets += ["orchestrator.stall_timeout_s=2", "run.name=stalls"]
    res = relayrl("train", "--backend", "sim", *[a for s in sets for a in ("--set", s)], cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    run_dir = tmp_path / "runs" / "stalls"
    assert errors == [f"error: StallError: {errors[0].split(': ', 2)[2]}"] and "orchestrator.stall_timeout_s = 2" in errors[0]
    assert "(traceback in runs/stalls/error.txt)" in errors[0]
    assert "Traceback (most recent call last)" in (run_dir / "error.txt").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
