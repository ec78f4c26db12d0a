"""The tests' one way to run the command line (and other Python programs) in a child process:
one environment (offline, no telemetry, Ray auth off) plus what a test adds."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

BASE_ENV = {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, with `BASE_ENV` and then `extra` on top."""
    return {**os.environ, **BASE_ENV, **(extra or {})}


def relayrl_argv(*args: str) -> list[str]:
    """The argv of `relayrl ARGS` run by this interpreter (for a test that needs Popen)."""
    return [sys.executable, "-m", "relayrl", *args]


def run_python(
    *args: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python ARGS` (a script, `-c CODE`, `-m MODULE`) to completion, its output captured as text."""
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=child_env(env), capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn
    )


def relayrl(
    *args: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`relayrl ARGS` to completion, its output captured as text."""
    return run_python("-m", "relayrl", *args, cwd=cwd, env=env, timeout=timeout, preexec_fn=preexec_fn)
