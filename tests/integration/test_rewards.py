"""User reward functions: how entries resolve, where they run, and what a failing one costs.

Entries (`task.reward_functions`): built-in names, `package.module:function`,
`path/to/file.py:function` (relative to the recipe's directory or the working directory), and in
the Python API callables; weights; async functions awaited on the loop under a concurrency limit;
sync user functions in worker processes with a timeout, where a timeout, a raise, a crash
(os._exit, segfault, out of memory) or a NaN fails only that trajectory (counted in the ledger and
summary.json by function and reason) and the run goes on — or fails the run with
`task.strict_rewards`. No reward process outlives a run.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from relayrl.algorithms.advantages import group_advantages, rewards_tie
from relayrl.config.schema import load_config
from relayrl.eval.heldout import HeldoutEvaluator
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.ledger import Ledger
from relayrl.rewards.pool import PoolLimits, RewardPool
from relayrl.rewards.registry import Placement, RewardSpecError, resolve_rewards
from relayrl.rewards.scoring import RewardError, Scorer, ScorerSettings
from relayrl.threads import OrchestratorThreads
from relayrl.types import Prompt, RewardFailure, Trajectory, TrajectoryStatus, Weights
from support.cli import relayrl
from support.simutil import make_program, run_checked, sim_config
from support.trajectories import trajectory

ROOT = Path(__file__).resolve().parents[2]
SIM_RECIPE = ROOT / "src" / "relayrl" / "recipes" / "sim.toml"
EXAMPLE = ROOT / "examples" / "rewards" / "my_reward.py"


def _traj(completion: str, answer: str = "4", group: int = 0, sample: int = 0, metadata: dict[str, object] | None = None) -> Trajectory:
    return trajectory(group=group, sample=sample, prompt=Prompt(f"p{group}", "2+2=", answer, metadata or {}), text=completion)


def _write_module(directory: Path, name: str, source: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def _alive(pid: int, zombie: bool = True) -> bool:
    """Whether `pid` is still a process; a zombie (dead, not reaped) counts unless `zombie` is
    False (a process whose parent exited is reaped by whoever adopts it, maybe never in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return zombie or fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return pq.read_table(run_dir / "trajectories").to_pylist()


# -- resolution -----------------------------------------------------------------------------------


def test_each_spec_form_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "lib" / "rwpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    _write_module(pkg, "scores", "def length(t):\n    return len(t.completion_text)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    _write_module(recipes, "near_recipe", "def one(t):\n    return 1.0\n")
    work = tmp_path / "work"
    work.mkdir()
    _write_module(work, "in_cwd", "async def two(t):\n    return 2.0\n")
    absolute = _write_module(tmp_path, "absolute", "class Judge:\n    def __call__(self, t):\n        return 3.0\njudge = Judge()\n")
    (recipes / "r.toml").write_text('[task]\nreward_functions = ["exact_match", "near_recipe.py:one", "in_cwd.py:two"]\n')
    monkeypatch.chdir(work)

    cfg = load_config(
        recipes / "r.toml",
        ['task.reward_functions=["exact_match", "near_recipe.py:one", "in_cwd.py:two", "rwpkg.scores:length", "' + f'{absolute}:judge"]'],
    )
    entries = cfg.task.reward_functions
    # relative files are recorded as absolute paths: the recipe's directory first, then the cwd
    assert entries[1] == f"{(recipes / 'near_recipe.py').resolve()}:one"
    assert entries[2] == f"{(work / 'in_cwd.py').resolve()}:two"
    resolved = resolve_rewards(entries)
    assert [r.name for r in resolved] == ["exact_match", "near_recipe.py:one", "in_cwd.py:two", "rwpkg.scores:length", "absolute.py:judge"]
    assert [r.placement for r in resolved] == [Placement.INLINE, Placement.POOL, Placement.ASYNC, Placement.POOL, Placement.POOL]
    assert resolved[3].spec == "rwpkg.scores:length" and resolved[1].spec == entries[1]
    assert resolved[3].fn(_traj("abcde")) == 5 and resolved[4].fn(_traj("")) == 3.0


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("no_such_pkg.mod:f", "'no_such_pkg.mod:f': importing module 'no_such_pkg.mod' failed (ModuleNotFoundError"),
        ("rwbad:missing", "'rwbad:missing': rwbad has no attribute 'missing'"),
        ("missing_file.py:f", "'missing_file.py:f': no such file 'missing_file.py'"),
    ],
)
def test_an_entry_that_cannot_be_resolved_exits_2_naming_it(tmp_path: Path, entry: str, message: str) -> None:
    _write_module(tmp_path, "rwbad", "NOT_A_FUNCTION = 3\n")
    out = tmp_path / "runs"
    done = relayrl(
        "train",
        str(SIM_RECIPE),
        "--set",
        f'task.reward_functions=["exact_match", "{entry}"]',
        "--set",
        f"run.output_dir={out}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: task.reward_functions[1]: ") and message in lines[0], lines
    assert not out.exists()  # refused before the run directory was written


