"""The GPU check's sections (relayrl.bench.gpu_check, issue 30) on the CPU: the random Qwen2 built
on `meta` and materialised with `to_empty`, the 0.5B section's code on a tiny shape, the driver
stopping in one line without a GPU, and a section past its bound not stopping the next one."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.bench import gpu_check
from relayrl.bench.gpu_check import QWEN2_TINY, build_random_qwen2, run_check, section_qwen2

ROOT = Path(__file__).resolve().parents[2]


def test_random_qwen2_materialised_from_meta() -> None:
    model = build_random_qwen2(QWEN2_TINY, "cpu")
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == "cpu" for t in tensors) and all(torch.isfinite(t).all() for t in tensors)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as Qwen2.5-0.5B
    reference = Qwen2ForCausalLM(Qwen2Config(**QWEN2_TINY, eos_token_id=1, bos_token_id=2, pad_token_id=0))
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)  # not to_empty's garbage
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    logits = model(torch.tensor([[3, 4, 5, 6]])).logits
    assert logits.shape == (1, 4, QWEN2_TINY["vocab_size"]) and bool(torch.isfinite(logits).all())


def test_qwen2_section_on_cpu(tmp_path: Path) -> None:
    figures = section_qwen2(tmp_path, tiny=True)
    assert figures["train"]["tokens_per_s"] > 0 and figures["decode"]["tokens"] > 0
    # float32, "bfloat16" on float32 masters, and that with activation checkpointing
    assert [(figures[k]["dtype"], figures[k]["gradient_checkpointing"]) for k in ("train", "train_bf16", "train_bf16_checkpointing")] == [
        ("float32", False),
        ("bfloat16", False),
        ("bfloat16", True),
    ]
    assert figures["train_bf16_checkpointing"]["tokens_per_s"] > 0
    export = figures["export"]
    # every parameter is exported (a tied head today as a copy of its own: issue 31's export bytes)
    assert export["param_bytes"] == figures["params"] * 4 and export["bytes"] >= export["param_bytes"] and export["ms"] >= 0


@pytest.mark.slow
def test_without_a_gpu_the_check_stops_after_the_environment(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.bench.gpu_check", "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check: stopped: no usable CUDA GPU") and "need a real GPU" in last
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in report["sections"]] == ["environment"] and report["sections"][0]["status"] == "ok"
    assert report["stopped"] and report["versions"]["torch"] == torch.__version__
    assert report["device"]["nvidia_smi"] == {"error": "nvidia-smi not found"}


@pytest.mark.slow
def test_a_section_past_its_bound_does_not_stop_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    sections = tuple(dataclasses.replace(s, limit_s=0.2) if s.name == "environment" else s for s in gpu_check.SECTIONS)
    monkeypatch.setattr(gpu_check, "SECTIONS", sections)
    code = run_check(tmp_path, budget_s=300, only=["qwen2-0.5b"], mode="test", stop_reason=None, tiny=True)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {s["name"]: s["status"] for s in report["sections"]}
    assert statuses == {"environment": "timeout", "qwen2-0.5b": "ok"} and code == 1
    qwen = next(s for s in report["sections"] if s["name"] == "qwen2-0.5b")
    assert qwen["figures"]["export"]["bytes"] > 0 and qwen["seconds"] > 0 and qwen["limit_s"] == 90
