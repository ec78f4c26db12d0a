"""Reward functions: the built-ins, the registry of names, and resolving `task.reward_functions`.

A `task.reward_functions` entry is one of
- a built-in name: `REWARD_FUNCTIONS` (imported with relayrl) or `OPTIONAL_REWARDS` (a name →
  "module:function" table, imported only when a recipe names it: built-ins that need an optional
  package are registered there with one line each);
- `package.module:function`: a function of an importable module;
- `path/to/file.py:function`: a function defined in a Python file (absolute, or relative to the
  recipe's directory or the working directory: config/schema.py turns it into an absolute path when it
  loads the recipe, so the run's config.toml names the file wherever a resume runs from).
The Python API (`run.build_program(reward_fns=...)`) also takes callables.

Where each runs (its `Placement`; rewards/scoring.py runs them): the `REWARD_FUNCTIONS` built-ins (string
and regex checks that cannot hang) in this process, in the scoring thread, with no deadline and
on the trajectory itself; every other function with a deadline (`task.reward_timeout_s`) and on a
copy: `async def` functions on the event loop, Python-API sync callables in a reward call thread
(rewards/threads.py), and any other sync function (the `OPTIONAL_REWARDS` built-ins, which evaluate
model output with heavy libraries such as sympy, and every `module:function` / `file.py:function`)
in the reward worker processes (rewards/pool.py).

Invariants:
- A reward function sees one trajectory and returns a number (`as_reward`); it may raise, hang,
  crash or return NaN or a number beyond ±`MAX_ABS_REWARD`, and the scorer (never the function)
  turns that into a failed trajectory with reward 0.
- Every entry is resolved (module imported, function found, callable with one positional argument,
  not a class) before the run starts; one that cannot be is a `RewardSpecError` (a ValueError:
  exit 2) naming the entry and its position.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import numbers
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import cast

from relayrl.errors import UserError
from relayrl.types import Trajectory

RewardFunction = Callable[[Trajectory], float]

#: the largest reward magnitude a function may return: a value beyond ±MAX_ABS_REWARD (or NaN, an
#: infinity, an int too large for a float) fails its call with reason `non_finite`
#: (docs/rewards.md); rewards that large are a bug (a count, 2**70), not a signal
MAX_ABS_REWARD = 1e6
#: how a failed call's detail says so
OUT_OF_RANGE = f"out of range (|r| > {MAX_ABS_REWARD:g})".replace("e+0", "e").replace("e+", "e")
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


#: built-in rewards, imported with relayrl: string and regex checks that cannot hang, trusted not to
#: change the trajectory; they run in the scoring thread on the trajectory itself, with no deadline
REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "env": env,
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "first_integer_match": first_integer_match,
    "last_integer_match": last_integer_match,
}

#: built-in rewards imported only when a recipe names them (they need an optional package):
#: name → "module:function". Register one with one line, e.g.
#: "math_verify": "relayrl.rewards.math_verify:math_verify". They evaluate model output with heavy
#: libraries (sympy parses untrusted LaTeX, some reasoning-gym datasets evaluate expressions), which
#: can hang: they run in the reward worker processes, each call bounded by task.reward_timeout_s.
OPTIONAL_REWARDS: dict[str, str] = {
    "reasoning_gym": "relayrl.tasks.reasoning_gym:reasoning_gym_reward",  # the `tasks` extra
    "math_verify": "relayrl.rewards.math_verify:math_verify",  # the `tasks` extra
}


class RewardSpecError(UserError):
    """A `task.reward_functions` entry that cannot be resolved; names the entry."""


class Placement(StrEnum):
    """Where a reward function runs (rewards/scoring.py)."""

    INLINE = "inline"  # the scoring thread, no deadline, the trajectory itself: REWARD_FUNCTIONS built-ins
    THREAD = "thread"  # a reward call thread with a deadline, on a copy: Python-API sync callables
    ASYNC = "async"  # awaited on the event loop with a deadline, on a copy: any `async def` function
    POOL = "pool"  # a reward worker process with a deadline (rewards/pool.py): other sync functions


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
        raise UserError(f"{function!r} after the last ':' is not a function name ('package.module:function', 'path/to/file.py:function')")
    if target.endswith(".py"):
        return target, function, True
    if not _IDENT_PATH.fullmatch(target):
        raise UserError(f"{target!r} is neither a module name (package.module) nor a Python file (path/to/file.py)")
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
        raise UserError(f"{spec!r} is not 'module:function' or 'file.py:function'")
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
        raise UserError(f"{spec!r} is not 'module:name' or 'file.py:name'")
    target, _, is_file = parsed
    if is_file and not Path(target).is_file():
        raise UserError(f"no such file {target!r} (a relative path is looked up in the recipe's directory, then the working directory)")
    try:
        return import_function(spec)
    except AttributeError as exc:
        raise UserError(str(exc)) from None
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        what = f"loading {target}" if is_file else f"importing module {target!r}"
        raise UserError(f"{what} failed ({_one_line(exc)})") from None


def is_async(fn: object) -> bool:
    """Whether calling `fn` returns an awaitable: an `async def` function (also behind
    functools.partial) or an object whose `__call__` is one."""
    call = getattr(type(fn), "__call__", None)  # noqa: B004 (the class's __call__, not callable(fn))
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


class NonFiniteReward(ValueError):
    """A reward function returned a number that is no finite float (an int beyond the float
    range): its call fails with reason `non_finite`, not `raised`."""


def _type_name(value: object) -> str:
    return "None" if value is None else type(value).__name__


def as_reward(value: object) -> float:
    """A reward function's return value as a float (exactly `float`, never a subclass such as
    numpy.float64): a Python int, float or bool, a numpy integer, floating-point or bool scalar, a
    0-d array, or anything else with `__float__` (a Fraction, a Decimal, a 0-d tensor). NaN,
    infinities and values beyond ±MAX_ABS_REWARD pass: the scorer fails their calls (`non_finite`).
    Raises NonFiniteReward for an int too large for a float, and TypeError naming the type for
    anything else: a string, None, a list, a complex number, an array with one dimension or more."""
    if value.__class__ is float:
        return value
    if isinstance(value, str | bytes | bytearray) or not hasattr(value, "__float__"):
        raise TypeError(f"a reward function must return a number, got {_type_name(value)}")
    shape = getattr(value, "shape", ())
    if getattr(value, "ndim", 0) or shape:
        raise TypeError(f"a reward function must return a number, got {_type_name(value)} of shape {tuple(shape)}")
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        raise TypeError(f"a reward function must return a real number, got {_type_name(value)}")
    try:
        return float(value)
    except OverflowError:
        size = f"{value.bit_length()} bits" if isinstance(value, int) else _type_name(value)
        raise NonFiniteReward(f"{OUT_OF_RANGE}: returned a number too large for a float ({size})") from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a reward function must return a number, got {_type_name(value)} ({_one_line(exc)})") from None


def _copy_json(value: object) -> object:
    """A copy of JSON-like data (dicts, lists, tuples nested; other values are immutable)."""
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy_json(v) for v in value] if isinstance(value, list) else tuple(_copy_json(v) for v in value)
    return value


def trajectory_copy(t: Trajectory) -> Trajectory:
    """A copy of `t` that shares nothing a reward function could change with it: its lists, its
    turns and its prompt's metadata are copied (the rest is immutable). What an in-process user
    function receives, so one that changes its argument cannot corrupt the trajectory trained on
    (a worker process receives a pickled copy). About 2 µs for a 200-token completion."""
    c = copy.copy(t)  # every field, so one added to Trajectory is never dropped; then the mutable ones
    p = t.prompt
    c.prompt = dataclasses.replace(p, metadata=_copy_json(p.metadata)) if p.metadata else p  # type: ignore[arg-type]
    c.prompt_tokens = t.prompt_tokens[:]
    c.completion_tokens = t.completion_tokens[:]
    c.sampler_logprobs = t.sampler_logprobs[:]
    c.turns = [copy.copy(x) for x in t.turns]  # a Turn's fields are immutable
    c.loss_mask = None if t.loss_mask is None else t.loss_mask[:]
    c.versions = None if t.versions is None else t.versions[:]  # of immutable tuples
    c.turn_advantages = None if t.turn_advantages is None else t.turn_advantages[:]
    return c


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


_TRAJECTORY = object()  # what a signature check binds in place of a trajectory


def check_callable(fn: object) -> str | None:
    """Why `fn` cannot be a reward function (None if it can): it must be callable with one
    positional argument, the trajectory, and not be a class (calling a class constructs an
    object, not a reward). A callable without a signature (some C builtins) is let through: its
    calls will say."""
    if not callable(fn):
        return f"is not callable (it is of type {_type_name(fn)})"
    if inspect.isclass(fn):
        return (
            f"is a class ({fn.__name__}): calling it constructs an object, not a reward; "
            "name a function, or an instance with __call__(self, trajectory)"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a C builtin without a text signature: the call will tell
        return None
    try:
        signature.bind(_TRAJECTORY)
    except TypeError as exc:
        return f"cannot be called with one argument, the trajectory: its signature is {signature} ({exc})"
    return None


def _checked(where: str, what: str, fn: object) -> Callable[[Trajectory], object]:
    problem = check_callable(fn)
    if problem is not None:
        raise RewardSpecError(f"{where}: {what} {problem}")
    return cast(Callable[[Trajectory], object], fn)


def _resolve_one(i: int, entry: RewardEntry, weight: float) -> ResolvedReward:
    where = f"task.reward_functions[{i}]"
    if not isinstance(entry, str):
        if not callable(entry):
            raise RewardSpecError(f"{where}: {entry!r} is neither a name nor a callable")
        name = callable_name(entry)
        _checked(where, repr(name), entry)
        return ResolvedReward(name, entry, weight, Placement.ASYNC if is_async(entry) else Placement.THREAD)
    builtin = REWARD_FUNCTIONS.get(entry)
    if builtin is not None:
        _checked(where, f"the built-in reward {entry!r}", builtin)
        return ResolvedReward(entry, builtin, weight, Placement.ASYNC if is_async(builtin) else Placement.INLINE)
    if entry in OPTIONAL_REWARDS:
        spec = OPTIONAL_REWARDS[entry]
        try:
            fn = import_function(spec)
        except Exception as exc:
            raise RewardSpecError(f"{where}: the built-in reward {entry!r} cannot be loaded ({_one_line(exc)})") from None
        fn = _checked(where, f"the built-in reward {entry!r} ({spec})", fn)
        if is_async(fn):
            return ResolvedReward(entry, fn, weight, Placement.ASYNC)
        return ResolvedReward(entry, fn, weight, Placement.POOL, spec)
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
    fn = _checked(where, repr(entry), fn)
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
