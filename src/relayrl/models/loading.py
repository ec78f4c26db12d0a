"""Load causal LMs and their tokenizers from a directory, and measure greedy exact-match accuracy.

Job: one way in for every model — the shipped tiny model and a user's own Hugging Face
checkpoint directory alike go through ``from_pretrained(dir)``; nothing is fetched from the hub.

Invariants:
- ``load_model_and_tokenizer`` reads only local files; a missing directory raises
  ``FileNotFoundError`` naming the path, files that cannot be loaded or a tokenizer larger than
  the model's embedding raise ``ModelLoadError`` (one line naming the directory and
  ``model.path``). The returned tokenizer always has a pad token.
- the returned model has every dropout off (``disable_dropout``): the trainer computes log-probs
  in train mode and the samplers in eval mode, and at staleness 0 the two must agree (ratio 1);
  RL fine-tuning does not use dropout.
- ``greedy_accuracy`` is deterministic for given weights: greedy decoding, left padding, and a
  completion counts only if its text up to the first EOS equals the answer (outer whitespace
  ignored).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TypeVar, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from relayrl.errors import UserError
from relayrl.types import Prompt

SHIPPED_MODELS_PACKAGE = "relayrl.models"
ASSETS_DIR = "assets"
# a float attribute (of a module or a config) with such a name is a dropout probability
_DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop|drop_path|drop_prob|drop_rate")

_DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


class ModelLoadError(UserError):
    """A model directory whose files cannot be loaded, or whose tokenizer does not fit its weights."""


def shipped_model_dir(name: str = "tiny-arith") -> Path:
    """Directory of a model shipped inside the installed package (``relayrl/models/assets/<name>``)."""
    assets = Path(str(resources.files(SHIPPED_MODELS_PACKAGE).joinpath(ASSETS_DIR)))
    path = assets / name
    if not (path / "config.json").is_file():
        available = sorted(p.name for p in assets.iterdir() if (p / "config.json").is_file()) if assets.is_dir() else []
        raise FileNotFoundError(
            f"no shipped model {name!r} at {path} (available: {', '.join(available) or 'none'}); build it with scripts/make_tiny_model.py"
        )
    return path


def disable_dropout(model: ModuleT) -> ModuleT:
    """Turn every dropout of ``model`` off, in place, and return it: each ``nn.Dropout`` (and its
    kin) gets p = 0, and every float attribute named like a dropout probability (e.g.
    ``attention_dropout``, ``hidden_dropout_prob``, ``resid_pdrop``, ``layerdrop``) of each module
    and of each module's config is set to 0 — attention modules keep their own copy of the
    config's rate and pass it to the attention kernel when training, so the config alone is not
    enough. Train mode then computes what eval mode does (up to float rounding)."""
    for module in model.modules():
        if isinstance(module, _DROPOUT_MODULES):
            module.p = 0.0
        owners: list[object] = [module]
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            owners.append(config)
            owners.extend(v for v in vars(config).values() if isinstance(v, PretrainedConfig))  # e.g. text_config
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if isinstance(value, float) and value != 0.0 and _DROPOUT_NAME.search(name):
                    setattr(owner, name, 0.0)
    return model


def load_model_and_tokenizer(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    gguf_file: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory with ``from_pretrained``.

    ``gguf_file`` names a GGUF file inside ``path`` (needs the ``gguf`` package). The model is
    returned in eval mode on the CPU in ``dtype`` (its users move it to their device: see
    ``relayrl.backends.local.devices``), with dropout off (``disable_dropout``). A tokenizer without a
    pad token gets its EOS as pad.
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    if gguf_file is not None and not (model_dir / gguf_file).is_file():
        raise FileNotFoundError(f"GGUF file not found: {model_dir / gguf_file}")
    if gguf_file is None and not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {model_dir}")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a failed load's multi-line report: the error below says it in one line
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=dtype, local_files_only=True)
    except Exception as exc:  # a broken or partial checkpoint: from_pretrained raises many kinds (e.g. SafetensorError)
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if "ignore_mismatched_sizes" in first:
            first = "the weights' shapes do not match config.json (e.g. vocab_size or hidden_size)"
        raise ModelLoadError(f"cannot load the model in {model_dir} (model.path): {first}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise ModelLoadError(
            f"the tokenizer in {model_dir} has {len(tokenizer)} tokens but the model's embedding only {rows} (model.path): "
            "the tokenizer and the weights do not belong together"
        )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"tokenizer in {model_dir} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    disable_dropout(model).eval()
    return model, tokenizer


@torch.inference_mode()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 128,
) -> list[str]:
    """Greedy completions of ``texts`` (batched, left-padded), each cut at its first EOS; the
    inputs are moved to the model's device."""
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    if eos_id is None or pad_id is None:
        raise ValueError("greedy decoding needs a tokenizer with an EOS token")
    was_training = model.training
    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = list(texts[start : start + batch_size])
            enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            # PreTrainedModel is a GenerationMixin; nn.Module.__getattr__ hides that from type checkers
            generated = cast(GenerationMixin, model).generate(
                input_ids=enc["input_ids"].to(model.device),
                attention_mask=enc["attention_mask"].to(model.device),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_id,
                pad_token_id=pad_id,
            )
            new_tokens = generated[:, enc["input_ids"].shape[1] :].tolist()
            for row in new_tokens:
                if eos_id in row:
                    row = row[: row.index(eos_id)]
                out.append(cast(str, tokenizer.decode(row, skip_special_tokens=True)))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return out


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    batch_size: int = 128,
) -> float:
    """Share of ``prompts`` whose greedy completion (up to EOS, stripped) equals the answer."""
    if not prompts:
        raise ValueError("greedy_accuracy needs at least one prompt")
    completions = greedy_completions(model, tokenizer, [p.text for p in prompts], max_new_tokens, batch_size)
    correct = sum(c.strip() == p.answer.strip() for c, p in zip(completions, prompts, strict=True))
    return correct / len(prompts)
