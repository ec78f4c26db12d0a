"""`relayrl bench engines` on the tiny model only, one short repeat: both engines report figures."""

from __future__ import annotations

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.bench.engines import run_engines

pytestmark = pytest.mark.slow


def test_bench_engines_reports_both_engines_side_by_side() -> None:
    figures = run_engines(models=("tiny",), repeats=1, versions=1)
    tiny = figures["tiny"]
    assert isinstance(tiny, dict) and tiny["load"] == [64, 16, 4]
    for engine in ("hf", "vllm"):
        f = tiny[engine]
        assert f["tokens_per_s"] > 0 and f["weight_load_s"] > 0 and f["startup_s"] > 0, (engine, f)
