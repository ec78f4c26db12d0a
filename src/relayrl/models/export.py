"""Export a run's trained policy as a Hugging Face model directory (`relayrl export`, and the
`RUN_DIR/model/` a finished run writes with `run.save_model`).

Job: turn a trainer state (`trainer.pt` of a checkpoint, `backends/local/trainer.py`) into a
directory that `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` (and so
vLLM, or `relayrl train --set model.path=DIR`) load: `config.json`, `model.safetensors`,
`generation_config.json`, the tokenizer's files, and `relayrl_export.json` (the run, the step and
the model it was trained from). The architecture, config and tokenizer come from the model the run
was configured with (`model.path`, `model.package`, `model.gguf_file` or the shipped tiny model),
loaded as training loaded it (`backends/local/build.load_base`); the weights from the state.
The shipped tiny model's tokenizer files are copied from its assets directory as they are; any
other model's tokenizer is written as loaded (`save_pretrained`, its chat template included); a
GGUF-loaded model is written as (dequantized) safetensors.

Invariants:
- the export is written into a hidden directory next to it (`.NAME.partial`) and renamed into
  place only when complete: a kill leaves the previous export (or none), never a partial one.
- an existing output directory is replaced only when it is a previous export (it holds
  `relayrl_export.json`) or empty; anything else is refused (`ExportError`, one line), as are a
  run without checkpoints, a step without one (naming the steps there are) and a sim-backend run.
- the exported weights are the state's, bit for bit, in the model's dtype; the config's dropout
  rates are the source model's (training turns them off: models/loading.disable_dropout).
- a LoRA run (train.lora) exports its adapter in PEFT format (`adapter_config.json`,
  `adapter_model.safetensors`: `PeftModel.from_pretrained(base, DIR)` loads it, its
  `base_model_name_or_path` the model it was trained from) with the tokenizer's files, or with
  `merged` the model with the adapter merged in (W + alpha/r · B·A), written as a plain model
  (by default beside the adapter, `RUN_DIR/model-merged`: never over it). `run.save_model` writes
  the adapter. A base loaded from a GGUF file is no directory peft can load: the adapter's export
  then holds the base as a Hugging Face directory (`base/`: dequantized safetensors and its
  tokenizer) and names it (absolute path) as `base_model_name_or_path`, so
  `AutoPeftModelForCausalLM.from_pretrained(EXPORT)` loads it.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from relayrl.config.schema import Config, load_config
from relayrl.errors import RunFailed, UserError
from relayrl.rundir.checkpoint import CHECKPOINTS, checkpoint_dir, complete_checkpoints

MODEL_DIR = "model"  # RUN_DIR/model: the export of a run's newest checkpoint (and a finished run's model)
MARKER = "relayrl_export.json"  # in an export: what it was exported from; marks a directory an export may replace
MODEL_STATE = ".model-state"  # RUN_DIR/.model-state: the last step's trainer state, for a run without checkpoints
TRAINER_STATE = "trainer.pt"
BASE_DIR = "base"  # in a LoRA adapter's export from a GGUF base: that base as a Hugging Face directory
# the shipped model's files that are not its tokenizer's
_NOT_TOKENIZER = {"config.json", "generation_config.json", "model.safetensors", "relayrl_meta.json"}


class ExportError(UserError):
    """A run, step or output directory that cannot be exported from or to; names it."""


class ModelSaveFailed(RunFailed):
    """A completed run whose model (run.save_model) could not be written; names the directory and
    the cause. Resuming would not help: `relayrl export RUN_DIR` writes it from the checkpoint."""

    resumable = False

    def __init__(self, out: Path, cause: BaseException, *, checkpointed: bool) -> None:
        reason = " ".join(str(cause).split()) if not isinstance(cause, OSError) or not cause.strerror else cause.strerror
        where = f" ({cause.filename})" if isinstance(cause, OSError) and cause.filename else ""
        then = "the run has no checkpoint to export"
        if checkpointed:
            then = f"write it from the last checkpoint with: relayrl export {out.parent}"
        super().__init__(f"the run completed but its model could not be written to {out}: {reason}{where}; {then}")


@dataclass(frozen=True, slots=True)
class Exported:
    directory: Path  # the model directory written
    step: int  # the step whose weights it holds (steps numbered from 1)
    source: str  # the model the run was trained from (a directory, or a GGUF file in one)
    gguf: bool  # loaded from a GGUF file: written as safetensors
    adapter: bool = False  # a LoRA run's adapter in PEFT format (not merged)
    replaced: bool = False  # a previous export was there and was replaced


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of `run_dir`'s complete checkpoints, oldest first."""
    return [int(p.name.removeprefix("step-")) for p in complete_checkpoints(run_dir / CHECKPOINTS)]


