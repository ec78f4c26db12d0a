"""Build a run from a config: run directory, backend, prompts, reward functions.

Invariant: everything that can be rejected (config, task data, reward functions — each entry
imported and found callable —, the environment, model path, the checkpoint to resume, a config change a resumed run
cannot take) is checked here, before the run directory is written; the run directory is locked
(rundir/lock.py) before anything in it is changed, and only a directory proven to be a relayrl run
directory is ever cleared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relayrl.agents.context import AgentFn, load_agent
from relayrl.backends.bundle import Backend
from relayrl.backends.registry import build_backend
from relayrl.config.schema import Config, ConfigError, load_config, resumable_keys
from relayrl.config.sizing import check_fits
from relayrl.envs import build_environment
from relayrl.envs.base import Environment
from relayrl.errors import UserError
from relayrl.orchestrator.parts import assemble, episode_settings
from relayrl.orchestrator.program import Program
from relayrl.orchestrator.state import RunState
from relayrl.rewards import registry as rewards
from relayrl.rundir.checkpoint import CheckpointError, load_resume_point, rewind_run_dir
from relayrl.rundir.files import append_config_changes, write_config
from relayrl.rundir.lock import MARKER, RunDirError, RunDirLock
from relayrl.tasks.build import TaskData, build_task
from relayrl.telemetry.callbacks import Callback
from relayrl.threads import OrchestratorThreads


def run_dir_for(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def build_program(
    cfg: Config,
    callbacks: Sequence[Callback] = (),
    run_dir: Path | None = None,
    backend: Backend | None = None,
    resume: bool = False,
    reward_fns: Sequence[rewards.RewardEntry] | None = None,
    environment: Environment | None = None,
) -> Program:
    """A program for `cfg`; with `resume`, one that continues `run_dir` from its newest checkpoint
    (CheckpointError, a ValueError, if there is none or the run already did `run.steps`).

    `reward_fns` replaces `task.reward_functions`: names, specs or callables (sync ones run in
    this process's scoring thread, async ones on the event loop), weighted by `task.reward_weights`.
    The run's config.toml records a callable as `module:qualname`.

    `environment` is the multi-turn environment to use instead of building `task.environment`
    (which must then be set too, naming it: the run's config.toml records that name)."""
    if resume:
        if run_dir is None:
            raise UserError("resume needs a run directory")
        return resume_run(cfg, run_dir, callbacks, backend=backend, reward_fns=reward_fns, environment=environment)
    return start_run(cfg, run_dir, callbacks, backend=backend, reward_fns=reward_fns, environment=environment)


@dataclass(slots=True)
class _Checked:
    """What validating a config produced: the config as the run records it, its reward
    functions, environment and task."""

    cfg: Config
    rewards: list[rewards.ResolvedReward]
    environment: Environment | None
    task: TaskData
    agent: AgentFn | None = None  # task.agent, imported


def _check(cfg: Config, reward_fns: Sequence[rewards.RewardEntry] | None, environment: Environment | None) -> _Checked:
    """Everything about `cfg` that can be rejected without building workers: sizes, reward
    functions (each imported and found callable), the environment, the task's data."""
    if reward_fns is not None:
        if not reward_fns:
            raise UserError("reward_fns: give at least one reward function")
        cfg = cfg.model_copy(deep=True)
        cfg.task.reward_functions = [f if isinstance(f, str) else rewards.callable_name(f) for f in reward_fns]
    check_fits(cfg)
    entries = list(reward_fns) if reward_fns is not None else list(cfg.task.reward_functions)
    resolved = rewards.resolve_rewards(entries, cfg.task.reward_weights)
    if environment is None and cfg.task.environment is not None:
        environment = build_environment(cfg.task.environment, cfg.task.environment_config, cfg.rollout.max_turns)
    elif environment is not None and cfg.task.environment is None:
        raise UserError("environment: set task.environment too (its name is recorded in the run's config.toml)")
    agent = load_agent(cfg.task.agent) if cfg.task.agent is not None else None
    return _Checked(cfg, resolved, environment, build_task(cfg), agent)


def check_prompts_fit(cfg: Config, task: TaskData, backend: Backend) -> None:
    """Refuse (UserError, one line naming the file and the limit's key) a task whose training rows
    are a finite set none of which fits the prompt bound the dispatch stage applies: such a run
    would filter every group as too_long and never train. Stops at the first row that fits."""
    if task.rows is None:
        return
    if cfg.task.environment is not None:  # room for one action within the episode's token limit
        bound: int | None = episode_settings(cfg, backend.max_prompt_tokens).max_total_tokens - 1
        key = "rollout.max_total_tokens less one action token"
    else:
        bound = backend.max_prompt_tokens
        key = "the model's context less rollout.max_new_tokens"
    if bound is None or not task.rows:
        return
    shortest = None
    for prompt in task.rows:
        n = len(backend.tokenize(prompt.text))
        if n <= bound:
            return
        shortest = n if shortest is None else min(shortest, n)
    raise UserError(
        f"no training prompt of {task.source} fits: each of its {len(task.rows):,} rows has more than the {bound} tokens a "
        f"prompt may have ({key}); the shortest has {shortest}: shorten the prompts, or lower rollout.max_new_tokens"
        + (" / raise rollout.max_total_tokens" if cfg.task.environment is not None else "")
    )


def _backend(checked: _Checked, threads: OrchestratorThreads) -> Backend:
    """`run.backend`'s compute kind, placed by the `ray.enabled` host (backends/registry.py); a
    Ray backend starts or joins its cluster."""
    cfg = checked.cfg
    return build_backend(cfg, threads.abort, evaluate=cfg.eval.enabled and bool(checked.task.heldout))


def start_run(
    cfg: Config,
    run_dir: Path | None,
    callbacks: Sequence[Callback] = (),
    *,
    backend: Backend | None = None,
    reward_fns: Sequence[rewards.RewardEntry] | None = None,
    environment: Environment | None = None,
) -> Program:
    """A fresh run of `cfg` in `run_dir` (None: in memory). Everything is validated and the
    backend built before the run directory is locked, cleared (only with `run.overwrite`) and
    its config.toml written."""
    checked = _check(cfg, reward_fns, environment)
    if run_dir is not None and cfg.model.path and Path(cfg.model.path).resolve().is_relative_to(run_dir.resolve()):
        raise RunDirError(  # e.g. RUN_DIR/model/, a run's export: the fresh run would clear it
            f"model.path {cfg.model.path} is inside the run directory {run_dir}, which a fresh run clears: "
            "copy the model elsewhere or choose another run.name"
        )
    threads = OrchestratorThreads()
    built = None  # a backend built here, released here if the program is not made
    lock = RunDirLock(run_dir) if run_dir is not None else None
    try:
        if backend is None:
            backend = built = _backend(checked, threads)
        check_prompts_fit(checked.cfg, checked.task, backend)
        if run_dir is not None and lock is not None:
            lock.acquire()
            if any(p.name != MARKER for p in run_dir.iterdir()):
                if not checked.cfg.run.overwrite:
                    raise RunDirError(
                        f"run directory {run_dir} is not empty and run.overwrite=false: resume it with --resume, or choose another run.name"
                    )
                lock.clear()
            write_config(run_dir, checked.cfg)
        return _program(checked, backend, RunState.fresh(checked.task.stream), run_dir, threads, callbacks, lock)
    except BaseException:
        _release(lock, built)
        raise


def resume_run(
    cfg: Config,
    run_dir: Path,
    callbacks: Sequence[Callback] = (),
    *,
    backend: Backend | None = None,
    reward_fns: Sequence[rewards.RewardEntry] | None = None,
    environment: Environment | None = None,
) -> Program:
    """A run that continues `run_dir` from its newest checkpoint with `cfg` (the recorded config
    with the changes a resume may take). The checkpoint is read under the directory's lock; the
    run directory is rewound to it and the changes recorded only once everything was validated
    and the backend built."""
    load_resume_point(run_dir)  # a run directory with a checkpoint, before it is adopted and locked
    lock = RunDirLock(run_dir)
    built = None
    try:
        lock.acquire(adopt=True)
        point = load_resume_point(run_dir)  # read again under the lock
        if point.backend != cfg.run.backend:
            raise CheckpointError(
                f"{point.directory}: written by the {point.backend!r} backend, cannot resume on {cfg.run.backend!r} (run.backend)"
            )
        if point.step >= cfg.run.steps:
            raise CheckpointError(
                f"{point.directory}: the run already trained {point.step} steps of run.steps={cfg.run.steps}; "
                "raise run.steps (--set run.steps=N) to train further"
            )
        changes = resume_changes(load_config(run_dir / "config.toml"), cfg, point.step)
        checked = _check(cfg, reward_fns, environment)
        threads = OrchestratorThreads()
        if backend is None:
            backend = built = _backend(checked, threads)
        check_prompts_fit(checked.cfg, checked.task, backend)
        rewind_run_dir(run_dir, point)
        if changes:
            append_config_changes(run_dir, changes)
        write_config(run_dir, checked.cfg)
        return _program(checked, backend, RunState.restored(checked.task.stream, point), run_dir, threads, callbacks, lock)
    except BaseException:
        _release(lock, built)
        raise


def _program(
    checked: _Checked,
    backend: Backend,
    state: RunState,
    run_dir: Path | None,
    threads: OrchestratorThreads,
    callbacks: Sequence[Callback],
    lock: RunDirLock | None,
) -> Program:
    parts = assemble(
        checked.cfg,
        backend,
        state,
        checked.rewards,
        run_dir=run_dir,
        threads=threads,
        callbacks=callbacks,
        environment=checked.environment,
        heldout=checked.task.heldout,
        agent=checked.agent,
    )
    return Program(parts, lock=lock)


def _release(lock: RunDirLock | None, built: Backend | None) -> None:
    if lock is not None:
        lock.release()
    if built is not None:
        built.cleanup()  # e.g. a Ray cluster the backend started


def _flat(cfg: Config) -> dict[str, object]:
    return {f"{section}.{key}": value for section, values in cfg.model_dump().items() for key, value in values.items()}


def resume_changes(before: Config, after: Config, done: int) -> list[dict[str, object]]:
    """The keys `after` changes from the run's recorded config after step `done`, each as a row
    to record (`from_step`: the first step trained with the new value, done + 1); a
    ConfigError names the first change a resumed run cannot take: a key without the RESUMABLE
    mark (config/schema.py)."""
    old, new = _flat(before), _flat(after)
    resumable = resumable_keys()
    rows: list[dict[str, object]] = []
    for key in new:
        if old.get(key) == new[key]:
            continue
        if key not in resumable:
            raise ConfigError(
                f"--resume cannot change {key} ({old.get(key)!r} → {new[key]!r}): steps 1–{done} "
                "were trained with the recorded value; start a new run to change it"
            )
        rows.append({"from_step": done + 1, "key": key, "old": old.get(key), "new": new[key]})
    return rows
