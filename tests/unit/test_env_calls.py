"""envs/calls.py: an environment's calls, each bounded, none able to hang the caller, each with
exactly one outcome (its value, `raised` or `timeout`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from relayrl import abandoned
from relayrl.envs import calls as calls_module
from relayrl.envs.calls import CallFailed, EnvCalls, TooManyStuckCalls


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of the test: the stuck calls it made return, their threads end."""
    event = threading.Event()
    yield event
    event.set()


def _call(fn: Callable[[object], object], where: str = "step") -> tuple[Callable[[object], object], object, str]:
    return (fn, None, where)


def test_a_sync_call_past_its_bound_times_out_and_the_rest_go_on_in_a_new_thread(release: threading.Event) -> None:
    threads: list[str] = []

    def stuck(_: object) -> object:
        threads.append(threading.current_thread().name)
        release.wait()
        return "late"

    def quick(_: object) -> object:
        threads.append(threading.current_thread().name)
        return "ok"

    env_calls = EnvCalls(0.2)
    out = asyncio.run(env_calls.run([_call(quick), _call(stuck), _call(quick)]))
    assert [value for value, _ in out] == ["ok", CallFailed("timeout", "no result within 0.2 s (rollout.env_step_timeout_s)"), "ok"]
    assert out[1][1] == 0.2
    assert len(env_calls.abandoned()) == 1 and env_calls.abandoned()[0].name == "relayrl-env-call (abandoned)"
    assert threads[0] == threads[1] == "relayrl-env-call"  # the first thread ran the stuck call; a new one ran the last


def test_whatever_a_call_raises_is_its_outcome(release: threading.Event) -> None:
    def raiser(exc: BaseException) -> Callable[[object], object]:
        def call(_: object) -> object:
            raise exc

        return call

    async def async_exit(_: object) -> object:
        raise SystemExit(3)

    async def async_cancelled(_: object) -> object:
        raise asyncio.CancelledError

    batch = [_call(raiser(SystemExit(3))), _call(raiser(KeyboardInterrupt())), _call(raiser(GeneratorExit())), _call(raiser(KeyError("k")))]
    batch += [_call(async_exit), _call(async_cancelled)]
    out = asyncio.run(EnvCalls(0).run(batch))
    assert [value for value, _ in out] == [
        CallFailed("raised", "SystemExit: 3"),
        CallFailed("raised", "KeyboardInterrupt"),
        CallFailed("raised", "GeneratorExit"),
        CallFailed("raised", "KeyError: 'k'"),
        CallFailed("raised", "SystemExit: 3"),
        CallFailed("raised", "CancelledError (raised by the environment, not a cancellation)"),
    ]


def test_an_async_call_past_its_bound_is_cancelled_and_one_that_ignores_it_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls_module, "CANCEL_GRACE_S", 0.05)
    cancelled: list[str] = []

    async def forever(_: object) -> object:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.append("forever")
        return None

    async def stubborn(_: object) -> object:
        for _ in range(3):
            try:
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                cancelled.append("stubborn ignored it")
        return "late"

    async def quick(_: object) -> object:
        return "ok"

    async def main() -> list[tuple[object, float]]:
        out = await EnvCalls(0.1).run([_call(forever), _call(stubborn), _call(quick)])
        await asyncio.sleep(0.5)  # the stubborn call ends on its own, its outcome dropped
        return out

    out = asyncio.run(main())
    timeout = CallFailed("timeout", "no result within 0.1 s (rollout.env_step_timeout_s)")
    assert [value for value, _ in out] == [timeout, timeout, "ok"]
    assert set(cancelled) == {"forever", "stubborn ignored it"}
    assert abandoned.running() == 0  # the stubborn call, abandoned, ended and was let go


def test_cancelling_the_caller_abandons_a_stuck_sync_call_at_once(release: threading.Event) -> None:
    started = threading.Event()
    ran: list[str] = []

    def stuck(_: object) -> object:
        started.set()
        release.wait()
        return "late"

    def after(_: object) -> object:
        ran.append("after")
        return "ok"

    env_calls = EnvCalls(0)  # no bound: only cancelling ends the wait

    async def main() -> None:
        task = asyncio.create_task(env_calls.run([_call(stuck), _call(after)]))
        await asyncio.to_thread(started.wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())  # returns although the call still runs
    stuck_threads = [t for t in threading.enumerate() if t.name == "relayrl-env-call (abandoned)"]
    assert stuck_threads and all(t.daemon for t in stuck_threads)
    release.set()
    for t in stuck_threads:
        t.join()
    assert ran == []  # an abandoned thread starts no further call


def test_too_many_stuck_sync_calls_raise_naming_the_call(release: threading.Event) -> None:
    def stuck(_: object) -> object:
        release.wait()
        return "late"

    env_calls = EnvCalls(0.05, max_abandoned=1)
    out = asyncio.run(env_calls.run([_call(stuck, "step 1")]))
    assert isinstance(out[0][0], CallFailed)
    with pytest.raises(TooManyStuckCalls) as info:
        asyncio.run(env_calls.run([_call(stuck, "step 2")]))
    assert info.value.where == "step 2" and info.value.running == 2


def test_batches_of_plain_calls_take_turns_so_sync_code_never_runs_on_two_threads_at_once() -> None:
    inside = 0
    most = 0
    lock = threading.Lock()

    def step(_: object) -> object:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        threading.Event().wait(0.02)
        with lock:
            inside -= 1
        return "ok"

    env_calls = EnvCalls(5.0)

    async def main() -> list[list[tuple[object, float]]]:
        # three batches at once: two sampler replicas and the held-out evaluation
        return await asyncio.gather(*(env_calls.run([_call(step), _call(step)]) for _ in range(3)))

    results = asyncio.run(main())
    assert [[value for value, _ in batch] for batch in results] == [["ok", "ok"]] * 3
    assert most == 1
