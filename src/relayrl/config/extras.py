"""Optional dependencies: which pip extra a config needs, checked before anything imports it.

Invariant: a config that selects something an absent optional package provides (the local
backend: torch and transformers; the vLLM rollout engine: vllm; a metric sink: its package; a reasoning-gym task or the
`reasoning_gym` / `math_verify` reward: the `tasks` extra) is refused up front with one
`MissingExtra` line naming the package, what needs it and the install command — never a
`ModuleNotFoundError` traceback from deep inside a run. Checking imports nothing: it only asks
the import system whether the module can be found.
"""

from __future__ import annotations

import importlib.util

from relayrl.config.schema import SINK_EXTRAS, SINK_MODULES, Config
from relayrl.errors import UserError

#: modules the local backend imports, all provided by the `local` extra
LOCAL_BACKEND_MODULES = ("torch", "transformers")
#: built-in rewards that need a package of the `tasks` extra: reward name → module
TASK_REWARD_MODULES = {"reasoning_gym": "reasoning_gym", "math_verify": "math_verify"}


class MissingExtra(UserError):
    """An optional package a config needs is not installed; the message says which extra has it."""

    def __init__(self, module: str, extra: str, needed_by: str) -> None:
        self.module, self.extra, self.needed_by = module, extra, needed_by
        super().__init__(
            f"{needed_by} needs the Python package {module!r}, which is not installed; "
            f"install the '{extra}' extra: pip install 'relayrl[{extra}]'"
        )


def is_installed(module: str) -> bool:
    """Whether `module` can be imported (found by the import system); nothing is imported."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refusing it; a module whose __spec__ is unset
        return False


def require(module: str, extra: str, needed_by: str = "this configuration") -> None:
    """Raise `MissingExtra` unless `module` is installed."""
    if not is_installed(module):
        raise MissingExtra(module, extra, needed_by)


def needed(cfg: Config) -> list[tuple[str, str, str]]:
    """(module, extra, what needs it) for every optional package `cfg` selects."""
    found: list[tuple[str, str, str]] = []
    if cfg.run.backend == "local":
        found += [(module, "local", "the local backend (run.backend = 'local')") for module in LOCAL_BACKEND_MODULES]
    if cfg.rollout.engine == "vllm":
        found.append(("vllm", "vllm", "the vLLM rollout engine (rollout.engine = 'vllm'; CPU machines: bash scripts/setup.sh --vllm)"))
    if cfg.ray.enabled:
        found.append(("ray", "ray", "Ray scale-out (ray.enabled / --ray)"))
    for sink in cfg.telemetry.sinks:
        found.append((SINK_MODULES[sink], SINK_EXTRAS[sink], f"the {sink} metric sink (telemetry.sinks)"))
    if cfg.task.kind == "reasoning_gym":
        found.append(("reasoning_gym", "tasks", "the reasoning_gym task (task.kind = 'reasoning_gym')"))
    for name, module in TASK_REWARD_MODULES.items():
        if name in cfg.task.reward_functions:
            found.append((module, "tasks", f"the {name} reward (task.reward_functions)"))
    return found


def check_extras(cfg: Config) -> None:
    """Raise `MissingExtra` for the first optional package `cfg` needs that is not installed."""
    for module, extra, needed_by in needed(cfg):
        require(module, extra, needed_by)
