"""What one reward call returns or how it fails, on every path a function can run on.

Paths (rewards/registry.py `Placement`): INLINE (a built-in, in the scoring thread), THREAD (a
Python-API sync callable, in a reward call thread with a deadline), ASYNC (awaited on the loop),
POOL (a worker process). Each numeric type a function may return is scored as its value on each
path; out-of-range values and non-numbers fail with the right reason; `task.reward_clip`;
`task.strict_rewards` fails at the first failed call without waiting for the rest of the batch;
entries that cannot be called with one argument are refused before the run; user functions get a
copy of the trajectory; Python-API callables are bounded by `task.reward_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import os
import re
import textwrap
import threading
import timeit
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.rewards import registry as rewards
from relayrl.rewards.registry import MAX_ABS_REWARD, Placement, RewardSpecError, resolve_rewards, trajectory_copy
from relayrl.rewards.scoring import RewardError, Scorer, ScorerSettings
from relayrl.rewards.threads import MAX_ABANDONED_THREADS, AbandonedRewardThreadWarning
from relayrl.threads import OrchestratorThreads
from relayrl.types import Prompt, RewardFailure, Trajectory, TrajectoryStatus, Turn
from support.cli import relayrl
from support.simutil import run_checked, sim_config
from support.trajectories import trajectory

ROOT = Path(__file__).resolve().parents[2]
SIM_RECIPE = ROOT / "src" / "relayrl" / "recipes" / "sim.toml"

VALUES = """
import numpy as np

def value(t):
    return eval(t.prompt.metadata["expr"], {"np": np})

async def avalue(t):
    return value(t)
"""


def _traj(expr: str = "1.0", group: int = 0, sample: int = 0) -> Trajectory:
    prompt = Prompt(f"p{group}", "2+2=", "4", {"expr": expr, "nested": {"xs": [1, 2]}})
    return trajectory(group=group, sample=sample, prompt=prompt, completion_tokens=[3, 4], sampler_logprobs=[-0.5, -0.25])


def _value(t: Trajectory) -> object:
    return eval(str(t.prompt.metadata["expr"]), {"np": np})


async def _avalue(t: Trajectory) -> object:
    return _value(t)


@contextlib.contextmanager
def _held(seconds: float = 90.0) -> Iterator[threading.Event]:
    """An event the test releases when it ends. It is also released after `seconds`, a safety net
    only: a scorer that waited on calls blocked on it (one without deadlines or fail-fast) then
    fails the test instead of hanging it, and the tests check it was not needed."""
    release = threading.Event()
    timer = threading.Timer(seconds, release.set)
    timer.daemon = True
    timer.start()
    try:
        yield release
    finally:
        release.set()
        timer.cancel()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


PATHS = ("inline", "thread", "async", "pool")


@pytest.fixture(scope="module")
def scorers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Scorer]]:
    """One scorer per path, each running the function that evaluates the trajectory's `expr`."""
    module = tmp_path_factory.mktemp("values") / "rwvalues.py"
    module.write_text(VALUES)
    threads = OrchestratorThreads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(rewards.REWARD_FUNCTIONS, "test_value", _value)
        entries: dict[str, object] = {"inline": "test_value", "thread": _value, "async": _avalue, "pool": f"{module}:value"}
        built = {path: Scorer(resolve_rewards([entry]), ScorerSettings(workers=1), threads) for path, entry in entries.items()}  # type: ignore[list-item]
    assert {path: s.rewards[0].placement for path, s in built.items()} == {
        "inline": Placement.INLINE,
        "thread": Placement.THREAD,
        "async": Placement.ASYNC,
        "pool": Placement.POOL,
    }
    yield built
    threads.shutdown()
    for s in built.values():
        s.close()


def _score_one(scorer: Scorer, expr: str) -> Trajectory:
    t = _traj(expr)
    asyncio.run(scorer.score([t]))
    return t


# -- 1. every numeric type is scored as its value ---------------------------------------------------

