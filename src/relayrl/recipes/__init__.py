"""The recipes shipped inside the package (``default.toml``, ``sim.toml``, ``smollm2.toml``).

Invariant: this module imports nothing from relayrl, so the CLI, the benchmarks and the tests
can all name the shipped recipes without importing one another.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped_recipe(name: str) -> Path:
    """Path of a shipped recipe, e.g. ``shipped_recipe("sim")`` for ``recipes/sim.toml``."""
    return Path(str(resources.files(__name__) / f"{name}.toml"))


def default_recipe() -> Path:
    """What ``relayrl train`` runs without a recipe argument."""
    return shipped_recipe("default")
