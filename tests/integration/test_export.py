"""A model users can load: a finished local run writes RUN_DIR/model/ (run.save_model), `relayrl
export` writes any checkpoint's policy, and either loads with `AutoModelForCausalLM` and gives the
trainer's greedy outputs; `relayrl train --set model.path=EXPORT` starts where the run ended; bad
exports are refused in one line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from relayrl.config.schema import load_config
from relayrl.models.export import MARKER, MODEL_STATE, ExportError, ModelSaveFailed, export_run
from relayrl.models.loading import greedy_completions, load_model_and_tokenizer, shipped_model_dir
from relayrl.orchestrator.build import build_program
from relayrl.rundir.checkpoint import checkpoint_dir, load_resume_point
from relayrl.rundir.lock import RunDirError
from relayrl.tasks.build import build_task
from support.cli import relayrl
from support.simutil import run_checked, sim_config

STEPS = 3
LOCAL = [
    "run.backend=local",
    "task.kind=arithmetic",
    "task.heldout_size=48",
    "rollout.num_generations=4",
    "rollout.groups_per_step=4",
    "rollout.max_staleness=0",
    "train.learning_rate=0.002",  # a few steps visibly change the policy
    "orchestrator.release_memory=false",
    "eval.max_new_tokens=4",
]
HF_FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json", MARKER}


def _run(run_dir: Path, *overrides: str) -> None:
    cfg = load_config(None, [*LOCAL, f"run.steps={STEPS}", *overrides])
    run_checked(build_program(cfg, run_dir=run_dir), timeout=180)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step local run with checkpoints after steps 2 and 3 (and its model/)."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    _run(run_dir, "orchestrator.checkpoint_every=2")
    return run_dir


def _trainer_model(run_dir: Path, step: int) -> PreTrainedModel:
    """The trainer's policy after `step`: the checkpoint's state loaded into the model it trained."""
    model, _ = load_model_and_tokenizer(shipped_model_dir())
    state = torch.load(checkpoint_dir(run_dir, step) / "trainer.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    return model


def _heldout(run_dir: Path) -> list[str]:
    return [p.text for p in build_task(load_config(run_dir / "config.toml")).heldout]


def _evals(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]


def test_a_finished_run_writes_a_model_that_reproduces_the_trainers_greedy_outputs(trained: Path) -> None:
    model_dir = trained / "model"
    assert HF_FILES <= {p.name for p in model_dir.iterdir()}
    assert not any(p.name.startswith(".") for p in trained.iterdir() if p.name != ".relayrl-run")  # no staging left
    assert json.loads((model_dir / MARKER).read_text())["step"] == STEPS
    exported = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    trainer = _trainer_model(trained, STEPS)
    base, base_tokenizer = load_model_and_tokenizer(shipped_model_dir())
    for name, value in trainer.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, rtol=0, atol=0)
    assert any(not torch.equal(value, base.state_dict()[name]) for name, value in trainer.state_dict().items())  # trained

    prompts = _heldout(trained)
    ours = greedy_completions(exported, tokenizer, prompts, max_new_tokens=4)
    assert ours == greedy_completions(trainer, base_tokenizer, prompts, max_new_tokens=4)
    assert ours != greedy_completions(base, base_tokenizer, prompts, max_new_tokens=4)  # the export is not the base model
    answers = [p.answer for p in build_task(load_config(trained / "config.toml")).heldout]
    accuracy = sum(c.strip() == a for c, a in zip(ours, answers, strict=True)) / len(prompts)
    assert accuracy == _evals(trained)[-1]["accuracy"]  # the run's own last held-out evaluation


def test_export_writes_an_older_step_next_to_the_model_and_replaces_a_previous_export(trained: Path) -> None:
    done = relayrl("export", str(trained), "--step", "2")
    assert done.returncode == 0, done.stderr
    older = trained / "model-step-2"
    assert f"wrote {older}" in done.stdout
    assert json.loads((older / MARKER).read_text())["step"] == 2
    exported = AutoModelForCausalLM.from_pretrained(older, local_files_only=True)
    for name, value in _trainer_model(trained, 2).state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, rtol=0, atol=0)
    again = export_run(trained, step=2)  # a previous export is replaced
    assert again.directory == older and again.step == 2 and (older / "model.safetensors").is_file()
    newest = export_run(trained, out=trained / "elsewhere")
    assert newest.step == STEPS and (trained / "elsewhere" / "config.json").is_file()


def test_export_refuses_in_one_line(trained: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"no checkpoint of step 1 \(--step\); checkpoints there: steps 2, 3"):
        export_run(trained, step=1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"exists and is not a relayrl export"):
        export_run(trained, out=tmp_path / "taken")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    with pytest.raises(ExportError, match=r"does not exist"):
        export_run(tmp_path / "missing")
    sim = tmp_path / "sim"
    run_checked(build_program(sim_config("run.steps=2"), run_dir=sim))
    with pytest.raises(ExportError, match=r"run.backend = 'sim' run has no model to export"):
        export_run(sim)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.toml").write_text((trained / "config.toml").read_text())
    with pytest.raises(ExportError, match=r"no checkpoint to export under .*checkpoint_every = 0"):
        export_run(bare)
    fresh = load_config(None, [*LOCAL, "run.steps=1", f"model.path={trained / 'model'}"])
    with pytest.raises(RunDirError, match=r"model.path .* is inside the run directory .* which a fresh run clears"):
        build_program(fresh, run_dir=trained)  # it would delete the model it trains from
    assert (trained / "model" / "model.safetensors").is_file()
    refused = relayrl("export", str(trained), "--step", "7")
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "checkpoints there: steps 2, 3" in refused.stderr


@pytest.mark.parametrize("content", [b"", b"garbage, not a checkpoint", b"\x80\x02]q\x00."], ids=["empty", "garbage", "a-list"])
def test_export_of_an_unreadable_trainer_state_names_the_file_in_one_line(trained: Path, tmp_path: Path, content: bytes) -> None:
    """A zero-length trainer.pt printed `Aborted.`, a garbage one an IndexError."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text((trained / "config.toml").read_text())
    src = checkpoint_dir(trained, STEPS)
    dst = run / "checkpoints" / src.name
    dst.mkdir()
    for path in src.iterdir():
        if path.is_file():
            (dst / path.name).write_bytes(path.read_bytes())
    (dst / "trainer.pt").write_bytes(content)
    done = relayrl("export", str(run), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {dst / 'trainer.pt'}: unreadable trainer state"), done.stderr
    assert not (tmp_path / "out").exists()


def test_export_out_through_a_missing_directory_and_dot_dot_leaves_no_stray_directory(trained: Path, tmp_path: Path) -> None:
    """`export --out x/../y` wrote y and left an empty x/ behind."""
    exported = export_run(trained, out=tmp_path / "x" / ".." / "y")
    assert exported.directory == (tmp_path / "y").resolve() and (tmp_path / "y" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["y"]


@pytest.mark.slow
def test_train_continues_from_the_export_and_a_run_without_checkpoints_saves_its_model(trained: Path, tmp_path: Path) -> None:
    """`relayrl train --set model.path=EXPORT`: its first held-out accuracy is the exporting run's
    last; that run has no checkpoints, so its model/ comes from the trainer's state at the end."""
    args = [f"--set={o}" for o in LOCAL]
    done = relayrl(
        "train",
        *args,
        "--set=run.steps=1",
        f"--set=model.path={trained / 'model'}",
        "--set=orchestrator.checkpoint_every=0",
        f"--set=run.output_dir={tmp_path}",
        "--set=run.name=next",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "next"
    assert f"model: {run_dir / 'model'}" in done.stdout
    assert _evals(run_dir)[0]["accuracy"] == _evals(trained)[-1]["accuracy"]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / MODEL_STATE).exists()
    marker = json.loads((run_dir / "model" / MARKER).read_text())
    assert marker["step"] == 1 and marker["source"] == str(trained / "model")
    assert HF_FILES <= {p.name for p in (run_dir / "model").iterdir()}


def test_save_model_false_writes_nothing_and_a_model_dir_in_the_way_fails_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*LOCAL, "run.steps=1", "run.save_model=false", "eval.enabled=false"])
    result = run_checked(build_program(cfg, run_dir=run_dir), timeout=120)
    assert result.model_dir is None
    assert not (run_dir / "model").exists() and not (run_dir / MODEL_STATE).exists()
    # extended with save_model on, while RUN_DIR/model/ holds someone's files: refused, kept, named
    (run_dir / "model").mkdir()
    (run_dir / "model" / "notes.txt").write_text("mine")
    longer = load_config(None, [*LOCAL, "run.steps=2", "eval.enabled=false"])
    with pytest.raises(ModelSaveFailed, match=r"run completed but its model could not be written to .*model: .*relayrl export"):
        asyncio.run(asyncio.wait_for(build_program(longer, run_dir=run_dir, resume=True).run(), 120))
    assert [p.name for p in (run_dir / "model").iterdir()] == ["notes.txt"]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert load_resume_point(run_dir).step == 2  # the run itself completed, with its final checkpoint


def test_a_model_loaded_from_gguf_is_written_as_plain_weights(tmp_path: Path) -> None:
    """transformers dequantizes GGUF tensors at load but keeps its GGUF quantizer on the model,
    and save_pretrained refuses such a model; the export forgets the quantizer (the SmolLM2
    recipe's run failed at its end without this)."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    from relayrl.models.gguf_dir import plain_weights
    from relayrl.models.loading import shipped_model_dir

    model = AutoModelForCausalLM.from_pretrained(shipped_model_dir())
    model.hf_quantizer = GgufHfQuantizer(GgufConfig())  # type: ignore[assignment]
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")
    plain_weights(model)
    model.save_pretrained(tmp_path / "plain")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