NUMBERS = [
    "3",
    "-10**6",  # the bound itself is in range
    "True",
    "0.25",
    "1e6",
    "np.int8(-3)",
    "np.int16(300)",
    "np.int32(-7)",
    "np.int64(7)",
    "np.uint8(200)",
    "np.float16(0.5)",
    "np.float32(0.25)",
    "np.float64(0.5)",
    "np.mean([0.0, 1.0])",  # a numpy.float64, what np.mean returns
    "np.bool_(True)",
    "np.array(0.75)",
    "np.array(2)",
    "np.array(False)",
]


@pytest.mark.parametrize("expr", NUMBERS)
@pytest.mark.parametrize("path", PATHS)
def test_every_numeric_type_is_scored_as_its_value_on_every_path(scorers: dict[str, Scorer], path: str, expr: str) -> None:
    t = _score_one(scorers[path], expr)
    assert (t.status, t.error) == (TrajectoryStatus.OK, None)
    assert t.reward == float(eval(expr, {"np": np})) and type(t.reward) is float


# -- 2. what is not a reward -------------------------------------------------------------------------

NOT_REWARDS = [
    ("10**400", RewardFailure.NON_FINITE, "non_finite: out of range (|r| > 1e6): returned a number too large for a float (1329 bits)"),
    ("2**70", RewardFailure.NON_FINITE, "non_finite: out of range (|r| > 1e6): returned 1.1805916207174113e+21"),
    ("-1e6 - 1", RewardFailure.NON_FINITE, "non_finite: out of range (|r| > 1e6): returned -1000001.0"),
    ("np.float32(3e7)", RewardFailure.NON_FINITE, "non_finite: out of range (|r| > 1e6): returned 30000000.0"),
    ("float('nan')", RewardFailure.NON_FINITE, "non_finite: returned nan"),
    ("np.float64('-inf')", RewardFailure.NON_FINITE, "non_finite: returned -inf"),
    ("'0.5'", RewardFailure.RAISED, "raised: TypeError: a reward function must return a number, got str"),
    ("None", RewardFailure.RAISED, "raised: TypeError: a reward function must return a number, got None"),
    ("[0.5]", RewardFailure.RAISED, "raised: TypeError: a reward function must return a number, got list"),
    ("np.array([0.5, 1.0])", RewardFailure.RAISED, "raised: TypeError: a reward function must return a number, got ndarray of shape (2,)"),
    ("np.array([0.5])", RewardFailure.RAISED, "raised: TypeError: a reward function must return a number, got ndarray of shape (1,)"),
    ("np.complex128(1+2j)", RewardFailure.RAISED, "raised: TypeError: a reward function must return a real number, got complex128"),
]


@pytest.mark.parametrize(("expr", "reason", "error"), NOT_REWARDS, ids=[e for e, _, _ in NOT_REWARDS])
@pytest.mark.parametrize("path", PATHS)
def test_what_is_not_a_reward_fails_its_call_with_its_reason(
    scorers: dict[str, Scorer], path: str, expr: str, reason: RewardFailure, error: str
) -> None:
    t = _traj(expr)
    failed = asyncio.run(scorers[path].score([t]))
    assert [(f.reason, f.trajectory) for f in failed] == [(reason, t)]
    assert t.status is TrajectoryStatus.FAILED and t.reward == 0.0
    assert t.error is not None and t.error.split(": ", 1)[1] == error, t.error
    assert MAX_ABS_REWARD == 1e6


def test_outcomes_judge_values_as_scoring_does(scorers: dict[str, Scorer]) -> None:
    trajs = [_traj("0.5"), _traj("2**70", sample=1), _traj("np.float64(1.0)", sample=2)]
    rows = asyncio.run(scorers["thread"].outcomes(trajs))
    assert rows[0] == [0.5] and rows[2] == [1.0]
    assert getattr(rows[1][0], "reason", None) is RewardFailure.NON_FINITE


