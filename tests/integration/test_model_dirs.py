"""Bad model directories: whatever files are missing, truncated or replaced, and whether the
tokenizer fits the weights, loading either succeeds or fails with one line naming the directory
(and `model.path`) — never a traceback; the CLI exits 2 and writes no run directory."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.models.loading import ModelLoadError, load_model_and_tokenizer, shipped_model_dir
from support.cli import relayrl

SHIPPED = shipped_model_dir()
FILES = sorted(p.name for p in SHIPPED.iterdir())


def _broken_copy(root: Path, removed: list[str], truncated: dict[str, int], extra_tokens: int) -> Path:
    target = root / "model"
    shutil.copytree(SHIPPED, target)
    for name in removed:
        (target / name).unlink()
    for name, keep in truncated.items():
        path = target / name
        if path.exists():
            path.write_bytes(path.read_bytes()[:keep])
    if extra_tokens and not removed and not truncated:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
        tokenizer.save_pretrained(target)
    return target


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(FILES), unique=True, max_size=3),
    st.dictionaries(st.sampled_from(FILES), st.integers(0, 200), max_size=2),
    st.sampled_from([0, 0, 200]),
)
def test_a_broken_model_directory_loads_or_fails_in_one_line(removed: list[str], truncated: dict[str, int], extra: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _broken_copy(Path(tmp), removed, truncated, extra)
        try:
            model, tokenizer = load_model_and_tokenizer(model_dir)
        except (FileNotFoundError, ModelLoadError) as exc:
            message = str(exc)
            assert "\n" not in message and str(model_dir) in message, message
            return
        import torch

        embeddings = model.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding)
        assert len(tokenizer) <= embeddings.num_embeddings  # what loads, fits


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    model_dir = _broken_copy(tmp_path, [], {}, 200)
    with pytest.raises(ModelLoadError, match=r"has \d+ tokens but the model's embedding only \d+ \(model.path\)"):
        load_model_and_tokenizer(model_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("removed", "truncated", "fragment"),
    [
        (["model.safetensors"], {}, "(model.path): Error no file named model.safetensors"),
        ([], {"config.json": 10}, "(model.path)"),
        (["config.json"], {}, "no config.json"),
    ],
    ids=["no-weights", "torn-config", "no-config"],
)
def test_the_cli_refuses_a_broken_model_directory_and_writes_nothing(
    tmp_path: Path, removed: list[str], truncated: dict[str, int], fragment: str
) -> None:
    model_dir = _broken_copy(tmp_path, removed, truncated, 0)
    out = tmp_path / "runs"
    args = ["train", "--set", f"model.path={model_dir}", "--set", f"run.output_dir={out}", "--set", "run.steps=1"]
    res = relayrl(*args, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], res.stderr
    assert not out.exists()  # nothing written