def test_other_bad_entries_are_refused_before_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, "rwbad2", "NOT_A_FUNCTION = 3\ndef f(t):\n    return 1.0\nraise_on_import = None\n")
    _write_module(tmp_path, "rwraises", "raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "rwbad2:NOT_A_FUNCTION": "task.reward_functions[0]: 'rwbad2:NOT_A_FUNCTION' is not callable (it is of type int)",
        "rwraises:f": "importing module 'rwraises' failed (RuntimeError: no GPU here)",
        "rwbad2:": "is not a function name",
        "a b:f": "is neither a module name",
        "nope": "unknown reward function 'nope'",
    }
    for entry, message in cases.items():
        with pytest.raises(RewardSpecError, match=re.escape(message)):
            build_program(sim_config(f'task.reward_functions=["{entry}"]'), run_dir=tmp_path / "run")
    with pytest.raises(RewardSpecError, match="task.reward_weights has 1 entries for 2 reward functions"):
        build_program(sim_config("task.reward_weights=[2.0]"), run_dir=tmp_path / "run", reward_fns=["exact_match", "rwbad2:f"])
    assert not (tmp_path / "run").exists()


# -- scoring ----------------------------------------------------------------------------------------


def _score(
    entries: Sequence[object], trajectories: list[Trajectory], weights: list[float] | None = None, **settings: float
) -> list[tuple[str, RewardFailure]]:
    threads = OrchestratorThreads()
    scorer = Scorer(resolve_rewards(entries, weights), ScorerSettings(**settings), threads)  # type: ignore[arg-type]
    try:
        failed = asyncio.run(scorer.score(trajectories))
    finally:
        threads.shutdown()
        scorer.close()
    return [(f.function, f.reason) for f in failed]


def test_weights_apply_to_every_kind_of_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, "rwweights", "def half(t):\n    return 0.5\nasync def length(t):\n    return len(t.completion_text)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trajs = [_traj("4"), _traj("5", sample=1), _traj("1234", sample=2)]
    assert _score(["exact_match", "rwweights:half", "rwweights:length", lambda t: -1.0], trajs, [10.0, 2.0, 0.25, 3.0]) == []
    # exact_match × 10 + 0.5 × 2 + len × 0.25 + (−1) × 3
    assert [t.reward for t in trajs] == [10 + 1 + 0.25 - 3, 0 + 1 + 0.25 - 3, 0 + 1 + 1.0 - 3]
    assert all(t.status is TrajectoryStatus.OK for t in trajs)


def test_a_nan_or_infinite_reward_fails_its_trajectory_as_non_finite() -> None:
    trajs = [_traj("nan"), _traj("inf", sample=1), _traj("1", sample=2), _traj("big", sample=3)]
    values = {"nan": math.nan, "inf": -math.inf, "1": 1.0, "big": 1e308}
    failed = _score([lambda t: values[t.completion_text], "exact_match"], trajs, [2.0, 1.0])
    name = [n for n, _ in failed][0]
    assert failed == [(name, RewardFailure.NON_FINITE)] * 3  # nan, -inf, and 1e308 × 2 overflowing
    assert [t.reward for t in trajs] == [0.0, 0.0, 2.0, 0.0]
    assert [t.status for t in trajs] == [TrajectoryStatus.FAILED, TrajectoryStatus.FAILED, TrajectoryStatus.OK, TrajectoryStatus.FAILED]
    assert trajs[0].error is not None and "non_finite: returned nan" in trajs[0].error


def test_advantages_are_nan_safe() -> None:
    for kind in ("grpo", "drgrpo", "rloo"):
        adv = group_advantages([1.0, math.nan, 0.0, math.inf, 1.0], kind)
        assert all(math.isfinite(a) for a in adv) and adv[1] == adv[3] == 0.0
        assert math.isclose(sum(adv), 0.0, abs_tol=1e-9)
        assert adv[0] > 0 > adv[2]
        assert group_advantages([math.nan, math.nan], kind) == [0.0, 0.0]
        assert all(math.isfinite(a) for a in group_advantages([1e308, -1e308, 0.0], kind))
    # dynamic sampling: an all-NaN group ties (a set of NaNs would not: nan != nan)
    assert rewards_tie([math.nan, math.nan, math.nan]) and rewards_tie([math.nan, 1.0, 1.0]) and not rewards_tie([0.0, 1.0])