def test_reward_clip_clips_each_value_before_weighting() -> None:
    threads = OrchestratorThreads()
    fns = [lambda t: float(t.sample_index) - 2.0, lambda t: 0.25 * t.sample_index]  # -2..2 and 0..1
    scorer = Scorer(resolve_rewards(fns, [2.0, 1.0]), ScorerSettings(clip=1.0), threads)
    trajs = [_traj(sample=i) for i in range(5)]
    try:
        assert asyncio.run(scorer.score(trajs)) == []
        rows = asyncio.run(scorer.outcomes(trajs))
    finally:
        threads.shutdown()
    # clip(-2..2 → -1..1) × 2, plus 0..1 unclipped
    assert [t.reward for t in trajs] == [-2.0 + 0.0, -2.0 + 0.25, 0.0 + 0.5, 2.0 + 0.75, 2.0 + 1.0]
    assert [r[0] for r in rows] == [-1.0, -1.0, 0.0, 1.0, 1.0]


def test_reward_clip_reaches_the_run_and_is_validated(tmp_path: Path) -> None:
    assert load_config(None, []).task.reward_clip == 0.0
    with pytest.raises(Exception, match="reward_clip"):
        load_config(None, ["task.reward_clip=-1"])
    cfg = sim_config("run.steps=1", "task.reward_clip=0.5")
    run_checked(build_program(cfg, run_dir=tmp_path / "run", reward_fns=[lambda t: 3.0, "exact_match"]))
    rows = pq.read_table(tmp_path / "run" / "trajectories").to_pylist()
    # 3.0 and exact_match's 1.0 both clipped to 0.5
    assert {r["reward"] for r in rows} == {0.5, 1.0}
    assert all(r["reward"] == 0.5 + (0.5 if r["completion"] == r["answer"] else 0.0) for r in rows)


# -- 3. strict_rewards fails at the first failed call ------------------------------------------------


def _strict_run(tmp_path: Path, reward_fns: list[object], *overrides: str) -> tuple[RewardError, dict[str, object]]:
    cfg = sim_config("task.strict_rewards=true", "task.reward_timeout_s=300", "task.reward_workers=2", *overrides)
    program = build_program(cfg, run_dir=tmp_path / "run", reward_fns=reward_fns)  # type: ignore[arg-type]
    with pytest.raises(RewardError) as caught:
        asyncio.run(asyncio.wait_for(program.run(), 60))  # a run that waited for its batch would take 300 s
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "RewardError" in summary["error"]
    return caught.value, summary


def test_strict_fails_at_the_first_failed_call_in_a_worker_and_kills_the_calls_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("RW_PIDS", str(pids))
    (tmp_path / "rwstrict.py").write_text(
        textwrap.dedent(
            """
            import os, threading

            def f(t):
                with open(os.path.join(os.environ["RW_PIDS"], str(os.getpid())), "w"):
                    pass
                if (t.group_id, t.sample_index) == (0, 1):
                    raise KeyError("answer")
                threading.Event().wait()  # never released: only killing the worker ends it
            """
        )
    )
    error, summary = _strict_run(tmp_path, [f"{tmp_path / 'rwstrict.py'}:f"])
    assert str(error).startswith(
        "reward function 'rwstrict.py:f' failed on trajectory 1 of group 0 (prompt 'sim-0'): raised: KeyError: 'answer'"
    )
    assert summary["ledger"]["reward_failures"] == {"rwstrict.py:f": {"raised": 1}}  # type: ignore[index]
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 2 and not [pid for pid in started if _alive(pid)]  # the hanging call's worker was killed


