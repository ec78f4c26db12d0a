"""Multi-turn environments: the built-ins by name and resolving `task.environment` (the
protocol is base.py; calling an environment's methods, bounded, is calls.py).

A `task.environment` entry is one of
- a built-in name: `ENVIRONMENTS` (`arithmetic_feedback`, `calculator`, `draft_answer`);
- `package.module:Class`: a class (or any factory returning an environment) of an importable
  module;
- `path/to/file.py:Class`: one defined in a Python file (config/schema.py anchors a relative path to the
  recipe's directory or the working directory, as it does reward files).
`build_environment` calls it with `task.environment_config` as keyword arguments; a built-in also
gets `max_turns` (`rollout.max_turns`, for its last-try logic), a user's class only its options.
Specs are parsed and imported by relayrl.rewards.registry (`parse_spec`, `load_named`), so an
environment file is loaded exactly as a reward file is.

Invariant: `build_environment` returns an object with a callable `start`, or raises one
`EnvironmentSpecError` (a ValueError: exit 2) whose message names `task.environment` and the entry
(and `task.environment_config` when the options are at fault); it never lets an import error, a
TypeError or a user constructor's exception through.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import cast

from relayrl.envs.arithmetic_feedback import ArithmeticFeedback
from relayrl.envs.base import Environment, EnvStep, Episode
from relayrl.envs.calculator import Calculator
from relayrl.envs.draft_answer import DraftAnswer
from relayrl.errors import UserError
from relayrl.rewards.registry import load_named, parse_spec

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "EnvironmentSpecError", "Episode", "build_environment"]

#: built-in environments: name → class, called with the options and `max_turns`
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "arithmetic_feedback": ArithmeticFeedback,
    "calculator": Calculator,
    "draft_answer": DraftAnswer,
}


class EnvironmentSpecError(UserError):
    """A `task.environment` entry (or its `task.environment_config`) that cannot be resolved or
    constructed; names the key and the entry."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _resolve(spec: str) -> Callable[..., object]:
    """The class or factory `spec` names (not a built-in name)."""
    where = f"task.environment = {spec!r}"
    try:
        parsed = parse_spec(spec)
    except ValueError as exc:
        raise EnvironmentSpecError(f"{where}: {exc}") from None
    if parsed is None:
        known = ", ".join(sorted(ENVIRONMENTS))
        raise EnvironmentSpecError(
            f"{where}: unknown environment (known: {known}; or name your own as 'package.module:Class' or 'path/to/file.py:Class')"
        )
    try:
        found = load_named(spec)
    except ValueError as exc:
        raise EnvironmentSpecError(f"{where}: {exc}") from None
    if not callable(found):
        raise EnvironmentSpecError(f"{where} is not callable (it is of type {type(found).__name__}): name a class or a factory")
    return cast(Callable[..., object], found)


def build_environment(spec: str, options: Mapping[str, object], max_turns: int) -> Environment:
    """The environment `spec` (a built-in name, `package.module:Class` or `path/to/file.py:Class`)
    names, constructed with `options` (`task.environment_config`) as keyword arguments, plus
    `max_turns` for a built-in. Raises EnvironmentSpecError."""
    where = f"task.environment = {spec!r}"
    builtin = ENVIRONMENTS.get(spec)
    factory: Callable[..., object]
    if builtin is not None:
        if "max_turns" in options:
            raise EnvironmentSpecError(
                f"task.environment_config for {where}: 'max_turns' is set by rollout.max_turns, not in task.environment_config"
            )
        factory = builtin
        kwargs = {**options, "max_turns": max_turns}
    else:
        factory = _resolve(spec)
        kwargs = dict(options)
    try:
        signature: inspect.Signature | None = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins and C types have none: the call will tell
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            given = ", ".join(sorted(options)) or "none"
            raise EnvironmentSpecError(f"task.environment_config for {where} does not fit it (options given: {given}): {exc}") from None
    try:
        env = factory(**kwargs)
    except BaseException as exc:  # a user's constructor may raise anything, SystemExit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise EnvironmentSpecError(f"task.environment_config for {where}: constructing it failed ({_one_line(exc)})") from None
    if not callable(getattr(env, "start", None)):
        raise EnvironmentSpecError(
            f"{where} built a {type(env).__name__}, which has no callable 'start' (an environment has start(prompt) -> episode)"
        )
    return cast(Environment, env)
