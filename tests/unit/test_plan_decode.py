"""The planner's generation cost model (relayrl.plan.fit.DecodeCost): fitted from the generate
spans' decode rows (`sequences`) and passes (`steps`) of one run, it recovers known costs, predicts
a batch size the run never sampled, and a modelled sampler spends it for the call it samples. And
the planned Ray workers (relayrl.plan.workers.RayPlanTrainer, PlanSampler on Ray): a round trip
away, in RayTrainer's order."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from relayrl.analysis import timeline
from relayrl.analysis.timeline import Span
from relayrl.config.schema import load_config
from relayrl.plan.fit import DecodeCost, LinearCost, PlanModel, _linear, call_errors, fit_decode, fit_model, scale
from relayrl.plan.predict import ASSUMED_RAY_CALL_S, ray_costs
from relayrl.plan.resources import Device
from relayrl.plan.source import SourceRun
from relayrl.plan.workers import PlanSampler, RayCosts, RayPlanTrainer
from relayrl.recipes import default_recipe
from relayrl.telemetry.tracer import Tracer
from relayrl.types import Prompt, SampleRequest, TrainBatch

# a decode whose per-pass cost grows faster than the rows (a CPU whose caches the batch outgrows)
TRUE = DecodeCost(base_s=0.004, per_row_s=2e-5, per_step_s=0.003, per_row_step_s=2e-6, row_exponent=1.4)
# one run's calls: full calls of 32 groups of 16 and the refills dynamic sampling asks for
ROWS = [512] * 30 + [16 * n for n in (1, 1, 2, 3, 4, 5, 6, 7, 8, 10)] * 2
STEPS = [4 if i % 3 else 3 for i in range(len(ROWS))]


def _noisy(rng: random.Random, seconds: float) -> float:
    return seconds * (1 + rng.uniform(-0.01, 0.01))


def test_the_fit_recovers_known_decode_costs_from_calls_of_several_sizes() -> None:
    rng = random.Random(0)
    fitted = fit_decode(ROWS, STEPS, [_noisy(rng, TRUE.cost(r, s)) for r, s in zip(ROWS, STEPS)])
    assert fitted.row_exponent == pytest.approx(1.4, abs=0.051)
    for rows in (16, 128, 256, 384, 512, 1024):  # 256: a size the run never sampled (16 → 8 generations)
        for steps in (3, 4):
            assert fitted.cost(rows, steps) == pytest.approx(TRUE.cost(rows, steps), rel=0.05), (rows, steps)


def test_a_straight_line_in_the_rows_misses_the_batch_the_run_never_sampled() -> None:
    """What the earlier model did (cost linear in a call's sequences): it predicts 256 rows more
    than 10% off; the decode model within 2%."""
    seconds = [TRUE.cost(r, s) for r, s in zip(ROWS, STEPS)]
    base, slope = _linear(ROWS, seconds)
    truth = TRUE.cost(256, 4)
    assert abs((base + slope * 256) / truth - 1) > 0.10
    assert fit_decode(ROWS, STEPS, seconds).cost(256, 4) == pytest.approx(truth, rel=0.02)


def test_an_affine_decode_keeps_exponent_one_and_calls_of_one_size_stay_proportional() -> None:
    affine = DecodeCost(base_s=0.01, per_row_s=0.0, per_step_s=0.002, per_row_step_s=5e-5, row_exponent=1.0)
    fitted = fit_decode(ROWS, STEPS, [affine.cost(r, s) for r, s in zip(ROWS, STEPS)])
    assert fitted.row_exponent == 1.0
    assert fitted.cost(256, 4) == pytest.approx(affine.cost(256, 4), rel=0.01)
    one_size = fit_decode([512] * 10, [4] * 10, [0.2] * 10)  # nothing to tell a fixed cost from: proportional
    assert one_size.cost(512, 4) == pytest.approx(0.2) and one_size.cost(256, 4) == pytest.approx(0.1)


def _source(rows: list[int], steps: list[int | None], generations: int = 16) -> SourceRun:
    """A local run's trace: one replica's generate calls of `rows` sequences (their `steps`; None:
    a trace from before the sizes were recorded), each alone on the machine, and a trainer."""
    cfg = load_config(default_recipe(), [f"rollout.num_generations={generations}"])
    spans: list[Span] = []
    t = 0.0
    for i, (r, s) in enumerate(zip(rows, steps)):
        dur = TRUE.cost(r, s if s is not None else cfg.rollout.max_new_tokens)
        args: dict[str, object] = {"n": r // generations, "version": 0}
        if s is not None:
            args.update(sequences=r, steps=s)
        spans.append(Span("sampler/0", "generate", t, t + dur, args))
        t += dur + 0.01
        if i % 2 == 0:  # the trainer works between the calls, never beside one: no contention
            tokens = 1500 + 100 * (i % 7)
            spans.append(Span("trainer", "train_step", t, t + tokens * 1e-4, {"step": i, "microbatch": 0, "tokens": tokens}))
            t += tokens * 1e-4 + 0.01
            spans.append(Span("trainer", "optim_step", t, t + 0.01, {"step": i}))
            t += 0.02
    rows_log = [
        {"step": 1, "prompt": f"p{k}", "reward": float(k % 2), "status": "ok", "prompt_tokens": [1] * 6, "completion_tokens": [2] * 3}
        for k in range(8)
    ]
    return SourceRun(Path("/nonexistent/run"), cfg, spans, {"wall_time_s": t}, [], rows_log)


def test_the_run_fit_reads_each_calls_rows_and_passes_from_its_span() -> None:
    model = fit_model(_source(ROWS, list(STEPS)))
    assert model.contention["cpu"] == 0.0  # no call overlapped another
    assert model.generate.cost(256, 4) == pytest.approx(TRUE.cost(256, 4), rel=0.05)
    assert model.generate.cost(512, 3) == pytest.approx(TRUE.cost(512, 3), rel=0.05)


def test_a_trace_without_the_sizes_counts_groups_times_generations_and_max_new_tokens() -> None:
    model = fit_model(_source(ROWS, [None] * len(ROWS)))
    assert model.generate.cost(256, 4) == pytest.approx(TRUE.cost(256, 4), rel=0.05)


class _Recorder:
    """A device that records the work it is given instead of spending it."""

    def __init__(self) -> None:
        self.work: list[float] = []

    async def run(self, work: float) -> None:
        self.work.append(work)


def _work(cost: DecodeCost, generations: int, max_new_tokens: int) -> tuple[float, int]:
    model = PlanModel(generate=cost, completion_lengths={"2": 1, "4": 1}, success_rates={"0.5": 1})
    device = _Recorder()
    sampler = PlanSampler(model, device, max_new_tokens, seed=0, replica=0)  # type: ignore[arg-type]
    requests = [SampleRequest(i, Prompt(f"p{i}", f"{i}+1", str(i + 1)), [1, 2, 3], generations) for i in range(32)]
    results = asyncio.run(sampler.generate(requests))
    passes = max(len(c.tokens) for r in results for c in r.completions)
    return device.work[0], passes


def test_a_modelled_call_costs_its_rows_and_passes_not_its_share_of_tokens() -> None:
    full, passes = _work(TRUE, 16, 4)
    assert full == pytest.approx(TRUE.cost(512, passes))
    half, passes_half = _work(TRUE, 8, 4)
    assert half == pytest.approx(TRUE.cost(256, passes_half))
    assert 0.3 < half / full < 0.5  # fewer rows: less time, not in proportion (fixed costs; superlinear rows)
    short, short_passes = _work(TRUE, 16, 2)  # completions cut at 2 tokens: fewer passes
    assert short_passes == 2 and short < full


def _batch(step: int, index: int) -> TrainBatch:
    return TrainBatch(step, index, None, 1000, 8, [1.0] * 8, 1000, 8)


def test_a_planned_ray_trainer_leaves_the_round_trip_idle_in_its_actor_before_each_update() -> None:
    """RayTrainer's order on a modelled actor: micro-batches back to back (one sent ahead), the
    update a round trip after the step's last one; the actor's spans hold the work alone."""
    call_s = 0.04
    model = PlanModel(train_step=LinearCost(per_token_s=6e-5), optim_step_s=0.01, completion_lengths={"2": 1}, success_rates={"0.5": 1})
    tracer = Tracer(None, {})
    trainer = RayPlanTrainer(model, Device("cpu", 0.0), RayCosts(call_s, 0.0), queue_ahead=True)
    trainer.attach(tracer)

    async def main() -> None:
        for step in (1, 2):
            for index in range(3):
                await trainer.train_step(_batch(step, index))
            await trainer.optim_step()
        await trainer.close()

    asyncio.run(main())
    actor = [s for s in timeline.spans(tracer.events) if s.lane == "actor:trainer"]
    assert [s.name for s in actor] == ["train_step"] * 3 + ["optim_step"] + ["train_step"] * 3 + ["optim_step"]
    gaps = [(b.name, b.start - a.end) for a, b in zip(actor, actor[1:])]
    for name, gap in gaps:
        if name == "optim_step":
            assert call_s * 0.9 <= gap < call_s + 0.02  # the last result back to the driver, the update out
        elif gap < call_s:  # within a step (work longer than the round trip): the next micro-batch was queued
            assert gap < call_s / 4
    assert all(s.dur == pytest.approx(0.06, abs=0.015) for s in actor if s.name == "train_step")  # the work alone
    assert timeline.trainer_lane(timeline.spans(tracer.events)) == "actor:trainer"


def test_a_planned_ray_sampler_call_returns_a_round_trip_after_its_work() -> None:
    model = PlanModel(generate=DecodeCost(base_s=0.01), completion_lengths={"2": 1}, success_rates={"0.5": 1})
    device = _Recorder()
    sampler = PlanSampler(model, device, 4, seed=0, replica=0, ray=RayCosts(0.0, 0.05))  # type: ignore[arg-type]
    requests = [SampleRequest(0, Prompt("p0", "1+1", "2"), [1, 2], 4)]

    async def main() -> float:
        start = time.monotonic()
        await sampler.generate(requests)
        return time.monotonic() - start

    assert asyncio.run(main()) >= 0.05  # the device work is recorded, not spent: the rest is the round trip
    assert device.work == [pytest.approx(0.01)]


def test_ray_round_trips_come_from_a_ray_source_else_are_assumed_and_said_so() -> None:
    ray_target = load_config(default_recipe(), ["ray.enabled=true"])
    from_ray = PlanModel(ray={"trainer_call_s": 0.007, "sampler_call_s": 0.006})
    assert ray_costs(ray_target, from_ray) == (RayCosts(0.007, 0.006), None)
    costs, note = ray_costs(ray_target, PlanModel())
    assert costs == RayCosts(ASSUMED_RAY_CALL_S, ASSUMED_RAY_CALL_S)
    assert note is not None and "assumed" in note
    assert ray_costs(load_config(default_recipe(), []), from_ray) == (None, None)  # a local target pays none


def test_call_errors_tell_a_wrong_generation_model_from_the_run_s_own_calls() -> None:
    run = _source(ROWS, list(STEPS))
    model = fit_model(run)
    right = call_errors(model, run)
    assert right["generate"] == pytest.approx(1.0, abs=0.05) and right["train_step"] == pytest.approx(1.0, abs=0.05)
    wrong = call_errors(scale(model, "generate", 2.0), run)  # a model twice too slow for these batches
    assert wrong["generate"] == pytest.approx(0.5, abs=0.03) and wrong["train_step"] == pytest.approx(1.0, abs=0.05)


def test_the_train_cost_is_per_position_the_trainer_computes_not_per_real_token() -> None:
    """Micro-batches whose rows fill from 0.65 to 0.95 of their padded positions, each costing
    its positions (the trainer computes the padding too): fitted from the spans' `padded`, the
    cost of a badly filled micro-batch is right; per real token (`tokens`, what format 2 fitted)
    it is more than 15% short (measured on the default recipe's num_generations 16 -> 8: 1.42x)."""
    src = _source(ROWS, list(STEPS))
    spans = [s for s in src.spans if s.name not in ("train_step", "optim_step")]
    t = max(s.end for s in spans) + 1.0
    truth = LinearCost(base_s=0.01, per_token_s=1e-4)
    for i in range(40):
        padded = 2000 + 200 * (i % 5)
        tokens = int(padded * (0.65 + 0.3 * ((i * 7) % 10) / 9))
        dur = truth.cost(padded)
        spans.append(Span("trainer", "train_step", t, t + dur, {"step": i, "microbatch": 0, "tokens": tokens, "padded": padded}))
        t += dur + 0.01
        spans.append(Span("trainer", "optim_step", t, t + 0.01, {"step": i}))
        t += 0.02
    model = fit_model(SourceRun(src.run_dir, src.cfg, spans, src.summary, [], src.trajectories))
    for padded in (2000, 2400, 2800):
        assert model.train_step.cost(padded) == pytest.approx(truth.cost(padded), rel=0.05)
    old = [Span(s.lane, s.name, s.start, s.end, {k: v for k, v in s.args.items() if k != "padded"}) for s in spans]
    per_token = fit_model(SourceRun(src.run_dir, src.cfg, old, src.summary, [], src.trajectories)).train_step
    sparse = int(2400 * 0.65)  # a micro-batch of 2,400 positions, 65% real
    assert per_token.cost(sparse) < 0.85 * truth.cost(2400)


def test_a_planned_trainer_spends_the_cost_of_the_batch_s_padded_positions() -> None:
    from relayrl.types import MicroBatch, PaddingStats

    padding = PaddingStats(rows=4, row_tokens=500, real_tokens=1300, sequences=16)
    mb = MicroBatch(step=1, index=0, final=True, trajectories=[], rows=[], padding=padding, num_tokens=1300)
    assert mb.train_batch().padded_tokens == 2000 and mb.train_batch().num_tokens == 1300


def test_a_ray_samplers_round_trip_is_fitted_per_call_and_per_row() -> None:
    """A Ray source's generate windows (less the actor's span) grow with the rows a call carries:
    the fit recovers the fixed part and the per-row part, and a planned call pays them for its rows;
    a trace without the rows keeps one median round trip a call."""
    from relayrl.plan.fit import _ray_costs

    base, per_row = 0.003, 0.000015
    spans = [Span(timeline.ACTOR_TRAINER, "train_step", 0.0, 0.1, {}), Span(timeline.ACTOR_TRAINER, "optim_step", 0.107, 0.11, {})]
    t = 1.0
    for i, rows in enumerate([8, 16, 512, 64, 256, 8, 512, 128, 24, 512] * 3):
        work = 0.02 + 0.0001 * rows
        window = base + per_row * rows + (0.004 if i == 7 else 0.0)  # one call held up on a shared machine
        args: dict[str, object] = {"sequences": rows, "call_start": t - window / 2, "call_end": t + work + window / 2}
        spans.append(Span("actor:sampler/0", "generate", t, t + work, args))
        t += 1.0
    costs = _ray_costs(spans)
    assert costs["trainer_call_s"] == pytest.approx(0.007)
    assert costs["sampler_call_s"] == pytest.approx(base, rel=0.05)
    assert costs["sampler_call_per_row_s"] == pytest.approx(per_row, rel=0.05)
    planned = RayCosts(costs["trainer_call_s"], costs["sampler_call_s"], costs["sampler_call_per_row_s"])
    assert planned.sampler_call(8) == pytest.approx(base + 8 * per_row, rel=0.05)
    assert planned.sampler_call(512) == pytest.approx(base + 512 * per_row, rel=0.05)
    no_rows = [Span(x.lane, x.name, x.start, x.end, {k: v for k, v in x.args.items() if k != "sequences"}) for x in spans]
    legacy = _ray_costs(no_rows)
    assert "sampler_call_per_row_s" not in legacy and legacy["sampler_call_s"] > base
