"""Unit tests: deferred jobs, packing, advantages, dispatch window, config, sim sampler, tracer."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algorithms.advantages import group_advantages
from relayrl.backends.sim import workers as sim_workers
from relayrl.backends.sim.workers import SimSampler
from relayrl.config.schema import ConfigError, load_config
from relayrl.orchestrator.deferred import RUN_END, DeferredJobs, before_optim, commit, first_train
from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.window import DispatchWindow
from relayrl.packing import PackingError, build_microbatch, first_fit_decreasing, layout_tokens, plan
from relayrl.telemetry.tracer import Tracer, load_trace
from relayrl.types import Completion, FilterReason, Group, Prompt, SampleRequest, Trajectory
from support.trajectories import trajectory


# -- deferred jobs ---------------------------------------------------------------------------
def test_point_order() -> None:
    assert first_train(3) < before_optim(3) < commit(3) < first_train(4) < RUN_END


def test_job_starts_only_at_its_point_and_reach_joins_it() -> None:
    log: list[str] = []

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            jobs = DeferredJobs(tg)
            await jobs.reach(commit(0))

            async def job() -> None:
                log.append("start")
                await asyncio.sleep(0.01)
                log.append("end")

            jobs.schedule("bk", job, start_after=first_train(1), finish_before=before_optim(1))
            await asyncio.sleep(0.02)
            assert log == []  # not started before its point
            await jobs.reach(first_train(1))
            await asyncio.sleep(0)
            assert log == ["start"]
            await jobs.reach(before_optim(1))
            assert log == ["start", "end"]  # joined
            assert jobs.pending() == []

    asyncio.run(main())


def test_job_error_surfaces_at_its_finish_point() -> None:
    async def main() -> None:
        async def bad() -> None:
            raise RuntimeError("disk full")

        with pytest.raises(ExceptionGroup) as info:
            async with asyncio.TaskGroup() as tg:
                jobs = DeferredJobs(tg)
                jobs.schedule("bad", bad, start_after=commit(0), finish_before=before_optim(1))
                await jobs.reach(commit(0))
                await jobs.reach(before_optim(1))
        assert "disk full" in str(info.value.exceptions[0])

    asyncio.run(main())


def test_schedule_rejects_impossible_points() -> None:
    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            jobs = DeferredJobs(tg)
            await jobs.reach(commit(2))

            async def noop() -> None:
                return None

            with pytest.raises(ValueError, match="already passed"):
                jobs.schedule("late", noop, start_after=commit(1), finish_before=before_optim(2))
            with pytest.raises(ValueError, match="precedes"):
                jobs.schedule("backwards", noop, start_after=commit(4), finish_before=before_optim(3))
            await jobs.reach(RUN_END)

    asyncio.run(main())


# -- packing ---------------------------------------------------------------------------------
def _traj(n_prompt: int, n_completion: int, i: int = 0) -> Trajectory:
    return trajectory(
        group=i,
        prompt=Prompt(str(i), "p", "a"),
        prompt_tokens=[1] * n_prompt,
        completion_tokens=[2] * n_completion,
        logprob=0.0,
        text="",
    )


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=80), budget=st.integers(64, 300), rows_per_mb=st.integers(1, 5))
def test_ffd_places_every_token_once_and_respects_the_budget(lengths: list[int], budget: int, rows_per_mb: int) -> None:
    trajs = [_traj(1, n - 1 if n > 1 else 0, i) for i, n in enumerate(lengths)]
    p = plan(trajs, budget, rows_per_mb)
    placed = sorted(i for row in p.rows for i in row)
    assert placed == list(range(len(trajs)))
    assert all(sum(trajs[i].num_tokens for i in row) <= budget for row in p.rows)
    assert sorted(r for mb in p.microbatches for r in mb) == list(range(len(p.rows)))
    assert all(len(mb) <= rows_per_mb for mb in p.microbatches)
    mbs = [build_microbatch(0, k, trajs, p) for k in range(len(p.microbatches))]
    assert sum(mb.num_tokens for mb in mbs) == sum(t.num_tokens for t in trajs)
    assert [mb.final for mb in mbs] == [False] * (len(mbs) - 1) + [True]
    assert all(0 < mb.padding.efficiency <= 1 for mb in mbs)


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 20), st.lists(st.integers(0, 30), min_size=1, max_size=16)), min_size=1, max_size=12),
    budget=st.integers(51, 200),
    rows_per_mb=st.integers(1, 5),
)
def test_shared_prompt_packing_places_every_trajectory_once_within_the_budget(
    groups: list[tuple[int, list[int]]], budget: int, rows_per_mb: int
) -> None:
    trajs = [_traj(n_prompt, n_comp, g) for g, (n_prompt, comps) in enumerate(groups) for n_comp in comps]
    p = plan(trajs, budget, rows_per_mb, share_prompt=True)
    assert sorted(i for row in p.rows for i in row) == list(range(len(trajs)))
    assert all(layout_tokens(trajs, row, True) <= budget for row in p.rows)
    mbs = [build_microbatch(0, k, trajs, p) for k in range(len(p.microbatches))]
    assert all(mb.share_prompt for mb in mbs)
    laid_out = sum(mb.num_tokens for mb in mbs)
    # each group's prompt is laid out at least once and at most once per member
    assert sum(n for n, _ in groups) + sum(map(sum, (c for _, c in groups))) <= laid_out <= sum(t.num_tokens for t in trajs)
    assert sum(mb.padding.sequence_tokens for mb in mbs) == sum(t.num_tokens for t in trajs)
    if all(n + sum(c) <= budget for n, c in groups):  # every group fits one row: its prompt is laid out once
        assert laid_out == sum(n for n, _ in groups) + sum(map(sum, (c for _, c in groups)))


def test_shared_prompt_packing_names_the_budget_key() -> None:
    trajs = [_traj(6, 5, 0), _traj(6, 3, 0)]
    with pytest.raises(PackingError, match="11 tokens exceeds the row budget of 10 tokens .train.row_tokens"):
        plan(trajs, 10, 2, share_prompt=True)


def test_ffd_is_tight_on_a_known_case() -> None:
    assert sorted(map(sorted, first_fit_decreasing([6, 5, 4, 3, 2], 10))) == [[0, 2], [1, 3, 4]]


def test_overlong_trajectory_names_the_budget_key() -> None:
    with pytest.raises(PackingError, match="train.row_tokens"):
        first_fit_decreasing([5, 11], 10)


# -- advantages ------------------------------------------------------------------------------
def test_advantage_estimators() -> None:
    r = [1.0, 0.0, 0.0, 1.0]
    grpo = group_advantages(r, "grpo")
    std = math.sqrt(sum((x - 0.5) ** 2 for x in r) / 3)
    assert grpo == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-4)
    assert group_advantages(r, "drgrpo") == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 0.0, 0.0], "rloo") == pytest.approx([1.0, -0.5, -0.5])
    for kind in ("grpo", "drgrpo", "rloo"):
        assert sum(group_advantages([0.3, 0.9, 0.1, 0.5], kind)) == pytest.approx(0.0, abs=1e-9)
        assert group_advantages([1.0, 1.0], kind) == [0.0, 0.0]
    assert group_advantages([1.0], "grpo") == [0.0]


# -- dispatch window -------------------------------------------------------------------------
def test_window_gates_on_synced_version_and_returns_filtered_credits() -> None:
    async def main() -> None:
        w = DispatchWindow(groups_per_step=2, max_staleness=1, total_steps=10)
        assert w.available() == 4  # steps 0 and 1
        assert await w.acquire(10) == 4
        assert w.available() == 0
        ledger = Ledger()
        (gid, *_) = ledger.dispatch([None] * 4, 4)  # type: ignore[list-item]  # the prompts are not read
        ledger.filtered(Group(gid, []), FilterReason.STALE, w)  # returns the group's credit
        assert w.available() == 1
        w.set_synced(1)
        assert w.available() == 3
        w2 = DispatchWindow(groups_per_step=2, max_staleness=5, total_steps=2)
        assert w2.available() == 4  # never beyond the run's last step

    asyncio.run(main())


# -- config ----------------------------------------------------------------------------------
def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.num_gens' \(from --set\)"):
        load_config(None, ["rollout.num_gens=3"])
    bad = tmp_path / "r.toml"
    bad.write_text("[train]\nrow_tokens = -5\n")
    with pytest.raises(ConfigError, match=rf"'train.row_tokens' \(from {bad}\)"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["oops"])
    cfg = load_config(None, ["rollout.temperature=0.7", "run.name=abc", 'task.reward_functions=["exact_match"]'])
    assert cfg.rollout.temperature == 0.7 and cfg.run.name == "abc"


# -- sim sampler: completion lengths and generation latency ----------------------------------
def _sim_sampler(max_new_tokens: int, *overrides: str) -> SimSampler:
    return SimSampler(load_config(None, list(overrides)).sim, max_new_tokens, seed=0)


def _requests(n: int, samples: int) -> list[SampleRequest]:
    return [SampleRequest(g, Prompt(f"p{g}", "1+1", "2"), [1, 2, 3], samples) for g in range(n)]


def test_lognormal_lengths_stay_in_bounds_and_are_heavy_tailed() -> None:
    sampler = _sim_sampler(4096, "sim.length_dist=lognormal", "sim.length_median=100", "sim.length_sigma=1.0")
    rng = random.Random(0)
    lengths = [sampler.completion_length(rng) for _ in range(4000)]
    assert all(1 <= n <= 4096 for n in lengths)
    assert 90 <= statistics.median(lengths) <= 110
    assert statistics.mean(lengths) > 1.4 * statistics.median(lengths)  # right-skewed: e^(σ²/2) ≈ 1.65
    assert sum(n > 1000 for n in lengths) >= 20  # a tail ten times the median (P ≈ 1.1%)
    clipped = _sim_sampler(150, "sim.length_dist=lognormal", "sim.length_median=100", "sim.length_sigma=1.0")
    short = [clipped.completion_length(rng) for _ in range(2000)]
    assert max(short) == 150 and min(short) >= 1 and sum(n == 150 for n in short) > 300  # P(> 150) ≈ 34%
    # a pure function of the seed
    rng = random.Random(0)
    assert [sampler.completion_length(rng) for _ in range(4000)] == lengths


def test_uniform_lengths_keep_the_original_draws() -> None:
    """The default draws exactly what the sim drew before lengths were configurable."""
    sampler = _sim_sampler(16)
    requests = _requests(3, 5)
    results = asyncio.run(sampler.generate(requests))
    for req, res in zip(requests, results, strict=True):
        rng = random.Random(0 * 1_000_003 + req.group_id * 7919 + 0)
        p = sampler.success_rate(0)
        expected: list[Completion] = []
        for _ in range(req.num_samples):
            text = "2" if rng.random() < p else "3"
            n = rng.randint(1, 16)
            tokens = [rng.randrange(2, 64) for _ in range(n)]
            expected.append(Completion(tokens=tokens, logprobs=[-rng.random()] * n, text=text))
        assert res.completions == expected


def test_generation_waits_for_the_longest_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = _sim_sampler(
        2048,
        "sim.length_dist=lognormal",
        "sim.length_median=64",
        "sim.generate_base=0.5",
        "sim.generate_per_request=0.25",
        "sim.generate_per_token=0.001",
    )
    assert sampler.generation_delay(2, 10) == pytest.approx(0.5 + 2 * 0.25 + 0.01)
    assert sampler.generation_delay(2, 1000) > sampler.generation_delay(2, 10)
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(sim_workers, "_sleep", fake_sleep)
    calls = [_requests(2, 4), _requests(8, 16)]
    longest = []
    for requests in calls:
        results = asyncio.run(sampler.generate(requests))
        longest.append(max(len(c.tokens) for r in results for c in r.completions))
    assert slept == [pytest.approx(sampler.generation_delay(len(r), n)) for r, n in zip(calls, longest, strict=True)]
    assert longest[1] > longest[0] and slept[1] > slept[0]  # more samples: a longer longest completion


def test_sim_length_keys_are_validated() -> None:
    for bad in ("sim.length_dist=gamma", "sim.length_median=0", "sim.length_sigma=-1", "sim.generate_per_token=-0.1"):
        with pytest.raises(ConfigError, match=rf"'{bad.split('=')[0]}' \(from --set\)"):
            load_config(None, [bad])


# -- tracer ----------------------------------------------------------------------------------
def test_trace_of_a_crashed_run_is_still_readable(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    tracer = Tracer(path, {"overlap_bookkeeping": True})
    tracer.complete("trainer", "train_step", 0.0, 0.5, step=0, microbatch=0)
    tracer.flush()  # the process dies here: no closing bracket
    events = load_trace(path)
    assert [e["name"] for e in events if e.get("ph") == "X"] == ["train_step"]
    tracer.close("completed")
    data = json.loads(path.read_text())  # valid JSON once closed
    names = {e["args"]["name"] for e in data if e.get("name") == "thread_name"}
    assert {"trainer", "orchestrator", "bookkeeping"} <= names
    x = next(e for e in data if e.get("ph") == "X")
    assert x["ts"] == 0.0 and x["dur"] == 500000.0 and isinstance(x["tid"], int)