def default_out(run_dir: Path, step: int, newest: int, merged: bool = False) -> Path:
    """`RUN_DIR/model` for the newest checkpoint, `RUN_DIR/model-step-N` for an older one; a
    LoRA run's merged model beside its adapter: `RUN_DIR/model-merged[-step-N]`."""
    name = f"{MODEL_DIR}-merged" if merged else MODEL_DIR
    return run_dir / (name if step == newest else f"{name}-step-{step}")


def run_config(run_dir: Path) -> Config:
    """The config a run was trained with (`RUN_DIR/config.toml`)."""
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist")
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ExportError(f"{run_dir} is not a run directory that started (no config.toml): nothing to export")
    return load_config(path)


def export_run(run_dir: Path, *, step: int | None = None, out: Path | None = None, merged: bool = False) -> Exported:
    """Write the policy of `run_dir`'s checkpoint of `step` (None: the newest) as a Hugging Face
    model directory at `out` (None: `default_out`); a LoRA run's as its adapter, or with `merged`
    as the model with the adapter merged in. Blocking: call it off the event loop."""
    cfg = run_config(run_dir)
    if cfg.run.backend != "local":
        raise ExportError(f"{run_dir}: a run.backend = {cfg.run.backend!r} run has no model to export (only 'local' runs train one)")
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise ExportError(
            f"{run_dir}: no checkpoint to export under {run_dir / CHECKPOINTS} "
            f"(none is written when orchestrator.checkpoint_every = 0; a finished run with run.save_model wrote {run_dir / MODEL_DIR})"
        )
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ExportError(
            f"{run_dir}: no checkpoint of step {chosen} (--step); checkpoints there: step{'s' if len(steps) > 1 else ''} "
            f"{', '.join(map(str, steps))}"
        )
    # `--out x/../y` is y: resolved first, so that no stray x/ is created on the way
    target = out.resolve() if out is not None else default_out(run_dir, chosen, steps[-1], merged=merged and cfg.train.lora is not None)
    return write_model(cfg, checkpoint_dir(run_dir, chosen), target, step=chosen, run_dir=run_dir, merged=merged)


def check_out(out: Path) -> None:
    """Refuse an output path an export may not replace: a file, or a directory that is neither
    empty nor a previous export."""
    if out.is_dir():
        if (out / MARKER).is_file() or not any(out.iterdir()):
            return
        raise ExportError(f"--out {out} exists and is not a relayrl export (no {MARKER}): choose another directory or remove it")
    if out.exists() or out.is_symlink():
        raise ExportError(f"--out {out} exists and is not a directory")


