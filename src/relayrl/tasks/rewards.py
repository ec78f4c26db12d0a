"""Reward functions: the built-ins, the registry of names, and resolving `task.reward_functions`.

A `task.reward_functions` entry is one of
- a built-in name: `REWARD_FUNCTIONS` (imported with relayrl) or `OPTIONAL_REWARDS` (a name →
  "module:function" table, imported only when a recipe names it: built-ins that need an optional
  package are registered there with one line each);
- `package.module:function`: a function of an importable module;
- `path/to/file.py:function`: a function defined in a Python file (absolute, or relative to the
  recipe's directory or the working directory: config.py turns it into an absolute path when it
  loads the recipe, so the run's config.toml names the file wherever a resume runs from).
The Python API (`run.build_program(reward_fns=...)`) also takes callables.

Where each runs (scoring.py): built-ins and callables in this process, in the scoring thread;
`async def` functions on the event loop; any other function named `module:function` or
`file.py:function` in the reward worker processes (rewardpool.py).

Invariants:
- A reward function sees one trajectory and returns a float; it may raise, hang, crash or return
  NaN, and the scorer (never the function) turns that into a failed trajectory with reward 0.
- Every entry is resolved (module imported, function found, callable) before the run starts; one
  that cannot be is a `RewardSpecError` (a ValueError: exit 2) naming the entry and its position.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType

from relayrl.types import Trajectory

RewardFunction = Callable[[Trajectory], float]
#: what a reward entry may be in the Python API: a name / spec, or a function (sync or async)
RewardEntry = str | Callable[[Trajectory], float] | Callable[[Trajectory], Awaitable[float]]


def exact_match(trajectory: Trajectory) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer."""
    return 1.0 if trajectory.completion_text.strip() == trajectory.prompt.answer.strip() else 0.0


def numeric_match(trajectory: Trajectory) -> float:
    """1.0 when the completion parses to the same number as the answer."""
    try:
        return 1.0 if float(trajectory.completion_text.strip()) == float(trajectory.prompt.answer) else 0.0
    except ValueError:
        return 0.0


_INTEGER = re.compile(r"-?\d+")


def first_integer_match(trajectory: Trajectory) -> float:
    """1.0 when the first integer in the completion equals the answer (for chatty models)."""
    found = _INTEGER.search(trajectory.completion_text)
    return 1.0 if found is not None and found.group() == trajectory.prompt.answer.strip() else 0.0


def last_integer_match(trajectory: Trajectory) -> float:
    """1.0 when the last integer in the completion equals the answer ("3 + 5 = 8" → 8)."""
    found = _INTEGER.findall(trajectory.completion_text)
    return 1.0 if found and found[-1] == trajectory.prompt.answer.strip() else 0.0


def env(trajectory: Trajectory) -> float:
    """The environment's reward parts summed (multi-turn episodes, task.environment)."""
    if trajectory.env_reward is None:
        raise ValueError("the 'env' reward needs a multi-turn environment (task.environment): this trajectory has none")
    return trajectory.env_reward


#: built-in rewards, imported with relayrl; cheap, trusted: they run in the scoring thread
REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "env": env,
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "first_integer_match": first_integer_match,
    "last_integer_match": last_integer_match,
}

#: built-in rewards imported only when a recipe names them (they need an optional package):
#: name → "module:function". Register one with one line, e.g.
#: "math_verify": "relayrl.tasks.math_verify:math_verify". Like every built-in they run in the
#: scoring thread; a user who wants one isolated with a timeout names its "module:function".
OPTIONAL_REWARDS: dict[str, str] = {
    "reasoning_gym": "relayrl.tasks.reasoning_gym:reasoning_gym_reward",  # the `tasks` extra
    "math_verify": "relayrl.tasks.math_verify:math_verify",  # the `tasks` extra
}


class RewardSpecError(ValueError):
    """A `task.reward_functions` entry that cannot be resolved; names the entry."""


