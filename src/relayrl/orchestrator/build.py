"""Build a run from a config: run directory, backend, prompts, reward functions.

Invariant: everything that can be rejected (config, task data, reward functions — each entry
imported and found callable —, the environment, model path, the checkpoint to resume, a config change a resumed run
cannot take) is checked here, before the run directory is written; the run directory is locked
(rundir/lock.py) before anything in it is changed, and only a directory proven to be a relayrl run
directory is ever cleared.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from relayrl.backends.bundle import Backend
from relayrl.backends.registry import build_backend
from relayrl.config.schema import Config, ConfigError, load_config
from relayrl.config.sizing import check_fits
from relayrl.envs import build_environment
from relayrl.envs.base import Environment
from relayrl.orchestrator.program import Program
from relayrl.rewards import registry as rewards
from relayrl.rundir.checkpoint import CheckpointError, load_resume_point, rewind_run_dir
from relayrl.rundir.files import append_config_changes
from relayrl.rundir.lock import MARKER, RunDirLock
from relayrl.tasks.build import build_task
from relayrl.telemetry.callbacks import Callback
from relayrl.threads import Workers


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
    if reward_fns is not None:
        if not reward_fns:
            raise ValueError("reward_fns: give at least one reward function")
        cfg = cfg.model_copy(deep=True)
        cfg.task.reward_functions = [f if isinstance(f, str) else rewards.callable_name(f) for f in reward_fns]
    lock = RunDirLock(run_dir) if run_dir is not None else None
    built: Backend | None = None  # a backend built here, released here if the program is not made
    try:
        point = None
        changes: list[dict[str, object]] = []
        if resume:
            if run_dir is None or lock is None:
                raise ValueError("resume needs a run directory")
            load_resume_point(run_dir)  # a run directory with a checkpoint, before it is adopted and locked
            lock.acquire(adopt=True)
            point = load_resume_point(run_dir)  # read again under the lock
            if point.backend != cfg.run.backend:
                raise CheckpointError(
                    f"{point.directory}: written by the {point.backend!r} backend, cannot resume on {cfg.run.backend!r} (run.backend)"
                )
            if point.next_step >= cfg.run.steps:
                raise CheckpointError(
                    f"{point.directory}: the run already trained {point.next_step} steps of run.steps={cfg.run.steps}; "
                    "raise run.steps (--set run.steps=N) to train further"
                )
            changes = resume_changes(load_config(run_dir / "config.toml"), cfg, point.next_step)
        check_fits(cfg)
        entries = list(reward_fns) if reward_fns is not None else list(cfg.task.reward_functions)
        resolved = rewards.resolve_rewards(entries, cfg.task.reward_weights)
        if environment is None and cfg.task.environment is not None:
            environment = build_environment(cfg.task.environment, cfg.task.environment_config, cfg.rollout.max_turns)
        elif environment is not None and cfg.task.environment is None:
            raise ValueError("environment: set task.environment too (its name is recorded in the run's config.toml)")
        task = build_task(cfg)
        workers = Workers()
        if backend is None:  # run.backend's compute kind, placed by the ray.enabled host
            backend = built = build_backend(cfg, workers.abort, evaluate=cfg.eval.enabled and bool(task.heldout))
        if point is not None:
            assert run_dir is not None
            rewind_run_dir(run_dir, point)
            if changes:
                append_config_changes(run_dir, changes)
        elif run_dir is not None and lock is not None:
            lock.acquire()
            if any(p.name != MARKER for p in run_dir.iterdir()):
                if not cfg.run.overwrite:
                    raise ValueError(
                        f"run directory {run_dir} is not empty and run.overwrite=false: resume it with --resume, or choose another run.name"
                    )
                lock.clear()
        return Program(
            cfg,
            backend,
            task.stream,
            resolved,
            run_dir=run_dir,
            workers=workers,
            callbacks=callbacks,
            resume=point,
            lock=lock,
            environment=environment,
            heldout=task.heldout,
        )
    except BaseException:
        if lock is not None:
            lock.release()
        if built is not None:
            built.cleanup()  # e.g. a Ray cluster the backend started
        raise


# Keys a resume may change: they decide how the run is hosted, logged, checkpointed, evaluated or
# how long it goes on, never what a step computes. Everything else is fixed by the steps already
# trained (a different group size, learning rate or task would make one run of two experiments).
RESUMABLE_KEYS = (
    "run.steps",
    "run.overwrite",
    "orchestrator.",
    "eval.",
    "telemetry.",
    "ray.",
    "rollout.sampler_threads",
    "rollout.sampler_nice",
    "rollout.sampler_failover",
    "rollout.episode_cache_mb",
    "train.torch_threads",
    # how reward functions are hosted and bounded, and whether a failed call fails the run
    "task.reward_workers",
    "task.reward_timeout_s",
    "task.reward_concurrency",
    "task.reward_memory_mb",
    "task.reward_cpu_s",
    "task.strict_rewards",
    "sim.generate",
    "sim.train_step",
    "sim.optim_step",
    "sim.get_metrics",
    "sim.weight_sync",
    "sim.pack_per_microbatch",
    "sim.reduce_metrics",
    "sim.log_metrics",
    "sim.log_trajectories",
    "sim.on_step_end",
    "sim.release_memory",
)


def _flat(cfg: Config) -> dict[str, object]:
    return {f"{section}.{key}": value for section, values in cfg.model_dump().items() for key, value in values.items()}


def resume_changes(before: Config, after: Config, next_step: int) -> list[dict[str, object]]:
    """The keys `after` changes from the run's recorded config, each as a row to record; a
    ConfigError names the first change a resumed run cannot take."""
    old, new = _flat(before), _flat(after)
    rows: list[dict[str, object]] = []
    for key in new:
        if old.get(key) == new[key]:
            continue
        if not key.startswith(RESUMABLE_KEYS):
            raise ConfigError(
                f"--resume cannot change {key} ({old.get(key)!r} → {new[key]!r}): steps 0–{next_step - 1} "
                "were trained with the recorded value; start a new run to change it"
            )
        rows.append({"from_step": next_step, "key": key, "old": old.get(key), "new": new[key]})
    return rows