def write_model(cfg: Config, state_dir: Path, out: Path, *, step: int, run_dir: Path, merged: bool = False) -> Exported:
    """Build the configured model with the weights of `state_dir/trainer.pt` (the trainer's state
    after `step`) and write it, with its tokenizer, to `out` atomically; a LoRA run's adapter
    (PEFT format), or with `merged` the model with it merged in. Blocking."""
    check_out(out)
    state_file = state_dir / TRAINER_STATE
    sharded = state_dir / "trainer-sharded.pt"  # train.world_size > 1 (backends/local/ranks.py)
    if sharded.is_file():
        state_file = sharded
    elif not state_file.is_file():
        raise ExportError(f"{state_dir}: no trainer state ({TRAINER_STATE}) to export")
    import torch
    from transformers import AutoConfig

    from relayrl.backends.local.build import load_base, model_dir
    from relayrl.models.gguf_dir import plain_weights
    from relayrl.models.loading import shipped_model_dir

    source_dir = model_dir(cfg)
    gguf = cfg.model.gguf_file
    source = str(source_dir / gguf) if gguf else str(source_dir)
    try:
        model, tokenizer = load_base(cfg)
    except FileNotFoundError as exc:
        raise ExportError(f"{run_dir}: cannot rebuild the model it trained: {exc} (model.path in {run_dir / 'config.toml'})") from None
    try:
        if state_file == sharded:
            from relayrl.backends.local.ranks import read_full_weights

            version, weights = read_full_weights(state_dir)
        else:
            state = torch.load(state_file, map_location="cpu", weights_only=True)
            version = int(state["version"])
            weights = state["model"]
    except Exception as exc:  # empty (EOFError), garbage (UnpicklingError, IndexError), torn, not a state dict, ...
        what = " ".join(str(exc).split())[:200] or "no message"
        size = state_file.stat().st_size if state_file.is_file() else 0
        empty = " (an empty file)" if size == 0 else ""
        raise ExportError(f"{state_file}: unreadable trainer state{empty} ({type(exc).__name__}: {what})") from None
    if version != step:
        raise ExportError(f"{state_file}: trainer state is version {version}, expected {step}")
    adapter = None
    if cfg.train.lora is not None:
        from relayrl.models.lora import load_adapter_payload, wrap

        adapter = wrap(model, cfg.train.lora, seed=cfg.run.seed)  # (its initial values: overwritten by the checkpoint's)
        try:
            load_adapter_payload(adapter, weights)
        except ValueError as exc:
            raise ExportError(f"{state_file}: {exc} (train.lora in {run_dir / 'config.toml'})") from None
        # a GGUF file is no base peft can load: the export holds the base as a directory (below)
        base_dir = out.resolve() / BASE_DIR
        adapter.peft_config["default"].base_model_name_or_path = str(base_dir) if gguf and not merged else source
        if merged:
            model, adapter = adapter.merge_and_unload(), None
    else:
        try:
            if state_file == sharded:  # a tied weight is stored once: under the name its tensor has there
                own = model.state_dict()
                by_ptr = {own[k].data_ptr(): k for k in weights if k in own}
                weights = {
                    **weights,
                    **{k: weights[by_ptr[t.data_ptr()]] for k, t in own.items() if k not in weights and t.data_ptr() in by_ptr},
                }
            model.load_state_dict(weights)
        except RuntimeError as exc:
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise ExportError(f"{state_file}: the weights do not fit the model {source} ({first})") from None
    original = AutoConfig.from_pretrained(source_dir, gguf_file=gguf, local_files_only=True)
    _restore_dropout(model.config, original)
    plain_weights(model)  # (a GGUF-loaded model's weights: written as safetensors)

    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    replaced = out.is_dir() and any(out.iterdir())
    try:
        with warnings.catch_warnings():  # peft looks for the base's config.json, written just below
            warnings.filterwarnings("ignore", message="Could not find a config file", category=UserWarning)
            (adapter if adapter is not None else model).save_pretrained(staging)
        if adapter is not None and gguf:  # the base, as a directory the adapter names
            base = adapter.unload()  # the adapter's files are written: its modules are no longer needed
            base.save_pretrained(staging / BASE_DIR)
            tokenizer.save_pretrained(staging / BASE_DIR)
        shipped = shipped_model_dir()
        if not gguf and source_dir.resolve() == shipped.resolve():  # the shipped model's own tokenizer files, as they are
            for path in sorted(shipped.iterdir()):
                if path.is_file() and path.name not in _NOT_TOKENIZER:
                    shutil.copy2(path, staging / path.name)
        else:
            tokenizer.save_pretrained(staging)
        marker = {
            "run_dir": str(run_dir.resolve()),
            "step": step,
            "source": source,
            "gguf": gguf is not None,
            "dtype": cfg.model.dtype,
            "lora": None if cfg.train.lora is None else {"adapter": adapter is not None, **cfg.train.lora.model_dump()},
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        _replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Exported(directory=out, step=step, source=source, gguf=gguf is not None, adapter=adapter is not None, replaced=replaced)


def _restore_dropout(config: object, original: object) -> None:
    """Put back the float settings training turned to 0 (its dropout rates: disable_dropout) as
    the source model's config has them, so the export's config.json is the source's."""
    for name, value in vars(original).items():
        if isinstance(value, float) and value != 0.0 and getattr(config, name, None) == 0.0:
            setattr(config, name, value)


def _replace(staging: Path, out: Path) -> None:
    """Move the complete `staging` to `out`; a previous export (or an empty directory) there is
    moved aside first and removed after."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)
