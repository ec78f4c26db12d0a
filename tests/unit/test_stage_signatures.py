"""The stages take their settings (numbers, flags, kinds, timeouts, bounds) by keyword only, so two
adjacent ones cannot be swapped silently at a call; queues, workers and the like may be
positional. Checked on every public function and class constructor of orchestrator/stages/."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

MODULES = ["dispatch", "sample", "collect", "episodes", "score", "advantage", "sync", "train_loop"]
# a setting's annotation: a number, a flag or a kind, optionally None
SETTING = re.compile(r"^(int|float|bool|AdvantageKind)( \| None)?$")
VALUES = {"sync.VersionSignal"}  # holds one number, its value: not a setting


def _callables() -> list[tuple[str, object]]:
    found: list[tuple[str, object]] = []
    for name in MODULES:
        module = importlib.import_module(f"relayrl.orchestrator.stages.{name}")
        for attr, obj in vars(module).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__ or f"{name}.{attr}" in VALUES:
                continue
            if inspect.isfunction(obj) or (inspect.isclass(obj) and not issubclass(obj, BaseException)):
                found.append((f"{name}.{attr}", obj))
    return found


def _positional_settings(obj: object) -> list[str]:
    try:
        params = inspect.signature(obj).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a protocol, or a class without a signature of its own
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in positional and isinstance(p.annotation, str) and SETTING.match(p.annotation)]


def test_the_stages_are_found() -> None:
    names = {name for name, _ in _callables()}
    assert {"dispatch.dispatch_stage", "advantage.advantage_stage", "score.score_stage", "train_loop.GroupTaker"} <= names
    assert {"train_loop.PackingSpec", "episodes.EpisodeSettings", "sample.SingleTurn", "advantage.filter_reason"} <= names


@pytest.mark.parametrize(("name", "obj"), _callables(), ids=[name for name, _ in _callables()])
def test_settings_are_keyword_only(name: str, obj: object) -> None:
    assert _positional_settings(obj) == [], f"{name}: settings taken by position"
