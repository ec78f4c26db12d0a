"""Build a run from a config: run directory, backend, prompts, reward functions.

Invariant: everything that can be rejected (config, task data, model path) is checked here,
before the run directory is written.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from relayrl.backends.bundle import Backend, build_sim_backend
from relayrl.callbacks import Callback
from relayrl.config import Config
from relayrl.program import Program
from relayrl.tasks import rewards
from relayrl.tasks.build import build_task
from relayrl.threads import Workers


def run_dir_for(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def build_program(cfg: Config, callbacks: Sequence[Callback] = (), run_dir: Path | None = None, backend: Backend | None = None) -> Program:
    reward_fns = rewards.resolve(cfg.task.reward_functions)
    task = build_task(cfg)
    workers = Workers()
    if backend is None:
        if cfg.run.backend == "local":
            from relayrl.backends.local.build import build_local_backend

            backend = build_local_backend(cfg, workers.abort, task.heldout)
        else:
            backend = build_sim_backend(cfg, workers.abort)
    if run_dir is not None and run_dir.exists() and cfg.run.overwrite:
        shutil.rmtree(run_dir)
    return Program(cfg, backend, task.stream, reward_fns, run_dir=run_dir, workers=workers, callbacks=callbacks)