class Placement(StrEnum):
    """Where a reward function runs (scoring.py)."""

    INLINE = "inline"  # this process, the scoring thread: built-ins and Python-API callables
    ASYNC = "async"  # this process, awaited on the event loop: any `async def` function
    POOL = "pool"  # a reward worker process (rewardpool.py): sync functions named by spec


@dataclass(slots=True, frozen=True)
class ResolvedReward:
    """One resolved entry. `name` keys its failure counts (ledger, summary.json); `spec` is what a
    worker process imports (`module:function` or `/abs/file.py:function`), None unless POOL."""

    name: str
    fn: Callable[[Trajectory], object]
    weight: float
    placement: Placement
    spec: str | None = None


_IDENT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def parse_spec(entry: str) -> tuple[str, str, bool] | None:
    """`module:function` → (module, function, False); `file.py:function` → (file, function, True);
    None for an entry without ':' (a built-in name). Raises ValueError for a malformed spec."""
    if ":" not in entry:
        return None
    target, _, function = entry.rpartition(":")
    if not _IDENT_PATH.fullmatch(function):
        raise ValueError(f"{function!r} after the last ':' is not a function name ('package.module:function', 'path/to/file.py:function')")
    if target.endswith(".py"):
        return target, function, True
    if not _IDENT_PATH.fullmatch(target):
        raise ValueError(f"{target!r} is neither a module name (package.module) nor a Python file (path/to/file.py)")
    return target, function, False


