"""Build a run from a config: run directory, backend, prompts, reward functions.

Invariant: everything that can be rejected (config, task data, model path, the checkpoint to
resume) is checked here, before the run directory is written.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from relayrl.backends.bundle import Backend, build_sim_backend
from relayrl.callbacks import Callback
from relayrl.checkpoint import CheckpointError, load_resume_point, rewind_run_dir
from relayrl.config import Config
from relayrl.program import Program
from relayrl.tasks import rewards
from relayrl.tasks.build import build_task
from relayrl.threads import Workers


def run_dir_for(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def build_program(
    cfg: Config, callbacks: Sequence[Callback] = (), run_dir: Path | None = None, backend: Backend | None = None,
    resume: bool = False,
) -> Program:
    """A program for `cfg`; with `resume`, one that continues `run_dir` from its newest checkpoint
    (CheckpointError, a ValueError, if there is none or the run already did `run.steps`)."""
    point = None
    if resume:
        if run_dir is None:
            raise ValueError("resume needs a run directory")
        point = load_resume_point(run_dir)
        if point.backend != cfg.run.backend:
            raise CheckpointError(
                f"{point.directory}: written by the {point.backend!r} backend, cannot resume on {cfg.run.backend!r} (run.backend)"
            )
        if point.next_step >= cfg.run.steps:
            raise CheckpointError(
                f"{point.directory}: the run already trained {point.next_step} steps of run.steps={cfg.run.steps}; "
                "raise run.steps (--set run.steps=N) to train further"
            )
    reward_fns = rewards.resolve(cfg.task.reward_functions)
    task = build_task(cfg)
    workers = Workers()
    if backend is None:
        if cfg.run.backend == "local":
            from relayrl.backends.local.build import build_local_backend

            backend = build_local_backend(cfg, workers.abort, task.heldout)
        else:
            backend = build_sim_backend(cfg, workers.abort)
    if point is not None:
        assert run_dir is not None
        rewind_run_dir(run_dir, point)
    elif run_dir is not None and run_dir.exists() and any(run_dir.iterdir()):
        if not cfg.run.overwrite:
            raise ValueError(
                f"run directory {run_dir} is not empty and run.overwrite=false: "
                "resume it with --resume, or choose another run.name"
            )
        shutil.rmtree(run_dir)
    return Program(cfg, backend, task.stream, reward_fns, run_dir=run_dir, workers=workers, callbacks=callbacks, resume=point)
