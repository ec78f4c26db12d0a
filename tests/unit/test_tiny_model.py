"""The shipped tiny model: it loads offline, is small, and is modestly (not fully) good at its task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from relayrl.models.loading import (  # noqa: E402
    greedy_accuracy,
    greedy_completions,
    load_model_and_tokenizer,
    shipped_model_dir,
)
from relayrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask  # noqa: E402
from relayrl.types import Prompt  # noqa: E402

MAX_BYTES = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def loaded() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    torch.set_num_threads(1)  # the machine is shared; one thread is plenty for this model
    return load_model_and_tokenizer(shipped_model_dir())


@pytest.fixture(scope="module")
def meta() -> dict[str, object]:
    data: dict[str, object] = json.loads((shipped_model_dir() / "relayrl_meta.json").read_text())
    return data


def _task_from_meta(meta: dict[str, object]) -> ArithmeticTask:
    settings = dict(meta["task"])  # type: ignore[call-overload]
    assert settings.pop("kind") == "arithmetic"
    settings["operators"] = tuple(settings["operators"])
    return ArithmeticTask(ArithmeticConfig(**settings))


def test_shipped_dir_resolves_inside_the_package_and_is_small() -> None:
    path = shipped_model_dir("tiny-arith")
    assert path.parts[-4:] == ("relayrl", "models", "assets", "tiny-arith")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "relayrl_meta.json"} <= names
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert 0 < total <= MAX_BYTES


def test_unknown_names_and_missing_dirs_raise_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        shipped_model_dir("no-such-model")
    missing = tmp_path / "not-here"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model_and_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_and_tokenizer(tmp_path)


def test_model_and_char_tokenizer(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase], meta: dict[str, object]) -> None:
    model, tok = loaded
    assert type(model).__name__ in {"Qwen2ForCausalLM", "LlamaForCausalLM"}
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 <= n_params <= 3_000_000
    assert n_params == meta["parameters"]
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>"
    assert tok.eos_token_id != tok.pad_token_id
    ids = tok.encode("23+9=", add_special_tokens=False)
    assert len(ids) == 5  # one token per character
    assert tok.decode(ids) == "23+9="
    assert tok.unk_token_id not in tok.encode("12-3*4= ", add_special_tokens=False)


def test_heldout_accuracy_is_modest_and_matches_the_recorded_figure(
    loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase], meta: dict[str, object]
) -> None:
    model, tok = loaded
    task = _task_from_meta(meta)
    assert meta["max_new_tokens"] == task.max_answer_chars() + 1
    acc = greedy_accuracy(model, tok, task.heldout(200), max_new_tokens=task.max_answer_chars() + 1)
    assert 0.10 <= acc <= 0.60, "the warm start must be able to do the task, yet leave room for RL"
    recorded = meta["heldout_greedy_accuracy"]["200"]  # type: ignore[index]
    assert abs(acc - recorded) <= 0.03


def test_greedy_decoding_is_independent_of_batching_and_emits_eos(
    loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tok = loaded
    texts = [p.text for p in ArithmeticTask().heldout(60)]
    side = tok.padding_side
    batched = greedy_completions(model, tok, texts, max_new_tokens=4, batch_size=60)
    assert greedy_completions(model, tok, texts, max_new_tokens=4, batch_size=7) == batched
    # left padding does not change what the model says: short prompts alone match the batch
    short = [i for i, t in enumerate(texts) if len(t) < 6][:8]
    assert len(short) >= 4
    alone = greedy_completions(model, tok, [texts[i] for i in short], max_new_tokens=4, batch_size=1)
    assert alone == [batched[i] for i in short]
    assert all(c.isdigit() for c in batched), batched  # the format is learned: digits, then EOS
    assert tok.padding_side == side  # restored after decoding


def test_greedy_accuracy_scores_exact_matches_only(loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tok = loaded
    held = ArithmeticTask().heldout(60)
    said = greedy_completions(model, tok, [p.text for p in held], max_new_tokens=4)
    echoed = [Prompt(p.prompt_id, p.text, s) for p, s in zip(held, said, strict=True)]
    assert greedy_accuracy(model, tok, echoed, max_new_tokens=4) == 1.0
    shifted = [Prompt(p.prompt_id, p.text, s + "0") for p, s in zip(held, said, strict=True)]
    assert greedy_accuracy(model, tok, shifted, max_new_tokens=4) == 0.0
    with pytest.raises(ValueError):
        greedy_accuracy(model, tok, [], max_new_tokens=4)