def test_nan_rewards_never_reach_training_and_all_nan_groups_are_filtered(tmp_path: Path) -> None:
    def poisoned(t: Trajectory) -> float:
        if t.group_id == 0 or (t.group_id == 1 and t.sample_index == 0):
            return math.nan  # group 0: all NaN; group 1: one NaN
        return float(t.sample_index % 2)

    cfg = sim_config("run.steps=3", "algorithm.dynamic_sampling=true")
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run", reward_fns=[poisoned]))
    rows = _rows(tmp_path / "run")
    assert all(math.isfinite(r["advantage"]) and math.isfinite(r["reward"]) for r in rows)
    assert {r["status"] for r in rows if r["group_id"] == 0} == {"filtered:all_failed"}
    one = [r for r in rows if r["group_id"] == 1]
    assert [r["status"] for r in one] == ["failed", "ok", "ok", "ok"] and "non_finite" in str(one[0]["error"])
    name = "test_rewards:test_nan_rewards_never_reach_training_and_all_nan_groups_are_filtered.<locals>.poisoned"
    assert result.summary["ledger"]["reward_failures"] == {name: {"non_finite": 5}}  # type: ignore[index]
    assert result.ledger.trajectories_failed == 5
    assert (tmp_path / "run" / "config.toml").read_text().count(name) == 1  # the callable, recorded by name


def test_async_functions_are_awaited_with_the_concurrency_limit_and_the_timeout(tmp_path: Path) -> None:
    in_flight, peak, loop_threads = 0, 0, set()

    async def judge(t: Trajectory) -> float:
        nonlocal in_flight, peak
        loop_threads.add(threading.current_thread().name)
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(30 if (t.group_id, t.sample_index) == (0, 0) else 0.01)
        finally:
            in_flight -= 1
        return 1.0 if t.sample_index % 2 else 0.0

    cfg = sim_config("run.steps=2", "task.reward_concurrency=3", "task.reward_timeout_s=1")
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run", reward_fns=[judge, "exact_match"]))
    assert peak == 3 and in_flight == 0
    assert loop_threads == {threading.main_thread().name}  # on the event loop, not in a thread
    failures = result.summary["ledger"]["reward_failures"]  # type: ignore[index]
    assert list(failures.values()) == [{"timeout": 1}]
    failed = [r for r in _rows(tmp_path / "run") if r["status"] == "failed"]
    assert len(failed) == 1 and "timeout: no result within 1 s" in str(failed[0]["error"])


# -- isolation ------------------------------------------------------------------------------------

CHAOS = """
import ctypes, math, os, time

def chaos(t):
    with open(os.path.join(os.environ["RW_PIDS"], str(os.getpid())), "w"):
        pass
    case = (t.group_id, t.sample_index)
    if case == (0, 0):
        time.sleep(60)
    if case in ((0, 1), (1, 1)):
        raise ValueError("bad row")
    if case == (1, 2):
        os._exit(7)
    if case == (2, 3):
        ctypes.string_at(0)  # segfault
    if case == (3, 0):
        return len(bytearray(2 * 2**30))  # over task.reward_memory_mb
    if case == (2, 0):
        return math.nan
    return float(t.sample_index % 2)
"""


