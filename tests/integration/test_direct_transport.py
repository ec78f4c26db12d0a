"""rollout.weight_transport = "direct" (issue 31 §1): in one process, a local run's samplers
copy the trainer's committed snapshot into their models with nothing staged in host memory
beyond it, and the run's trace passes check-trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.analysis.timeline import spans
from relayrl.backends.transports import STAGED
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from support.simutil import run_checked

pytestmark = pytest.mark.torch


def test_a_direct_run_passes_check_trace_and_stages_nothing(tmp_path: Path) -> None:
    sets = [
        "run.backend=local",
        "run.steps=2",
        "eval.enabled=false",
        "rollout.num_generations=2",
        "rollout.groups_per_step=2",
        "rollout.num_samplers=2",
        "rollout.weight_transport=direct",
        "orchestrator.release_memory=false",
    ]
    before = STAGED.read()
    result = run_checked(build_program(load_config(None, sets), run_dir=tmp_path / "run"), timeout=120)
    syncs = [s for s in spans(result.tracer.events) if s.name == "weight_sync"]
    assert {s.args["version"] for s in syncs} == {1, 2}  # each commit reached the replicas
    assert STAGED.read() == before  # no byte staged in host memory: device to device (here CPU to CPU) copies only
