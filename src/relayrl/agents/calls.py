"""One agent call: the user's agent run on one episode's context, bounded, and what came of it.

Job: `call_agent` runs `agent(ctx)` in a task of its own (agents/tasks.py's `EpisodeTasks`), waits
for it at most `timeout_s` (0: no bound), calls `closing()` (where the caller closes the
endpoint's episode, so that nothing is recorded afterwards), ends the episode's tasks and returns
the `Outcome`: the reward the agent returned (None: the reward functions score the episode), or
why its sample fails (`failure`: reason and a one-line detail), whether it raised
KeyboardInterrupt (the run stops) and its longest step holding the event loop. It runs the same
in the run's process (agents on the run's event loop) and in an agent process
(agents/processes.py, `rollout.agent_processes`), where the `Outcome` travels back pickled.

Invariants (the failure reasons, as orchestrator/stages/agents.py documents them):
- an agent that raises anything (SystemExit, GeneratorExit and a CancelledError of its own
  included) fails as `raised` with "Type: message" on one line, at most ~300 characters, `keys`
  (the episode's API key, the run's secret) redacted before it is cut; KeyboardInterrupt is
  `interrupted` instead (asyncio would let it break the event loop);
- past `timeout_s` the agent is cancelled and fails as `timeout` (noting when it ignored the
  cancelling and was left running);
- a return value that is neither None nor a real number within ±MAX_ABS_REWARD fails as `raised`
  (a type) or `non_finite` (NaN, an infinity, 2**70); a coroutine returned is closed.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import reprlib
from collections.abc import Callable
from dataclasses import dataclass

from relayrl.agents.context import AgentContext, AgentFn, redact
from relayrl.agents.tasks import Clocked, EpisodeTasks
from relayrl.rewards.registry import MAX_ABS_REWARD, OUT_OF_RANGE

__all__ = ["Outcome", "call_agent", "one_line"]


@dataclass(slots=True, frozen=True)
class Outcome:
    """What came of one agent call (see the module)."""

    reward: float | None = None
    failure: tuple[str, str] | None = None  # (reason, detail)
    interrupted: bool = False  # it raised KeyboardInterrupt
    longest_step_s: float = 0.0  # its longest step between two awaits


async def call_agent(
    agent: AgentFn, ctx: AgentContext, timeout_s: float, name: str, closing: Callable[[], None], keys: tuple[str, ...] = ()
) -> Outcome:
    """Run `agent(ctx)` as the module says; `name` names its task, `keys` are redacted from what it
    raised besides `ctx.api_key`. `closing` runs also when this is cancelled (then the episode's
    tasks are ended and the cancellation goes on)."""
    longest = [0.0]

    def report(seconds: float) -> None:
        longest[0] = max(longest[0], seconds)

    tasks = EpisodeTasks(name)
    call = tasks.start(_guarded(agent, ctx, report))
    timed_out = False
    try:
        done, _ = await asyncio.wait({call}, timeout=timeout_s if timeout_s > 0 else None)
        timed_out = not done
    finally:  # also when cancelled: the episode and every task of its agent end here
        try:
            closing()
        finally:
            await tasks.end()
    if timed_out:
        detail = f"no return within rollout.agent_timeout_s = {timeout_s:g} s"
        if not call.done():
            detail += "; it ignored cancelling and was left running"
        return Outcome(failure=("timeout", detail), longest_step_s=longest[0])
    if call.cancelled():  # nobody cancelled it: the agent raised CancelledError itself
        return Outcome(failure=("raised", "CancelledError (raised by the agent, not a cancellation)"), longest_step_s=longest[0])
    value, error = call.result()
    if isinstance(error, KeyboardInterrupt):
        return Outcome(interrupted=True, longest_step_s=longest[0])
    if error is not None:
        return Outcome(failure=("raised", one_line(error, (ctx.api_key, *keys))), longest_step_s=longest[0])
    reward, failure = _reward(value)
    return Outcome(reward, failure, longest_step_s=longest[0])


async def _guarded(agent: AgentFn, ctx: AgentContext, report: Callable[[float], None]) -> tuple[object, BaseException | None]:
    """(what the agent returned, None) or (None, what it raised): whatever its code raises,
    SystemExit and KeyboardInterrupt included, ends its task normally (asyncio lets those two
    break the loop); a CancelledError ends it cancelled. `report` gets its longest step."""
    try:
        call = agent(ctx)
        return (await Clocked(call, report) if inspect.iscoroutine(call) else await call), None
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # the agent's own code
        return None, exc


def _reward(value: object) -> tuple[float | None, tuple[str, str] | None]:
    """(reward, failure) of what an agent returned: None, or a real number within ±MAX_ABS_REWARD."""
    if value is None:
        return None, None
    if inspect.iscoroutine(value):
        value.close()  # never awaited: closed here rather than warned about when collected
        return None, ("raised", "returned a coroutine (an un-awaited call?), not a number or None")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None, ("raised", f"returned a {type(value).__name__}, not a number or None")
    try:
        reward = float(value)
    except OverflowError:
        reward = math.inf
    if not math.isfinite(reward):
        return None, ("non_finite", f"returned {_short(value)}")
    if abs(reward) > MAX_ABS_REWARD:  # a count, 2**70: a bug, not a signal (as for reward functions)
        return None, ("non_finite", f"returned {_short(value)}: {OUT_OF_RANGE}")
    return reward, None


def _short(value: object) -> str:
    """`repr(value)`, at most ~100 characters (a huge int's digits are elided)."""
    short = reprlib.Repr()
    short.maxlong = short.maxother = 100
    return short.repr(value)


def one_line(exc: BaseException, keys: tuple[str, ...] = ()) -> str:
    """`Type: message` on one line, at most ~300 characters, `keys` redacted (before it is cut, so
    no part of one is left); an exception whose str() fails too."""
    try:
        text = " ".join(redact(str(exc), keys).split())
    except Exception:  # its __str__ raises: the type says enough
        text = "(its message could not be read)"
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."