def file_module_name(path: Path) -> str:
    """The module name a reward file is loaded under (its stem plus a hash of its path, so two
    files with one name do not collide)."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", path.stem)
    return f"relayrl_reward_file_{stem}_{digest}"


def _load_file(path: Path) -> ModuleType:
    name = file_module_name(path)
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_function(spec: str) -> object:
    """The object `spec` (`module:function` or `file.py:function`, dotted attributes allowed)
    names, importing its module or loading its file. Raises ImportError / AttributeError /
    FileNotFoundError, or whatever importing the module raised."""
    parsed = parse_spec(spec)
    if parsed is None:
        raise ValueError(f"{spec!r} is not 'module:function' or 'file.py:function'")
    target, function, is_file = parsed
    if is_file:
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"no such file {target!r}")
        module = _load_file(path.resolve())
    else:
        module = importlib.import_module(target)
    found: object = module
    for i, part in enumerate(function.split(".")):
        try:
            found = getattr(found, part)
        except AttributeError:
            owner = target if i == 0 else f"{target}:{'.'.join(function.split('.')[:i])}"
            raise AttributeError(f"{owner} has no attribute {part!r}") from None
    return found


def load_named(spec: str) -> object:
    """What `spec` (`module:name` or `file.py:name`) names, as `import_function` finds it; a
    ValueError with one line saying why not: no such file, no such attribute, or importing the
    module (user code: it may raise anything, SystemExit included) failed."""
    parsed = parse_spec(spec)
    if parsed is None:
        raise ValueError(f"{spec!r} is not 'module:name' or 'file.py:name'")
    target, _, is_file = parsed
    if is_file and not Path(target).is_file():
        raise ValueError(f"no such file {target!r} (a relative path is looked up in the recipe's directory, then the working directory)")
    try:
        return import_function(spec)
    except AttributeError as exc:
        raise ValueError(str(exc)) from None
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        what = f"loading {target}" if is_file else f"importing module {target!r}"
        raise ValueError(f"{what} failed ({_one_line(exc)})") from None


def is_async(fn: object) -> bool:
    """Whether calling `fn` returns an awaitable: an `async def` function (also behind
    functools.partial) or an object whose `__call__` is one."""
    call = getattr(type(fn), "__call__", None)  # noqa: B004 (the class's __call__, not callable(fn))
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


def as_reward(value: object) -> float:
    """A reward function's return value as a float: a number (bool, int, float, or anything with
    `__float__`, such as a numpy scalar), never a string. NaN and infinities pass: the scorer
    turns them into failed trajectories (reason `non_finite`)."""
    if isinstance(value, float):
        return value
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        raise TypeError(f"a reward function must return a number, got {type(value).__name__}")
    return float(value)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def callable_name(fn: object) -> str:
    """How a Python-API callable is named (ledger, config.toml): `module:qualname`."""
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}"


def _spec_name(target: str, function: str, is_file: bool) -> str:
    return f"{Path(target).name}:{function}" if is_file else f"{target}:{function}"


def _resolve_one(i: int, entry: RewardEntry, weight: float) -> ResolvedReward:
    where = f"task.reward_functions[{i}]"
    if not isinstance(entry, str):
        if not callable(entry):
            raise RewardSpecError(f"{where}: {entry!r} is neither a name nor a callable")
        return ResolvedReward(callable_name(entry), entry, weight, Placement.ASYNC if is_async(entry) else Placement.INLINE)
    builtin = REWARD_FUNCTIONS.get(entry)
    if builtin is not None:
        return ResolvedReward(entry, builtin, weight, Placement.ASYNC if is_async(builtin) else Placement.INLINE)
    if entry in OPTIONAL_REWARDS:
        try:
            fn = import_function(OPTIONAL_REWARDS[entry])
        except Exception as exc:
            raise RewardSpecError(f"{where}: the built-in reward {entry!r} cannot be loaded ({_one_line(exc)})") from None
        if not callable(fn):
            raise RewardSpecError(f"{where}: the built-in reward {entry!r} ({OPTIONAL_REWARDS[entry]}) is not callable")
        return ResolvedReward(entry, fn, weight, Placement.ASYNC if is_async(fn) else Placement.INLINE)
    try:
        parsed = parse_spec(entry)
    except ValueError as exc:
        raise RewardSpecError(f"{where}: {entry!r}: {exc}") from None
    if parsed is None:
        known = ", ".join(sorted([*REWARD_FUNCTIONS, *OPTIONAL_REWARDS]))
        raise RewardSpecError(
            f"{where}: unknown reward function {entry!r} (known: {known}; "
            "or name your own as 'package.module:function' or 'path/to/file.py:function')"
        )
    target, function, is_file = parsed
    try:
        fn = load_named(entry)
    except ValueError as exc:
        raise RewardSpecError(f"{where}: {entry!r}: {exc}") from None
    if not callable(fn):
        raise RewardSpecError(f"{where}: {entry!r} is not callable (it is of type {type(fn).__name__})")
    spec = f"{Path(target).resolve()}:{function}" if is_file else entry
    name = _spec_name(target, function, is_file)
    placement = Placement.ASYNC if is_async(fn) else Placement.POOL
    return ResolvedReward(name, fn, weight, placement, spec if placement is Placement.POOL else None)


def resolve_rewards(entries: Sequence[RewardEntry], weights: Sequence[float] | None = None) -> list[ResolvedReward]:
    """Resolve every entry (importing user modules in this process to check them), with its weight
    (None: all 1). Names are unique: a repeated one gets `#<position>` appended."""
    if weights is not None and len(weights) != len(entries):
        raise RewardSpecError(f"task.reward_weights has {len(weights)} entries for {len(entries)} reward functions")
    resolved = [_resolve_one(i, entry, 1.0 if weights is None else float(weights[i])) for i, entry in enumerate(entries)]
    seen: set[str] = set()
    out: list[ResolvedReward] = []
    for i, r in enumerate(resolved):
        if r.name in seen:
            r = ResolvedReward(f"{r.name}#{i}", r.fn, r.weight, r.placement, r.spec)
        seen.add(r.name)
        out.append(r)
    return out


def resolve(names: Sequence[RewardEntry]) -> list[RewardFunction]:
    """The functions of `names` in this process (no weights, no placement): what the held-out
    evaluator calls when it has no scorer (tests, standalone use)."""
    return [r.fn for r in resolve_rewards(names)]  # type: ignore[misc]