def test_hangs_raises_and_crashes_fail_one_trajectory_each_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("RW_PIDS", str(pids))
    chaos = _write_module(tmp_path, "chaos", CHAOS)
    cfg = sim_config(
        "run.steps=3",
        f'task.reward_functions=["{chaos}:chaos"]',
        "task.reward_workers=2",
        "task.reward_timeout_s=2.5",
        "task.reward_memory_mb=1024",
    )
    program = make_program(cfg, tmp_path)
    assert program.scorer.pool is not None and not program.scorer.pool.started_pids  # started at its first call
    result = run_checked(program)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    ledger = summary["ledger"]
    assert ledger["reward_failures"] == {"chaos.py:chaos": {"crashed": 3, "non_finite": 1, "raised": 2, "timeout": 1}}
    assert ledger["reward_errors"] == {"chaos.py:chaos": 7} and ledger["trajectories_failed"] == 7
    assert result.ledger.as_dict()["reward_failures"] == ledger["reward_failures"]

    rows = {(r["group_id"], r["sample_index"]): r for r in _rows(tmp_path / "run")}
    expected = {
        (0, 0): "chaos.py:chaos: timeout: no result within 2.5 s",
        (0, 1): "chaos.py:chaos: raised: ValueError: bad row",
        (1, 2): "chaos.py:chaos: crashed: the worker process exited with code 7",
        (2, 3): "chaos.py:chaos: crashed: the worker process was killed by SIGSEGV",
        (3, 0): "chaos.py:chaos: crashed: out of memory (MemoryError",
        (2, 0): "chaos.py:chaos: non_finite: returned nan",
    }
    for case, error in expected.items():
        assert rows[case]["status"] == "failed" and rows[case]["reward"] == 0.0 and str(rows[case]["error"]).startswith(error), rows[case]
    assert all(math.isfinite(r["advantage"]) for r in rows.values())
    # the replaced workers went on scoring: every later trajectory has its reward
    later = [r for (g, _), r in rows.items() if g >= 4]
    assert later and all(r["status"] == "ok" and r["reward"] == float(r["sample_index"] % 2) for r in later)

    pool = program.scorer.pool
    assert len(pool.started_pids) >= 2 + 4  # two, then one for each timeout, exit, segfault, out of memory
    worked = {int(p.name) for p in pids.iterdir()}
    assert worked <= set(pool.started_pids) and len(worked) >= 5
    assert not [pid for pid in pool.started_pids if _alive(pid)]  # no reward process outlives the run


