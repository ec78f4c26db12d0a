"""Runs of the default recipe with `rollout.engine = "vllm"` (the local trainer, one vLLM sampler
replica in this process): the sampler's log-probs agree with the trainer's at staleness 0, and a
run stopped after a step and resumed trains exactly what the uninterrupted run trains."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.recipes import default_recipe
from support.simutil import StopAt, Stopped, event_args, run_checked

pytestmark = pytest.mark.slow

SETS = [
    "rollout.engine=vllm",
    "rollout.temperature=0.7",
    "rollout.top_p=1.0",
    "rollout.max_staleness=0",
    "run.steps=4",
    "rollout.groups_per_step=8",
    "rollout.prompts_per_request=8",
    "eval.enabled=false",
    "orchestrator.checkpoint_every=1",
    "train.torch_threads=1",
    "train.learning_rate=1e-3",
    "train.warmup_steps=0",
]


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("vllm") / "whole"
    run_checked(build_program(load_config(default_recipe(), SETS), run_dir=run_dir), timeout=600)
    return run_dir


@pytest.fixture(scope="module")
def whole(whole_dir: Path) -> list[dict[str, Any]]:
    return _rows(whole_dir)


def test_at_staleness_0_the_engines_logprobs_are_the_trainers(whole: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    for row in whole:
        assert row["train/logprob_diff_max"] < 1e-3, (row["step"], row["train/logprob_diff_max"])


def test_a_vllm_run_stopped_and_resumed_matches_the_uninterrupted_run(tmp_path: Path, whole: list[dict[str, Any]]) -> None:
    run_dir = tmp_path / "crash2"
    with pytest.raises(Stopped, match="stopped at step 2"):
        asyncio.run(build_program(load_config(default_recipe(), SETS), [StopAt(2)], run_dir=run_dir).run())
    run_checked(build_program(load_config(default_recipe(), SETS), run_dir=run_dir, resume=True), timeout=600)
    resumed = _rows(run_dir)
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    for a, b in zip(whole, resumed, strict=True):
        for key in ("reward_mean", "reward_std", "tokens", "train/completion_tokens", "num_trajectories"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-5), a["step"]


def test_the_vllm_engine_loads_the_runs_exported_model(whole_dir: Path) -> None:
    """The finished run's `model/` (models/export.py) starts a vLLM engine whose prompt log-probs
    equal a torch forward of the exported model within 1e-4."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from relayrl.backends.vllm.engine import EngineSettings
    from relayrl.backends.vllm.sampler import VllmSampler

    export = whole_dir / "model"
    tokenizer = AutoTokenizer.from_pretrained(export)
    prompt = [int(i) for i in tokenizer("47-18=29", add_special_tokens=False)["input_ids"]] + [tokenizer.eos_token_id]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ref = [float(logp[i - 1, t]) for i, t in enumerate(prompt) if i > 0]

    async def engine_logprobs() -> list[float]:
        sampler = VllmSampler(EngineSettings(model=str(export), max_model_len=128), temperature=1.0, max_new_tokens=1, seed=0)
        try:
            final = None
            params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
            async for out in sampler.engine.generate({"prompt_token_ids": prompt}, params, "export-probe"):
                final = out
            assert final is not None and final.prompt_logprobs is not None
            return [float(step[t].logprob) for t, step in zip(prompt[1:], final.prompt_logprobs[1:], strict=True)]
        finally:
            await sampler.close()

    got = asyncio.run(engine_logprobs())
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-4


def test_a_vllm_run_with_interruptible_loads_passes_the_checker(tmp_path: Path) -> None:
    """rollout.interruptible at max_staleness 1 on the vLLM engine: loads run beside generate
    calls (run info `interruptible`), and the run completes, balanced and checked (staleness
    counted by each trajectory's oldest token; whether a load lands inside a generation depends
    on timing here, tests/vllm/test_vllm_sampler.py forces one)."""
    from relayrl.analysis.timeline import spans

    sets = [s for s in SETS if not s.startswith(("rollout.max_staleness=", "run.steps=", "orchestrator.checkpoint_every="))]
    sets += ["rollout.max_staleness=1", "rollout.interruptible=true", "run.steps=3"]
    result = run_checked(build_program(load_config(default_recipe(), sets), run_dir=tmp_path / "run"), timeout=600)
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == 3 * 8
    info = [event_args(e) for e in result.tracer.events if e.get("name") == "relayrl_run"]
    assert info and info[0]["interruptible"] is True
    for s in spans(result.tracer.events):
        if s.name == "generate" and s.lane.startswith("sampler/") and "versions" in s.args:
            versions = s.args["versions"]
            assert isinstance(versions, list) and s.args["version"] == min(versions)


def test_a_run_with_the_file_transport_passes_the_checker_and_stages_its_files(tmp_path: Path) -> None:
    """rollout.weight_transport = "file" (issue 31 §1), set explicitly: each version reaches the
    engine through its safetensors file (counted as bytes staged in host memory: written and read
    back), and the run's trace passes check-trace."""
    from relayrl.backends.transports import STAGED

    sets = [s for s in SETS if not s.startswith(("run.steps=", "orchestrator.checkpoint_every="))]
    sets += ["run.steps=2", "rollout.weight_transport=file"]
    before = STAGED.read()
    result = run_checked(build_program(load_config(default_recipe(), sets), run_dir=tmp_path / "run"), timeout=600)
    assert result.ledger.as_dict()["groups_trained"] == 2 * 8
    assert STAGED.read() > before  # the files written (the worker's reads count in its own process)


def test_a_run_with_the_collective_transport_loads_every_version_through_vllms_weight_transfer_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.weight_transport = "collective" with two vLLM replicas in this process (issue 31 §1,
    relayrl.backends.vllm.broadcast): every version is broadcast to both engines (no weight file
    written, no group failure warned), and at staleness 0 each engine's log-probs are the
    trainer's, step after step, as with the file transport."""
    import warnings

    from relayrl.backends.vllm import sampler as vllm_sampler
    from relayrl.backends.vllm.broadcast import WeightGroupWarning

    files: list[int] = []
    write = vllm_sampler._write_weights

    def counted(state: dict[str, Any], replica: int) -> str:
        files.append(replica)
        return write(state, replica)

    monkeypatch.setattr(vllm_sampler, "_write_weights", counted)

    sets = [s for s in SETS if not s.startswith(("run.steps=", "orchestrator.checkpoint_every="))]
    sets += ["run.steps=3", "rollout.weight_transport=collective", "rollout.num_samplers=2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_checked(build_program(load_config(default_recipe(), sets), run_dir=tmp_path / "run"), timeout=600)
    assert not [w for w in caught if issubclass(w.category, WeightGroupWarning)], [str(w.message) for w in caught]
    assert files == []  # (the file transport writes one per replica and version)
    assert result.ledger.as_dict()["groups_trained"] == 3 * 8
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/logprob_diff_max"] < 1e-3, (row["step"], row["train/logprob_diff_max"])
