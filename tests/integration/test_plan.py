"""`relayrl plan` (relayrl.plan): the fitted cost model recovers a sim run's configured costs;
the command predicts with spreads (--json), sweeps (table + PNG), checks a prediction against the
run that followed (plan-check.json, shown by the report); plan-model.json round-trips and scales;
a missing or foreign run directory gets one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from relayrl.errors import UserError
from relayrl.orchestrator.build import build_program
from relayrl.plan.fit import fit_model, load_model, scale
from relayrl.plan.source import read_source
from support import cli
from support.simutil import sim_config

# large enough that the event loop's own latency on a busy machine (a few ms) stays under 5%
COSTS = {"generate_base": 0.1, "generate_per_request": 0.04, "train_step": 0.2, "optim_step": 0.1, "weight_sync": 0.08}


def relayrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return cli.relayrl(*args, cwd=cwd, env={"COLUMNS": "160"})


def _sim_run(root: Path, name: str, *sets: str) -> Path:
    cfg = sim_config(
        "task.kind=synthetic",
        "run.steps=8",
        "rollout.groups_per_step=4",
        "rollout.prompts_per_request=2",
        "algorithm.dynamic_sampling=true",
        *(f"sim.{k}={v}" for k, v in COSTS.items()),
        f"run.output_dir={root}",
        f"run.name={name}",
        *sets,
    )
    asyncio.run(build_program(cfg, run_dir=root / name).run())
    return root / name


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _sim_run(tmp_path_factory.mktemp("plan"), "source")


def test_the_fitted_model_recovers_the_sim_runs_configured_costs(source: Path) -> None:
    run = read_source(source)
    model = fit_model(run)
    assert model.contention["cpu"] < 0.05  # the sim's devices are sleeps: nobody slows anybody
    generations = run.cfg.rollout.num_generations
    generated = [s for s in run.spans if s.name == "generate"]  # each call's decode rows and passes, as the fit reads them
    assert generated and all(s.args["sequences"] == s.args["n"] * generations for s in generated)  # type: ignore[operator]
    assert all(1 <= s.args["steps"] <= run.cfg.rollout.max_new_tokens for s in generated)  # type: ignore[operator]
    for n in (1, 2):  # a generate call of n groups
        fitted = model.generate.cost(n * generations, run.cfg.rollout.max_new_tokens)
        configured = COSTS["generate_base"] + COSTS["generate_per_request"] * n
        assert abs(fitted / configured - 1) < 0.05, (n, fitted, configured)
    sizes = [int(s.args["tokens"]) for s in run.spans if s.name == "train_step"]  # type: ignore[call-overload]
    for tokens in (min(sizes), max(sizes)):
        assert abs(model.train_step.cost(tokens) / COSTS["train_step"] - 1) < 0.05, tokens
    assert abs(model.optim_step_s / COSTS["optim_step"] - 1) < 0.05
    assert abs(model.load_s / COSTS["weight_sync"] - 1) < 0.05  # a sync round: the export, loads are free


def test_plan_json_predicts_the_source_with_spreads_and_writes_the_model(source: Path, tmp_path: Path) -> None:
    res = relayrl("plan", str(source), "--json", "--seeds", "2", "--out", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    predicted, measured = result["predicted"], result["measured"]
    for key in ("samples_per_s", "trainer_busy_fraction", "step_time_s", "staleness_mean", "sync_round_s"):
        assert set(predicted[key]) == {"mean", "std", "min", "max"}, key
        assert predicted[key]["min"] <= predicted[key]["mean"] <= predicted[key]["max"]
    assert predicted["seeds"] == 2 and predicted["staleness"]
    # the source's own configuration is predicted close to what it measured
    assert abs(predicted["samples_per_s"]["mean"] / measured["samples_per_s"] - 1) < 0.2
    assert abs(predicted["trainer_busy_fraction"]["mean"] - measured["trainer_busy_fraction"]) < 0.1
    assert (
        load_model(tmp_path / "plan-model.json").train_step.per_token_s > 0
        or load_model(tmp_path / "plan-model.json").train_step.base_s > 0
    )


def test_a_sweep_prints_a_table_and_draws_a_png(source: Path, tmp_path: Path) -> None:
    res = relayrl(
        "plan", str(source), "--sweep", "rollout.num_samplers=1,2", "--seeds", "1", "--steps", "3", "--out", str(tmp_path), cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2 and all("±" in row for row in rows)
    assert (tmp_path / "plan-sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_prints_each_figures_error_and_the_report_shows_it(source: Path, tmp_path: Path) -> None:
    target = _sim_run(tmp_path, "target", "rollout.max_staleness=0")
    res = relayrl("plan", "--check", str(source), str(target), "--seeds", "1", "--out", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for label in ("samples/s", "trainer busy %", "step time ms", "staleness mean", "sync round ms"):
        assert label in res.stdout
    check = json.loads((target / "plan-check.json").read_text())
    assert check["source"] == str(source)
    errors = check["errors"]
    assert errors["staleness_mean"]["measured"] == 0.0 and errors["staleness_mean"]["predicted"] == 0.0  # staleness 0 is exact
    rate = errors["samples_per_s"]
    assert rate["error"] == pytest.approx((rate["predicted"] - rate["measured"]) / rate["measured"])
    assert relayrl("report", str(target), cwd=tmp_path).returncode == 0
    assert "Planned from another run" in (target / "report.html").read_text()


def test_a_missing_or_foreign_run_directory_gets_one_line(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    for path, words in ((tmp_path / "nowhere", "run directory not found"), (foreign, "not a relayrl run directory")):
        res = relayrl("plan", str(path), cwd=tmp_path)
        assert res.returncode == 2
        assert res.stderr.strip().count("\n") == 0 and words in res.stderr and str(path) in res.stderr


def test_the_model_file_round_trips_and_scales(source: Path, tmp_path: Path) -> None:
    model = fit_model(read_source(source))
    path = model.write(tmp_path / "plan-model.json")
    assert load_model(path) == model
    faster = scale(scale(model, "train", 0.25), "generate", 0.5)
    assert faster.train_step.cost(1000) == pytest.approx(model.train_step.cost(1000) * 0.25)
    assert faster.optim_step_s == pytest.approx(model.optim_step_s * 0.25)
    assert faster.generate.cost(500, 4) == pytest.approx(model.generate.cost(500, 4) * 0.5)
    assert faster.scaled == {"train": 0.25, "generate": 0.5}
    # through the command: an edited model read back with --model, scaled, written to --out
    out = tmp_path / "out"
    out.mkdir()
    res = relayrl(
        "plan", str(source), "--model", str(path), "--scale", "train=0.25", "--seeds", "1", "--steps", "2", "--out", str(out), cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert load_model(out / "plan-model.json").train_step.cost(1000) == pytest.approx(model.train_step.cost(1000) * 0.25)
    bad = relayrl("plan", str(source), "--scale", "gpu=2", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown work 'gpu'" in bad.stderr
    raw = json.loads(path.read_text())
    raw["nonsense"] = 1
    path.write_text(json.dumps(raw))
    with pytest.raises(UserError, match="unknown field 'nonsense'"):
        load_model(path)
