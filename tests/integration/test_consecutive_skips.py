"""`train.max_consecutive_skips`: under `train.on_nonfinite = "skip"` a run whose updates are all
skipped fails after more than that many in a row, naming the step and the key; an isolated skip
resets the count; the count survives a checkpoint; the command line reports it in one line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from test_local_backend import _tiny_batch
from transformers import PreTrainedTokenizerBase

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.trainer import NonFiniteStepError, TrainerCompute, TrainerSettings
from relayrl.config.schema import ConfigError, load_config
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.orchestrator.build import build_program
from relayrl.types import TrainBatch
from support.cli import run_python

torch.set_num_threads(1)
NAN = float("nan")


def _batch(tok: PreTrainedTokenizerBase, advantage: float) -> TrainBatch:
    return _tiny_batch(tok, (advantage, -1.0))


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_model_and_tokenizer(shipped_model_dir())[1]


def _trainer(limit: int | None = None) -> TrainerCompute:
    model, _ = load_model_and_tokenizer(shipped_model_dir())
    extra = {} if limit is None else {"max_consecutive_skips": limit}
    return TrainerCompute(model, TrainerSettings(learning_rate=1e-3, total_steps=20, loss=LossConfig(), **extra))  # type: ignore[arg-type]


def _step(trainer: TrainerCompute, tok: PreTrainedTokenizerBase, advantage: float) -> int:
    trainer.train_step(_batch(tok, advantage))
    return trainer.optim_step()


def test_the_eleventh_consecutive_skip_fails_naming_the_step_and_the_key(tok: PreTrainedTokenizerBase) -> None:
    trainer = _trainer()  # the default: 10
    for step in range(10):
        assert _step(trainer, tok, NAN) == step + 1  # skipped, committed, the run goes on
        assert trainer.metrics()["skipped_nonfinite"] == 1.0
    trainer.train_step(_batch(tok, NAN))
    with pytest.raises(NonFiniteStepError) as err:
        trainer.optim_step()
    message = str(err.value)
    assert message.startswith("step 10: 11 steps in a row had a non-finite loss or gradient norm")
    assert "train.max_consecutive_skips = 10" in message and "\n" not in message
    assert trainer.metrics()["nonfinite_steps"] == 10.0


def test_an_isolated_skip_resets_the_count(tok: PreTrainedTokenizerBase) -> None:
    trainer = _trainer(limit=2)
    for advantage in (NAN, NAN, 1.0, NAN, NAN, 1.0, NAN, NAN):  # never more than 2 in a row
        _step(trainer, tok, advantage)
    assert trainer.metrics()["nonfinite_steps"] == 6.0
    trainer.train_step(_batch(tok, NAN))
    with pytest.raises(NonFiniteStepError, match=r"^step 8: 3 steps in a row .* train.max_consecutive_skips = 2"):
        trainer.optim_step()


def test_the_count_survives_a_checkpoint(tok: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    first = _trainer(limit=2)
    _step(first, tok, NAN)
    _step(first, tok, NAN)
    first.save_state(tmp_path)
    resumed = _trainer(limit=2)
    assert resumed.load_state(tmp_path) == 2
    resumed.train_step(_batch(tok, NAN))
    with pytest.raises(NonFiniteStepError, match=r"^step 2: 3 steps in a row"):
        resumed.optim_step()


def test_the_key_is_validated() -> None:
    assert load_config(None, []).train.max_consecutive_skips == 10
    with pytest.raises(ConfigError, match=r"invalid config key 'train.max_consecutive_skips' \(from --set\)"):
        load_config(None, ["train.max_consecutive_skips=0"])


QUICK = [
    "run.backend=local",
    "task.kind=arithmetic",
    "rollout.num_generations=2",
    "rollout.groups_per_step=2",
    "rollout.max_new_tokens=4",
    "eval.enabled=false",
    "orchestrator.release_memory=false",
]


def _poison_every_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    import relayrl.backends.local.trainer as trainer_module

    real = trainer_module.deferred_policy_loss

    def nan_loss(*args: object, **kwargs: object) -> object:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        out.loss = out.loss * NAN
        return out

    monkeypatch.setattr(trainer_module, "deferred_policy_loss", nan_loss)


def test_a_run_whose_every_step_is_non_finite_fails_after_the_eleventh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    _poison_every_loss(monkeypatch)
    cfg = load_config(None, [*QUICK, "run.steps=14"])
    program = build_program(cfg, run_dir=tmp_path / "run")
    with pytest.raises(NonFiniteStepError, match=r"^step 10: 11 steps in a row .* train.max_consecutive_skips = 10"):
        asyncio.run(asyncio.wait_for(program.run(), 300))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))  # steps 1-10 committed, skipped
    assert all(r["train/skipped_nonfinite"] == 1.0 for r in rows) and rows[-1]["train/nonfinite_steps"] == 10.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "train.max_consecutive_skips" in summary["error"]


@pytest.mark.slow
def test_the_command_line_reports_it_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "poisoned_cli.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import relayrl.backends.local.trainer as t
            real = t.deferred_policy_loss
            def nan_loss(*args, **kwargs):
                out = real(*args, **kwargs)
                out.loss = out.loss * float("nan")
                return out
            t.deferred_policy_loss = nan_loss
            from relayrl.cli.main import main
            sys.argv = ["relayrl", "train", *sys.argv[1:]]
            main()
            """
        )
    )
    args = [a for item in [*QUICK, "run.steps=5", "train.max_consecutive_skips=2", f"run.output_dir={tmp_path}"] for a in ("--set", item)]
    done = run_python(str(script), *args)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: step 2: 3 steps in a row"), done.stderr
    assert "train.max_consecutive_skips = 2" in errors[0] and "Traceback" not in done.stderr