def test_strict_fails_at_the_first_failed_async_call_and_cancels_the_others(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []

    async def judge(t: Trajectory) -> float:
        calls.append((t.group_id, t.sample_index))
        if (t.group_id, t.sample_index) == (1, 2):
            raise ValueError("judge said no")
        await asyncio.Event().wait()  # never set
        return 1.0

    error, summary = _strict_run(tmp_path, [judge])
    assert "failed on trajectory 2 of group 1 (prompt 'sim-1'): raised: ValueError: judge said no (task.strict_rewards = true)" in str(
        error
    )
    assert error.failed is not None and error.failed.reason is RewardFailure.RAISED
    assert (1, 2) in calls and len(calls) <= 8  # the first batch (2 groups of 4); the others were cancelled
    assert list(summary["ledger"]["reward_failures"].values()) == [{"raised": 1}]  # type: ignore[index]


def test_strict_starts_no_call_after_the_first_failed_one_of_a_callable(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []

    def check(t: Trajectory) -> float:
        calls.append((t.group_id, t.sample_index))
        if (t.group_id, t.sample_index) == (0, 0):
            raise ValueError("bad row")
        release.wait()
        return 1.0

    with _held() as release:
        error, _ = _strict_run(tmp_path, [check])
        assert not release.is_set()
    assert "failed on trajectory 0 of group 0 (prompt 'sim-0'): raised: ValueError: bad row" in str(error)
    assert calls == [(0, 0)]


def test_strict_async_failure_stops_a_callable_blocked_in_its_thread(tmp_path: Path) -> None:
    blocked = threading.Event()

    def blocks(t: Trajectory) -> float:
        blocked.set()
        release.wait()
        return 1.0

    async def fails(t: Trajectory) -> float:
        if (t.group_id, t.sample_index) == (0, 1):
            await asyncio.to_thread(blocked.wait)  # the callable's call is in progress
            raise ValueError("judge down")
        return 1.0

    with _held() as release:
        error, summary = _strict_run(tmp_path, [blocks, fails])
        assert not release.is_set()  # the run failed while the callable's call still blocked
    assert "failed on trajectory 1 of group 0 (prompt 'sim-0'): raised: ValueError: judge down" in str(error)
    assert list(summary["ledger"]["reward_failures"].values()) == [{"raised": 1}]  # type: ignore[index]


# -- 4. entries that cannot be called with one argument ----------------------------------------------

SIGNATURES = """
def two(t, extra):
    return 1.0

def none():
    return 1.0

def keyword_only(t, *, scale):
    return scale

class Judge:
    def __init__(self, t):
        self.t = t

def fine(t, extra=1, *rest, **options):
    return 1.0

class Callable:
    def __call__(self, trajectory):
        return 1.0

judge = Callable()
"""


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "os:getcwd",
            "'os:getcwd' cannot be called with one argument, the trajectory: its signature is () (too many positional arguments)",
        ),
        (
            "rwsig.py:two",
            "/rwsig.py:two' cannot be called with one argument, the trajectory: its signature is (t, extra) "
            "(missing a required argument: 'extra')",
        ),
        ("rwsig.py:none", "/rwsig.py:none' cannot be called with one argument, the trajectory: its signature is ()"),
        ("rwsig.py:keyword_only", "its signature is (t, *, scale) (missing a required keyword-only argument: 'scale')"),
        ("rwsig.py:Judge", "/rwsig.py:Judge' is a class (Judge): calling it constructs an object, not a reward"),
    ],
)
def test_an_entry_that_cannot_take_a_trajectory_exits_2_naming_it(tmp_path: Path, entry: str, message: str) -> None:
    (tmp_path / "rwsig.py").write_text(SIGNATURES)
    out = tmp_path / "runs"
    done = relayrl(
        *["train", str(SIM_RECIPE), "--set", f'task.reward_functions=["rwsig.py:fine", "{entry}"]', "--set", f"run.output_dir={out}"],
        cwd=tmp_path,
        timeout=120,
        env={"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    # (Python 3.11 says "required argument" where 3.12 says "required keyword-only argument")
    said = lines[0].replace("keyword-only ", "")
    assert len(lines) == 1 and lines[0].startswith("error: task.reward_functions[1]: ") and message.replace("keyword-only ", "") in said, (
        lines
    )
    assert not out.exists()


def test_the_python_api_checks_callables_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rwsig2.py").write_text(SIGNATURES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import rwsig2  # type: ignore[import-not-found]

    refused: dict[str, object] = {
        "cannot be called with one argument, the trajectory: its signature is ()": lambda: 1.0,
        "its signature is (t, u) (missing a required argument: 'u')": lambda t, u: 1.0,
        "is a class (Judge): calling it constructs an object": rwsig2.Judge,
    }
    for message, fn in refused.items():
        with pytest.raises(RewardSpecError, match=r"task\.reward_functions\[1\]: '.*' .*" + re.escape(message)):
            build_program(sim_config(), run_dir=tmp_path / "run", reward_fns=["exact_match", fn])  # type: ignore[list-item]
    assert not (tmp_path / "run").exists()

    async def judge(t: Trajectory, retries: int = 3) -> float:
        return 1.0

    # what can take one argument passes; a builtin without a signature is let through (its calls will say)
    accepted = [rwsig2.fine, rwsig2.judge, functools.partial(rwsig2.two, extra=2), judge, max]
    assert [r.placement for r in resolve_rewards(accepted)] == [Placement.THREAD] * 3 + [Placement.ASYNC, Placement.THREAD]


# -- 5. user functions get a copy -----------------------------------------------------------------


def _every_field_set() -> Trajectory:
    t = Trajectory(
        group_id=3,
        sample_index=2,
        prompt=Prompt("p3", "text", "42", {"entry": {"xs": [1, 2, {"y": [3]}]}, "pair": (1, [2])}),
        prompt_tokens=[1, 2],
        completion_tokens=[3, 4, 5],
        sampler_logprobs=[-0.1, -0.2, 0.0],
        completion_text="4 then 2",
        policy_version=7,
        replica=1,
        reward=0.5,
        advantage=-0.25,
        status=TrajectoryStatus.FAILED,
        error="e",
        finish_reason="length",
        turns=[Turn(0, 2, 7, 1, "4 ", "obs", 0.5, True, True)],
        loss_mask=[1, 1, 0],
        env_reward=0.5,
        env_time=0.01,
        versions=[(0, 7), (2, 8)],
        overlong_penalty=-0.1,
        turn_advantages=[-0.25],
        agent_reward=0.5,
    )
    defaults = Trajectory(3, 2, t.prompt, [], [], [], "", 0, 0)
    unset = [
        f.name
        for f in dataclasses.fields(Trajectory)
        if getattr(t, f.name) == getattr(defaults, f.name) and f.name not in ("group_id", "sample_index", "prompt")
    ]
    assert not unset, f"set these fields too, so the copy is checked for them: {unset}"
    return t


def test_a_trajectory_copy_is_equal_and_shares_nothing_mutable() -> None:
    t = _every_field_set()
    c = trajectory_copy(t)
    assert c == t
    for f in dataclasses.fields(Trajectory):
        value = getattr(t, f.name)
        if isinstance(value, list | dict):
            assert getattr(c, f.name) is not value, f.name
    assert c.turns[0] is not t.turns[0] and c.prompt.metadata is not t.prompt.metadata
    c.prompt.metadata["entry"]["xs"][2]["y"].append(4)  # type: ignore[index]
    c.turns[0].action = "changed"
    assert t == _every_field_set()
    # the figure for the report: a 200-token completion (not a timed assertion)
    big = dataclasses.replace(t, completion_tokens=list(range(200)), sampler_logprobs=[-0.5] * 200, turns=[], loss_mask=None)
    seconds = timeit.timeit(lambda: trajectory_copy(big), number=2000) / 2000
    print(
        f"trajectory_copy, 200-token completion: {seconds * 1e6:.1f} µs (copy.deepcopy: "
        f"{timeit.timeit(lambda: copy.deepcopy(big), number=200) / 200 * 1e6:.1f} µs)"
    )


MUTATING = """
from relayrl.types import Prompt

def mutate(t):
    t.completion_tokens.append(999)
    t.completion_tokens.clear()
    t.sampler_logprobs.append(0.0)
    t.completion_text = "MUTATED"
    t.prompt.metadata["injected"] = True
    t.prompt = Prompt("mutated", "mutated", "mutated")
    t.prompt_tokens[:] = []
    return 1.0 if t.sample_index % 2 else 0.0
"""


def _mutate_in_process(t: Trajectory) -> float:
    t.completion_tokens.clear()
    t.sampler_logprobs.clear()
    t.completion_text = "MUTATED"
    t.prompt.metadata["injected"] = True
    t.prompt = Prompt("mutated", "mutated", "mutated")
    t.prompt_tokens.append(999)
    return 1.0 if t.sample_index % 2 else 0.0


async def _amutate(t: Trajectory) -> float:
    await asyncio.sleep(0)
    return _mutate_in_process(t)


@pytest.mark.parametrize("kind", ["thread", "async", "pool"])
def test_a_reward_that_changes_its_trajectory_does_not_change_the_one_scored(tmp_path: Path, kind: str) -> None:
    (tmp_path / "rwmutate.py").write_text(MUTATING)
    entry: object = {"thread": _mutate_in_process, "async": _amutate, "pool": f"{tmp_path / 'rwmutate.py'}:mutate"}[kind]
    trajs = [_every_field_set(), _traj(sample=1)]
    trajs[0].status, trajs[0].error = TrajectoryStatus.OK, None
    before = copy.deepcopy(trajs)
    threads = OrchestratorThreads()
    scorer = Scorer(resolve_rewards([entry]), ScorerSettings(workers=1), threads)  # type: ignore[list-item]
    try:
        assert asyncio.run(scorer.score(trajs)) == []
    finally:
        threads.shutdown()
        scorer.close()
    for b, t in zip(before, trajs):
        b.reward = float(b.sample_index % 2)
        assert t == b


def _rows_by_key(run_dir: Path) -> dict[tuple[int, int], dict[str, object]]:
    return {(r["group_id"], r["sample_index"]): r for r in pq.read_table(run_dir / "trajectories").to_pylist()}


def test_rewards_that_change_their_trajectories_leave_the_trained_ones_unchanged(tmp_path: Path) -> None:
    async def agrees(t: Trajectory) -> float:
        return 1.0 if t.sample_index % 2 else 0.0

    def also_agrees(t: Trajectory) -> float:
        return 1.0 if t.sample_index % 2 else 0.0

    cfg = sim_config("run.steps=2", "rollout.max_staleness=0")
    run_checked(build_program(cfg, run_dir=tmp_path / "clean", reward_fns=[agrees, also_agrees]))
    run_checked(build_program(cfg, run_dir=tmp_path / "mutated", reward_fns=[_amutate, _mutate_in_process]))
    clean, mutated = _rows_by_key(tmp_path / "clean"), _rows_by_key(tmp_path / "mutated")
    assert clean.keys() == mutated.keys() and len(clean) == 2 * 4 * 4
    fields = [
        "prompt_id",
        "prompt",
        "completion",
        "answer",
        "num_tokens",
        "prompt_tokens",
        "completion_tokens",
        "sampler_logprob_sum",
        "reward",
        "status",
    ]
    for key, row in clean.items():
        assert {f: mutated[key][f] for f in fields} == {f: row[f] for f in fields}, key
    assert all(r["completion_tokens"] and r["status"] == "ok" for r in mutated.values())


# -- 6. Python-API callables are bounded; the optional built-ins run in the worker pool ---------------


def test_a_callable_past_the_deadline_times_out_and_its_thread_is_abandoned() -> None:
    calls: list[int] = []

    def sometimes_stuck(t: Trajectory) -> float:
        calls.append(t.sample_index)
        if t.sample_index == 1:
            release.wait()  # released only at the end of the test
        return float(t.sample_index)

    threads = OrchestratorThreads()
    scorer = Scorer(resolve_rewards([sometimes_stuck]), ScorerSettings(timeout_s=0.3), threads)
    trajs = [_traj(sample=i) for i in range(4)]
    try:
        with _held() as release:
            with pytest.warns(
                AbandonedRewardThreadWarning, match=r"'test_reward_calls:.*sometimes_stuck': a call ran past task.reward_timeout_s = 0.3 s"
            ):
                failed = asyncio.run(scorer.score(trajs))
            assert not release.is_set()
            stuck = scorer.threads.abandoned()
            assert len(stuck) == 1 and stuck[0].name == "relayrl-reward-call (abandoned)"
    finally:
        threads.shutdown()
    assert [(f.reason, f.trajectory.sample_index) for f in failed] == [(RewardFailure.TIMEOUT, 1)]
    assert (
        trajs[1].error is not None and "timeout: no result within 0.3 s (task.reward_timeout_s); its thread was abandoned" in trajs[1].error
    )
    assert [t.reward for t in trajs] == [0.0, 0.0, 2.0, 3.0] and calls == [0, 1, 2, 3]  # the others ran on in a new thread
    stuck[0].join(10)
    assert not stuck[0].is_alive() and trajs[1].reward == 0.0  # it returned, and wrote nothing


def test_too_many_abandoned_threads_fail_the_run_naming_the_function(tmp_path: Path) -> None:
    def stuck(t: Trajectory) -> float:
        release.wait()
        return 1.0

    program = build_program(sim_config("task.reward_timeout_s=0.2"), run_dir=tmp_path / "run", reward_fns=[stuck])
    with _held() as release:
        with pytest.warns(AbandonedRewardThreadWarning), pytest.raises(RewardError) as caught:
            asyncio.run(asyncio.wait_for(program.run(), 60))
        assert not release.is_set()
        assert len(program.scorer.threads.abandoned()) == MAX_ABANDONED_THREADS + 1
    name = "test_reward_calls:test_too_many_abandoned_threads_fail_the_run_naming_the_function.<locals>.stuck"
    assert f"{name!r} failed on trajectory 0 of group 1" in str(caught.value)
    assert f"{MAX_ABANDONED_THREADS + 1} of its calls are still running in abandoned threads (at most {MAX_ABANDONED_THREADS})" in str(
        caught.value
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert list(summary["ledger"]["reward_failures"].values()) == [{"timeout": 1}]  # the call that failed the run


def test_the_optional_built_ins_run_in_the_worker_pool_with_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert rewards.OPTIONAL_REWARDS["math_verify"] == "relayrl.rewards.math_verify:math_verify"
    (tmp_path / "rwslow_builtin.py").write_text("import threading\ndef verify(t):\n    threading.Event().wait()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(rewards.OPTIONAL_REWARDS, "hangs_on_sympy", "rwslow_builtin:verify")  # registered as math_verify is
    (resolved,) = resolve_rewards(["hangs_on_sympy"])
    assert (resolved.name, resolved.placement, resolved.spec) == ("hangs_on_sympy", Placement.POOL, "rwslow_builtin:verify")
    threads = OrchestratorThreads()
    scorer = Scorer([resolved], ScorerSettings(workers=1, timeout_s=0.5), threads)
    t = _traj()
    try:
        failed = asyncio.run(scorer.score([t]))
    finally:
        threads.shutdown()
        scorer.close()
    assert [(f.function, f.reason) for f in failed] == [("hangs_on_sympy", RewardFailure.TIMEOUT)]
    assert t.error is not None and "no result within 0.5 s (task.reward_timeout_s); the worker was killed" in t.error
    assert scorer.pool is not None and not [pid for pid in scorer.pool.started_pids if _alive(pid)]


def test_math_verify_resolves_to_the_worker_pool() -> None:
    pytest.importorskip("math_verify")
    (resolved,) = resolve_rewards(["math_verify"])
    assert (resolved.placement, resolved.spec) == (Placement.POOL, "relayrl.rewards.math_verify:math_verify")
    assert [r.placement for r in resolve_rewards(["exact_match", "numeric_match", "first_integer_match", "last_integer_match", "env"])] == [
        Placement.INLINE
    ] * 5
