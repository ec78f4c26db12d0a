"""A GGUF model as a Hugging Face directory, for what cannot read GGUF (the vLLM engine): the
file loaded once by relayrl's loader (dequantized to float32, as the trainer loads it) and written
with its tokenizer as safetensors to a cache directory, reused afterwards.

Where: `$RELAYRL_CACHE_DIR` or `~/.cache/relayrl`, under
`gguf/<model directory name>-<file stem>-<key>`; the key hashes the file's resolved path, size
and modification time, so a changed file is converted again.

Invariants: a directory found there is complete (written to a temporary sibling, then renamed
into place); of two processes converting one file at once, the second to finish uses the first's
directory and removes its own; a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CACHE_ENV", "cache_root", "gguf_directory", "plain_weights"]

#: the environment variable naming relayrl's cache directory
CACHE_ENV = "RELAYRL_CACHE_DIR"


def plain_weights(model: PreTrainedModel) -> None:
    """Forget how the weights were loaded when that was from a GGUF file: transformers dequantizes
    GGUF tensors to plain float ones at load, but keeps its GGUF quantizer on the model, and
    `save_pretrained` refuses a model whose quantizer cannot serialize ("quantized with gguf and
    is not serializable"). The weights are plain: written as safetensors they load as they are."""
    if getattr(model, "hf_quantizer", None) is not None and type(model.hf_quantizer).__name__ == "GgufHfQuantizer":
        model.hf_quantizer = None  # type: ignore[assignment]  # (nn.Module types attributes as tensors or modules)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config


def cache_root() -> Path:
    """`$RELAYRL_CACHE_DIR`, else `~/.cache/relayrl`."""
    given = os.environ.get(CACHE_ENV)
    return Path(given) if given else Path.home() / ".cache" / "relayrl"


def _key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_directory(source_dir: Path, gguf_file: str, cache: Path | None = None) -> Path:
    """The model of `source_dir / gguf_file` as a Hugging Face directory in `cache` (default
    `cache_root()`), converted on first use (see the module). Blocking (seconds to minutes)."""
    from relayrl.models.loading import load_model_and_tokenizer

    path = source_dir / gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    parent = (cache if cache is not None else cache_root()) / "gguf"
    out = parent / f"{source_dir.name}-{Path(gguf_file).stem}-{_key(path)}"
    if (out / "config.json").is_file():
        return out
    print(f"relayrl: converting {path} to a Hugging Face directory {out} (once)", file=sys.stderr, flush=True)
    model, tokenizer = load_model_and_tokenizer(source_dir, gguf_file=gguf_file)
    plain_weights(model)  # dequantized: writable as safetensors
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(out)
        except OSError:  # converted meanwhile by another process: its directory is complete
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
