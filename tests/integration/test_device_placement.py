"""Device placement on the local backend: a device this machine lacks is refused by the command
line in one line (exit 2) before anything runs, each worker gets the device its key names, and
naming the CPU explicitly ("cpu", or "auto" on this GPU-less machine) computes exactly what the
default does."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch

from relayrl.backends.local import build as local_build
from relayrl.backends.registry import build_backend
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from support.cli import relayrl
from support.simutil import run_checked

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")

QUICK = [
    "run.backend=local",
    "task.kind=arithmetic",
    "run.steps=2",
    "rollout.num_generations=4",
    "rollout.groups_per_step=4",
    "rollout.max_staleness=0",
    "task.heldout_size=16",
    "train.learning_rate=1e-3",
    "orchestrator.release_memory=false",
    "orchestrator.log_trajectories=false",
]


@NO_GPU
@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "key"),
    [("train.device=cuda", "train.device = 'cuda'"), ("rollout.device=cuda:1", "rollout.device = 'cuda:1'")],
)
def test_cuda_on_a_cpu_only_machine_exits_2_in_one_line(tmp_path: Path, setting: str, key: str) -> None:
    res = relayrl("train", "--set", setting, "--set", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path, env={"COLUMNS": "200"})
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {key}: this machine has no CUDA device (torch.cuda.is_available() is False"), lines
    assert not (tmp_path / "runs").exists()  # refused before the run directory is made


def test_each_worker_computes_on_the_device_its_key_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process the trainer gets train.device and the samplers and the held-out engine
    rollout.device ("meta" stands for a GPU this machine lacks: nothing computes on it here)."""
    asked: list[tuple[str, str]] = []

    def fake(spec: str, key: str) -> torch.device:
        asked.append((key, spec))
        return torch.device("meta" if spec == "auto" else "cpu")

    monkeypatch.setattr(local_build, "resolve_device", fake)
    for train, rollout in (("auto", "cpu"), ("cpu", "auto")):
        asked.clear()
        cfg = load_config(None, [*QUICK, "rollout.num_samplers=2", f"train.device={train}", f"rollout.device={rollout}"])
        backend = build_backend(cfg, threading.Event(), evaluate=True)
        try:
            assert sorted(asked) == [("rollout.device", rollout), ("train.device", train)]
            want_train, want_rollout = ("meta" if train == "auto" else "cpu"), ("meta" if rollout == "auto" else "cpu")
            trainer = backend.trainer.compute  # type: ignore[attr-defined]
            assert trainer.device.type == want_train
            assert {p.device.type for p in trainer.model.parameters()} == {want_train}
            engines = [*backend.samplers, backend.greedy]
            assert [e.compute.model.device.type for e in engines] == [want_rollout] * 3  # type: ignore[union-attr]
        finally:
            asyncio.run(backend.close())


def _figures(run_dir: Path) -> tuple[list[dict[str, float]], dict[str, object]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keep = ("train/loss", "train/grad_norm", "train/logprob_diff_max", "reward_mean", "completion_tokens_mean")
    summary = json.loads((run_dir / "summary.json").read_text())
    return [{k: r[k] for k in keep if k in r} for r in rows], {k: summary[k] for k in ("accuracy_before", "accuracy_after")}


@pytest.mark.slow
def test_naming_the_cpu_computes_what_the_default_does(tmp_path: Path) -> None:
    """train.device / rollout.device = "cpu" and "auto" (the CPU here) with model.dtype = "auto"
    (float32 here) give the default's figures, step by step."""
    results = []
    for name, extra in (
        ("default", []),
        ("cpu", ["train.device=cpu", "rollout.device=cpu"]),
        ("auto", ["train.device=auto", "rollout.device=auto", "model.dtype=auto"]),
    ):
        cfg = load_config(None, [*QUICK, *extra])
        run_checked(build_program(cfg, run_dir=tmp_path / name), timeout=180)
        results.append(_figures(tmp_path / name))
    assert results[0][0] and all(r == results[0] for r in results[1:]), results
