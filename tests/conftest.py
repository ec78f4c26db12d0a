"""Test environment (offline, no telemetry from third-party libraries) and markers.

Layout: unit/ (single modules, no run of the pipeline, no child process, no Ray), integration/
(programs, the CLI, child processes, the local torch backend end to end), ray/ (starts or joins a
Ray cluster); shared helpers live in support/ (importable as `support.x`: pytest puts this folder,
the one holding this conftest.py, on sys.path).

Markers (registered in pyproject.toml; `--strict-markers` refuses any other):
- `ray`: added here to every test under ray/;
- `vllm`: added here to every test under vllm/ (they need vLLM: `bash scripts/setup.sh --vllm`
  builds .venv-vllm; without vllm installed they are skipped, saying so);
- `torch`: added here to every test of a module that imports torch or transformers, the local
  backend (`relayrl.backends.local`, `run.backend=local`) or the random Qwen2 (support.modelutil);
  written on a test whose child process loads them (the default recipe run through the CLI);
- `slow`: written on the test (`@pytest.mark.slow`): more than ~5 s on a 2-core machine.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

RAY_TESTS = Path(__file__).resolve().parent / "ray"
VLLM_TESTS = Path(__file__).resolve().parent / "vllm"
# vLLM, not the namespace package tests/vllm/ would make of this folder's `vllm` (it has no origin)
_VLLM = importlib.util.find_spec("vllm")
HAS_VLLM = _VLLM is not None and _VLLM.origin is not None
SKIP_VLLM = pytest.mark.skip(reason="vllm is not installed: bash scripts/setup.sh --vllm")
USES_TORCH = re.compile(
    r"^\s*(?:import|from) (?:torch|transformers)\b|importorskip\(\"(?:torch|transformers)\"\)"
    r"|relayrl\.backends\.local\b|run\.backend=local|support\.modelutil",
    re.MULTILINE,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    uses_torch: dict[Path, bool] = {}
    for item in items:
        path = Path(item.path).resolve()
        if RAY_TESTS in path.parents:
            item.add_marker(pytest.mark.ray)
        if VLLM_TESTS in path.parents:
            item.add_marker(pytest.mark.vllm)
            if not HAS_VLLM:
                item.add_marker(SKIP_VLLM)
        if path not in uses_torch:
            uses_torch[path] = USES_TORCH.search(path.read_text(encoding="utf-8")) is not None
        if uses_torch[path]:
            item.add_marker(pytest.mark.torch)