def test_strict_rewards_fails_the_run_naming_the_function_and_the_trajectory(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    _write_module(
        tmp_path,
        "strict_boom",
        """
        import os

        def boom(t):
            with open(os.path.join(os.environ["RW_PIDS"], str(os.getpid())), "w"):
                pass
            if t.group_id == 1 and t.sample_index == 2:
                raise KeyError("answer")
            return 1.0
        """,
    )
    done = relayrl(
        "train",
        str(SIM_RECIPE),
        "--set",
        'task.reward_functions=["strict_boom.py:boom"]',  # relative to the working directory
        "--set",
        "task.strict_rewards=true",
        "--set",
        "rollout.prompts_per_request=1",
        "--set",
        f"run.output_dir={tmp_path / 'runs'}",
        cwd=tmp_path,
        env={"RW_PIDS": str(pids)},
    )
    assert done.returncode == 1, done.stderr
    assert (
        "error: reward function 'strict_boom.py:boom' failed on trajectory 2 of group 1 (prompt 'sim-1'): "
        "raised: KeyError: 'answer' (task.strict_rewards = true)"
    ) in done.stderr
    summary = json.loads((tmp_path / "runs" / "sim" / "summary.json").read_text())
    assert summary["status"] == "failed" and "RewardError" in summary["error"]
    assert summary["ledger"]["reward_failures"] == {"strict_boom.py:boom": {"raised": 1}}
    assert [int(p.name) for p in pids.iterdir()] and not [int(p.name) for p in pids.iterdir() if _alive(int(p.name), zombie=False)]


def test_no_reward_process_is_left_after_a_failed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, "rwfail", "def f(t):\n    if t.group_id == 2:\n        raise OSError('disk')\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    program = make_program(sim_config('task.reward_functions=["rwfail:f"]', "task.strict_rewards=true", "task.reward_workers=3"), tmp_path)
    with pytest.raises(RewardError, match=r"'rwfail:f' failed on trajectory \d+ of group 2 \(prompt 'sim-2'\): raised: OSError: disk"):
        asyncio.run(asyncio.wait_for(program.run(), 60))
    assert program.scorer.pool is not None and len(program.scorer.pool.started_pids) == 3
    assert not [pid for pid in program.scorer.pool.started_pids if _alive(pid)]
    assert not [t for t in threading.enumerate() if t.name.startswith("relayrl-")]


def test_cancelling_a_run_stuck_in_a_reward_call_is_prompt_and_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, "rwhang", "import time\ndef f(t):\n    time.sleep(300)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    program = make_program(sim_config('task.reward_functions=["rwhang:f"]', "task.reward_timeout_s=300"), tmp_path)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(program.run(), 2.0)  # cancels the run while every worker hangs
        assert asyncio.all_tasks() == {asyncio.current_task()}

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 10
    assert program.scorer.pool is not None and len(program.scorer.pool.started_pids) == 2
    assert not [pid for pid in program.scorer.pool.started_pids if _alive(pid)]
    assert not [t for t in threading.enumerate() if t.name.startswith("relayrl-")]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "cancelled"


def test_the_cpu_limit_ends_a_spinning_call_and_a_worker_that_cannot_start_is_an_error(tmp_path: Path) -> None:
    spin = _write_module(tmp_path, "spin", "def spin(t):\n    while True:\n        pass\n\ndef ok(t):\n    return 1.0\n")
    pool = RewardPool([f"{spin}:spin", f"{spin}:ok"], 1, PoolLimits(timeout_s=60.0, cpu_s=1.0))
    try:
        spun, after = pool.run([(0, None), (1, None)])
    finally:
        pool.close()
    assert spun.failure is RewardFailure.CRASHED and "exceeded its CPU limit" in spun.detail and "SIGXCPU" in spun.detail
    assert after.failure is None and after.value == 1.0  # on the replacement worker
    tiny = RewardPool([f"{spin}:ok"], 1, PoolLimits(timeout_s=5.0, memory_mb=4))
    with pytest.raises(Exception, match="task.reward_memory_mb = 4 is below the address space"):
        tiny.run([(0, None)])
    tiny.close()
    assert not [pid for pid in [*pool.started_pids, *tiny.started_pids] if _alive(pid)]


def test_the_evaluator_judges_through_the_runs_scorer(tmp_path: Path) -> None:
    class Engine:
        async def load_weights(self, weights: Weights) -> None:
            return None

        async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
            return [[len(p)] for p in prompts_tokens]

        async def close(self) -> None:
            return None

    judge = _write_module(tmp_path, "judge", "def even(t):\n    return 1.0 if t.completion_tokens[0] % 2 == 0 else 0.0\n")

    async def positive(t: Trajectory) -> float:
        await asyncio.sleep(0)
        return 1.0 if t.prompt.prompt_id != "p2" else math.nan

    prompts = [Prompt(f"p{i}", "x" * i, "") for i in range(6)]
    threads = OrchestratorThreads()
    scorer = Scorer(resolve_rewards([f"{judge}:even", positive]), ScorerSettings(workers=1), threads)
    evaluator = HeldoutEvaluator(Engine(), prompts, lambda text: [0] * len(text), lambda tokens: "", max_new_tokens=4, scorer=scorer)
    try:
        result = asyncio.run(evaluator.evaluate(Weights(version=1, payload=None)))
    finally:
        threads.shutdown()
        scorer.close()
    # rewards even + positive: 2, 1, 0 (p2's NaN fails its trajectory: reward 0), 1, 2, 1
    assert result.reward_mean == 7 / 6
    assert result.accuracy == 1.0  # the task's check, not the rewards: every "" is the answer ""


# -- ledger and the example -------------------------------------------------------------------------


def test_the_ledger_counts_by_function_and_reason_and_resumes_older_checkpoints() -> None:
    ledger = Ledger()
    ledger.count_reward_failures([("f", "timeout"), ("f", "raised"), ("g", "crashed"), ("f", "timeout")], trajectories=3)
    state = ledger.checkpoint()
    assert state["reward_failures"] == {"f": {"raised": 1, "timeout": 2}, "g": {"crashed": 1}}
    resumed = Ledger.resumed(state)
    assert resumed.as_dict()["reward_failures"] == state["reward_failures"] and resumed.trajectories_failed == 3
    older = {k: v for k, v in state.items() if k != "reward_failures"}  # written before reasons were counted
    assert Ledger.resumed(older).as_dict()["reward_failures"] == {"f": {"raised": 3}, "g": {"raised": 1}}


def test_the_readme_example_runs_with_jsonl_metadata(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "tolerance": i % 2} for i in range(1, 9)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    done = relayrl(
        "train",
        str(SIM_RECIPE),
        "--set",
        "task.kind=jsonl",
        "--set",
        "task.path=prompts.jsonl",
        "--set",
        'task.reward_functions=["examples/rewards/my_reward.py:numeric_with_tolerance", "examples/rewards/my_reward.py:brevity_judge"]',
        "--set",
        "task.reward_weights=[1.0, 0.5]",
        "--set",
        "run.steps=3",
        "--set",
        f"run.output_dir={tmp_path / 'runs'}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    config = (tmp_path / "runs" / "sim" / "config.toml").read_text()
    assert f'"{(tmp_path / "examples" / "rewards" / "my_reward.py").resolve()}:numeric_with_tolerance"' in config
    scored = _rows(tmp_path / "runs" / "sim")
    assert scored and all(r["status"] == "ok" for r in scored)
    tolerance = {f"prompts-{i}": i % 2 for i in range(1, 9)}
    for r in scored:
        right = r["completion"] == r["answer"] or (tolerance[str(r["prompt_id"])] and r["completion"] != "?")
        brevity = min(1.0, 8 / max(1, len(str(r["completion"]))))
        assert r["reward"] == pytest.approx((1.0 if right else 0.1) + 0.5 * brevity), r
