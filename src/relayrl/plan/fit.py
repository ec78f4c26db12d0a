"""The cost model (`PlanModel`, written as `plan-model.json`): fitted from a measured run, editable,
scalable (`scale`), read back (`load_model`).

What is fitted, from the source run's trace (each call's span and its size), trajectories and
metrics (docs/design.md, "Planning a run"):
- generate (`DecodeCost`): device-alone seconds = base_s + steps × (per_step_s + per_row_step_s ×
  rows ** row_exponent) + per_row_s × rows ** row_exponent, from each generate span's `sequences`
  (the decode batch's rows) and `steps` (its longest completion: the decode passes): per call a
  fixed cost and one per row, per decode pass a fixed cost and a cost that grows with the rows it
  carries, as a power fitted from the calls of
  different sizes the run holds (batched decoding is neither proportional to the rows nor, on a
  CPU whose caches the batch outgrows, affine in them). A trace without those sizes (older runs)
  counts n groups × rollout.num_generations rows and rollout.max_new_tokens passes;
- train_step: base_s + per_token_s × the positions the trainer computes for the micro-batch: its
  rows × the length they are padded to (the span's `padded` argument; a trace without it, its
  `tokens`, the laid-out tokens). Real tokens are not the size: a workload whose rows fill worse
  (e.g. fewer completions a group, so a shared prompt's group leaves more of its row empty) costs
  more per real token (measured: 0.94 → 0.68 of the positions real, 1.44× the seconds per real
  token, 1.05× per position). When the measured micro-batches are all about one size (relative
  spread under 20%), the intercept cannot be told from the slope, and the cost is taken as
  proportional (base_s = 0);
- the device contention factor (relayrl.plan.resources) jointly with the two above, by least
  absolute error on log durations;
- optim_step, get_metrics, the sync round (`load_s`), checkpoint, packing and each bookkeeping
  part: the lower quartile of their spans (optim_step divided by its measured slowdown): a span
  also holds the event loop's latency, which the planned run adds again;
- warm-up: how much a worker's first call exceeded the model (torch's first-call costs), plus,
  for the trainer, what its outlying calls took beyond the model (torch's slow first steps);
- fixed_s: the run's time outside training (start-up and held-out evaluation before the first
  generate call, the final evaluation after the last update);
- on Ray (a source whose trace has actor lanes): the trainer's round trip, the median gap the
  driver leaves in the trainer actor between a step's last train_step and its optim_step, and a
  sampler's, a generate call's window (`call_start`, `call_end`) less the actor's span of it (the
  requests out, the results back), fitted as a fixed part plus one per row the call carries
  (measured: ~3 ms at 8-16 rows, 6.3 ms at 256, 10.7 ms at 512; one median for every call had
  charged the many small calls of 8 completions a group the round trip of 16's full ones); the
  weight transport is in the sync round;
- completion lengths and per-prompt success rates as measured distributions (histograms): a
  group is filtered (algorithm.dynamic_sampling) when all its rewards tie, which the modelled
  sampler reproduces by drawing each prompt's success rate from the measured ones.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relayrl.analysis import timeline
from relayrl.analysis.timeline import Span
from relayrl.errors import UserError
from relayrl.plan.resources import device_name, fit_contention, overlap_load
from relayrl.plan.source import SourceRun

MODEL_FILE = "plan-model.json"
FORMAT = 3  # 2: generate is a DecodeCost (rows and decode passes); 3: train_step is per padded position
NARROW = 0.2  # relative spread of sizes under which a slope is not fitted (proportional cost)
EXPONENTS = tuple(round(0.5 + step / 20, 2) for step in range(31))  # row exponents tried: 0.5, 0.55, ..., 2


@dataclass(slots=True)
class LinearCost:
    """Device-alone seconds of one call: base_s + per_token_s × tokens; warmup_s added to a
    worker's first call."""

    base_s: float = 0.0
    per_token_s: float = 0.0
    warmup_s: float = 0.0

    def cost(self, tokens: float) -> float:
        return self.base_s + self.per_token_s * tokens


@dataclass(slots=True)
class DecodeCost:
    """Device-alone seconds of one generate call of `rows` sequences taking `steps` decode passes:
    base_s + per_row_s × rows ** row_exponent + steps × (per_step_s + per_row_step_s × rows **
    row_exponent): per call a fixed cost and a cost per row (the prefill, the results), per pass a
    fixed cost (the model's Python, the kernels' launches) and a cost that grows with the rows the
    pass carries; warmup_s added to a replica's first call."""

    base_s: float = 0.0
    per_row_s: float = 0.0
    per_step_s: float = 0.0
    per_row_step_s: float = 0.0
    row_exponent: float = 1.0
    warmup_s: float = 0.0

    def cost(self, rows: float, steps: float) -> float:
        batch = max(0.0, rows) ** self.row_exponent
        return self.base_s + self.per_row_s * batch + steps * (self.per_step_s + self.per_row_step_s * batch)

    def scaled(self, factor: float) -> DecodeCost:
        """Every cost × `factor`, the exponent kept."""
        return DecodeCost(
            self.base_s * factor,
            self.per_row_s * factor,
            self.per_step_s * factor,
            self.per_row_step_s * factor,
            self.row_exponent,
            self.warmup_s * factor,
        )


@dataclass(slots=True)
class PlanModel:
    """A run's cost model (see the module); every field is in `plan-model.json`."""

    source: str = ""
    cpu_count: int = 0  # cores of the machine the source run was measured on
    contention: dict[str, float] = field(default_factory=lambda: {"cpu": 0.0, "cuda": 0.0})
    generate: DecodeCost = field(default_factory=DecodeCost)
    tokens_per_sequence: float = 1.0  # measured mean prompt + completion tokens (for the console)
    train_step: LinearCost = field(default_factory=LinearCost)
    optim_step_s: float = 0.0
    get_metrics_s: float = 0.0
    load_s: float = 0.0  # a sync round: export + every replica's load
    checkpoint_s: float = 0.0
    pack_s: float = 0.0  # per micro-batch, host (GIL held)
    bookkeeping_s: dict[str, float] = field(default_factory=dict)  # per step and part, host
    env_step_s: list[float] = field(default_factory=list)  # measured environment steps (multi-turn)
    fixed_s: float = 0.0
    prompt_tokens: int = 1
    completion_lengths: dict[str, int] = field(default_factory=dict)  # tokens → trajectories
    success_rates: dict[str, int] = field(default_factory=dict)  # per-prompt success rate (2 decimals) → prompts
    # a Ray source's round trips (trainer_call_s, sampler_call_s + sampler_call_per_row_s x rows; relayrl.plan.workers.RayCosts);
    # {} from a local one
    ray: dict[str, float] = field(default_factory=dict)
    fit: dict[str, dict[str, float]] = field(default_factory=dict)  # diagnostics: spans used, median |error|
    scaled: dict[str, float] = field(default_factory=dict)  # --scale factors applied so far

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2, sort_keys=False) + "\n"

    def write(self, path: Path) -> Path:
        from relayrl.rundir.jsonl import write_text_atomic

        write_text_atomic(path, self.to_json())
        return path


SCALABLE = {
    "train": "train_step and optim_step",
    "generate": "generate",
    "sync": "the sync round (export + loads)",
    "checkpoint": "checkpoint",
    "host": "packing and bookkeeping (orchestrator CPU)",
    "metrics": "get_metrics",
}


def scale(model: PlanModel, work: str, factor: float) -> PlanModel:
    """`model` with the device-alone cost of `work` (a key of SCALABLE) multiplied by `factor`
    (e.g. train=0.25 for a trainer four times faster); UserError naming the work or factor."""
    if work not in SCALABLE:
        raise UserError(f"--scale {work}={factor}: unknown work {work!r} (one of {', '.join(SCALABLE)})")
    if not factor > 0:
        raise UserError(f"--scale {work}={factor}: the factor must be positive")
    m = PlanModel(**{k: getattr(model, k) for k in PlanModel.__dataclass_fields__})
    if work == "train":
        m.train_step = LinearCost(*(v * factor for v in asdict(model.train_step).values()))
        m.optim_step_s = model.optim_step_s * factor
    elif work == "generate":
        m.generate = model.generate.scaled(factor)
    elif work == "sync":
        m.load_s = model.load_s * factor
    elif work == "checkpoint":
        m.checkpoint_s = model.checkpoint_s * factor
    elif work == "host":
        m.pack_s = model.pack_s * factor
        m.bookkeeping_s = {k: v * factor for k, v in model.bookkeeping_s.items()}
    else:
        m.get_metrics_s = model.get_metrics_s * factor
    m.scaled = {**model.scaled, work: model.scaled.get(work, 1.0) * factor}
    return m


def parse_scale(items: Sequence[str]) -> list[tuple[str, float]]:
    """`WORK=FACTOR` strings → pairs; UserError naming the bad one."""
    out: list[tuple[str, float]] = []
    for item in items:
        work, sep, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = float("nan")
        if not sep or factor != factor:
            raise UserError(f"--scale {item}: expected WORK=FACTOR, e.g. train=0.25 (work: {', '.join(SCALABLE)})")
        out.append((work.strip(), factor))
    return out


def load_model(path: Path) -> PlanModel:
    """Read a `plan-model.json` (possibly edited); UserError naming the file and the field."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise UserError(f"{path}: not a plan model (format {FORMAT})")
    raw.pop("format")
    unknown = set(raw) - set(PlanModel.__dataclass_fields__)
    if unknown:
        raise UserError(f"{path}: unknown field {sorted(unknown)[0]!r}")
    try:
        if "generate" in raw:
            raw["generate"] = DecodeCost(**raw["generate"])
        if "train_step" in raw:
            raw["train_step"] = LinearCost(**raw["train_step"])
        model = PlanModel(**raw)
        _check_numbers(model)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{path}: {exc}") from None
    return model


def _check_numbers(m: PlanModel) -> None:
    for name in ("optim_step_s", "get_metrics_s", "load_s", "checkpoint_s", "pack_s", "fixed_s", "tokens_per_sequence"):
        if not isinstance(getattr(m, name), int | float) or getattr(m, name) < 0:
            raise ValueError(f"field {name!r} must be a number >= 0")
    for cost_name in ("generate", "train_step"):
        for k, v in asdict(getattr(m, cost_name)).items():
            if not isinstance(v, int | float) or v < 0:
                raise ValueError(f"field {cost_name}.{k} must be a number >= 0")
    if not m.completion_lengths or not m.success_rates:
        raise ValueError("fields 'completion_lengths' and 'success_rates' must not be empty")


# --- fitting -----------------------------------------------------------------------------------


def _linear(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) >= 0 by least squares refitted without the outliers (residuals beyond 3
    median absolute residuals: a shared machine's stalls, torch's slow first steps); proportional
    (intercept 0, the mean ratio without outliers) when the xs hardly vary. Means, not medians:
    the planned run adds the calls' times up."""
    base, slope = _least_squares(xs, ys)
    residuals = [abs(y - base - slope * x) for x, y in zip(xs, ys)]
    bound = 3 * statistics.median(residuals) if residuals else 0.0
    kept = [(x, y) for x, y, r in zip(xs, ys, residuals) if r <= bound]
    if bound > 0 and 3 <= len(kept) < len(xs):
        return _least_squares([x for x, _ in kept], [y for _, y in kept])
    return base, slope


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    mean_x = statistics.fmean(xs)
    spread = statistics.pstdev(xs) / mean_x if mean_x > 0 else 0.0
    if spread < NARROW or len(xs) < 3:  # proportional: the mean ratio, outliers left out
        ratios = [y / x for x, y in zip(xs, ys) if x > 0]
        if not ratios:
            return 0.0, 0.0
        mid = statistics.median(ratios)
        bound = 3 * statistics.median(abs(r - mid) for r in ratios)
        return 0.0, statistics.fmean([r for r in ratios if abs(r - mid) <= bound] or ratios)
    mean_y = statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    if slope < 0:
        return mean_y, 0.0
    base = mean_y - slope * mean_x
    if base < 0:  # through the origin instead
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return base, slope


def _spread(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


def _nonnegative_fit(columns: Sequence[np.ndarray], ys: np.ndarray) -> tuple[list[float], np.ndarray]:
    """Least squares of ys on `columns` with every coefficient >= 0: the subset of columns whose
    unconstrained fit is non-negative with the smallest squared error (at most 3 columns: every
    subset is tried). Returns (one coefficient per column, 0 for those left out; residuals)."""
    best: tuple[float, list[float], np.ndarray] | None = None
    for k in range(len(columns), 0, -1):
        for subset in itertools.combinations(range(len(columns)), k):
            a = np.stack([columns[i] for i in subset], axis=1)
            coef = np.linalg.lstsq(a, ys, rcond=None)[0]
            if (coef < 0).any():
                continue
            residuals = ys - a @ coef
            sse = float(residuals @ residuals)
            if best is None or sse < best[0] - 1e-18:
                full = [0.0] * len(columns)
                for i, c in zip(subset, coef):
                    full[i] = float(c)
                best = (sse, full, residuals)
    if best is None:
        return [0.0] * len(columns), ys
    return best[1], best[2]


def fit_decode(rows: Sequence[float], steps: Sequence[float], seconds: Sequence[float]) -> DecodeCost:
    """The `DecodeCost` of generate calls of `rows` sequences taking `steps` decode passes that
    took `seconds` on their device alone. For each row exponent e (EXPONENTS, from 1 outwards):
    non-negative least squares of seconds on [1, rows^e, steps, steps × rows^e], refitted without
    the outliers (residuals beyond 3 median absolute residuals: a shared machine's stalls); an
    exponent other than 1 is kept only where its fit has clearly less absolute log error over all
    calls (1% less than the best so far). What the run cannot tell apart is not fitted: rows of
    fewer than 3 sizes or all about one size (spread under NARROW) keep exponent 1, and with one
    size the row costs go to the per-pass one; passes all about one count put the per-pass fixed
    cost in base_s and the per-row cost in the per-pass one."""
    r = np.asarray(rows, dtype=float)
    n = np.asarray(steps, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(y) == 0:
        return DecodeCost()
    vary_rows = len(y) >= 4 and _spread(list(r)) >= NARROW
    vary_steps = len(y) >= 4 and _spread(list(n)) >= 0.05
    exponents = sorted(EXPONENTS, key=lambda e: abs(e - 1)) if vary_rows and len(set(rows)) >= 3 else [1.0]
    best: tuple[float, DecodeCost] | None = None
    for exponent in exponents:
        batch = r**exponent
        named: dict[str, np.ndarray] = {"base": np.ones_like(y)} if vary_rows or vary_steps else {}
        if vary_rows and vary_steps:
            named["row"], named["step"] = batch, n
        named["work"] = n * batch
        coef, residuals = _nonnegative_fit(list(named.values()), y)
        bound = 3 * float(np.median(np.abs(residuals)))
        kept = np.abs(residuals) <= bound
        if bound > 0 and 3 <= int(kept.sum()) < len(y):
            coef, _ = _nonnegative_fit([c[kept] for c in named.values()], y[kept])
        got = dict(zip(named, coef))
        cost = DecodeCost(got.get("base", 0.0), got.get("row", 0.0), got.get("step", 0.0), got["work"], exponent)
        predicted = [cost.cost(a, b) for a, b in zip(r, n)]
        err = sum(abs(math.log(t) - math.log(p)) if t > 0 and p > 0 else 1e3 for t, p in zip(y, predicted))
        if best is None or err < 0.99 * best[0]:
            best = (err, cost)
    assert best is not None
    return best[1]


@dataclass(slots=True)
class _Call:
    kind: str  # "generate" | "train_step"
    size: float  # train_step: tokens; generate: rows (sequences)
    dur: float
    load: float  # other workers busy on its device, time-averaged
    steps: float = 0.0  # generate: decode passes


def _lanes(spans: list[Span]) -> tuple[str, dict[str, str]]:
    """The trainer's lane and each sampler replica's lane → its plain name ("sampler/<i>"):
    inside the actors on Ray (their spans time the work itself), else the orchestrator's lanes."""
    trainer = timeline.trainer_lane(spans)
    actor = {s.lane for s in spans if s.lane.startswith("actor:sampler/") and s.name == "generate"}
    if actor:
        return trainer, {lane: lane.removeprefix("actor:") for lane in actor}
    return trainer, {s.lane: s.lane for s in spans if s.lane.startswith("sampler/") and s.name == "generate"}


def _first_per_lane(spans: list[Span], lanes: set[str], name: str) -> set[int]:
    seen: set[str] = set()
    out: set[int] = set()
    for i, s in enumerate(spans):
        if s.name == name and s.lane in lanes and s.lane not in seen:
            seen.add(s.lane)
            out.add(i)
    return out


def _histogram(values: Sequence[float], digits: int | None = None) -> dict[str, int]:
    counts = Counter(round(v, digits) if digits is not None else int(v) for v in values)
    return {str(k): n for k, n in sorted(counts.items())}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _quartile(values: Sequence[float]) -> float:
    """The lower quartile: a fixed-cost call's device time. Each span also holds the event loop's
    wake-up latency, which the planned run (the real orchestrator on this machine) adds again."""
    if len(values) < 4:
        return min(values, default=0.0)
    return statistics.quantiles(values, n=4)[0]


@dataclass(slots=True)
class _Measured:
    """A run's generate and train_step calls with their sizes and loads (the first per worker in
    `warm`), and where its workers' spans are."""

    calls: list[_Call]
    warm: list[_Call]
    trainer_lane: str
    sampler_lanes: dict[str, str]
    load_on: Callable[[str, float, float], float]


def _measure(run: SourceRun) -> _Measured:
    cfg, spans = run.cfg, run.spans
    trainer_lane, sampler_lanes = _lanes(spans)
    if not sampler_lanes:
        raise UserError(f"{run.run_dir / 'trace.json'}: no generate span to fit the sampler's cost from")
    devices = {"trainer": device_name(cfg.train.device), **{name: device_name(cfg.rollout.device) for name in sampler_lanes.values()}}
    busy: dict[str, list[tuple[float, float]]] = {}  # plain worker name → its busy intervals
    for s in spans:
        if s.lane == trainer_lane and s.name in ("train_step", "optim_step") and not (s.args.get("ahead") and s.lane == "trainer"):
            busy.setdefault("trainer", []).append((s.start, s.end))
        elif s.lane in sampler_lanes and s.name == "generate":
            busy.setdefault(sampler_lanes[s.lane], []).append((s.start, s.end))

    def load_on(worker: str, start: float, end: float) -> float:
        return sum(overlap_load(iv, start, end) for other, iv in busy.items() if other != worker and devices[other] == devices[worker])

    first_gen = _first_per_lane(spans, set(sampler_lanes), "generate")
    first_train = _first_per_lane(spans, {trainer_lane}, "train_step")
    calls: list[_Call] = []
    warm: list[_Call] = []
    # a micro-batch's size (padded positions; tokens in older traces) is on the orchestrator's
    # trainer lane; on Ray the actor's span (the work itself, a queued-ahead one included) carries
    # only its step and micro-batch
    positions = {
        (s.args.get("step"), s.args.get("microbatch")): s.args.get("padded", s.args.get("tokens"))
        for s in spans
        if s.lane == "trainer" and s.name == "train_step"
    }
    for i, s in enumerate(spans):
        if s.name == "generate":
            size = s.args.get("n")
        else:
            size = s.args.get("padded", s.args.get("tokens", positions.get((s.args.get("step"), s.args.get("microbatch")))))
        if not isinstance(size, int) or isinstance(size, bool):
            continue
        if s.lane in sampler_lanes and s.name == "generate":
            batch, passes = _decode_sizes(s, cfg.rollout.num_generations, cfg.rollout.max_new_tokens)
            call = _Call("generate", batch, s.dur, load_on(sampler_lanes[s.lane], s.start, s.end), passes)
            (warm if i in first_gen else calls).append(call)
        elif s.lane == trainer_lane and s.name == "train_step" and not (s.args.get("ahead") and s.lane == "trainer"):
            call = _Call("train_step", float(size), s.dur, load_on("trainer", s.start, s.end))
            (warm if i in first_train else calls).append(call)
    if not any(c.kind == "train_step" for c in calls) or not any(c.kind == "generate" for c in calls):
        raise UserError(f"{run.run_dir / 'trace.json'}: too few train_step / generate spans to fit (run more steps)")
    return _Measured(calls, warm, trainer_lane, sampler_lanes, load_on)


def call_errors(model: PlanModel, run: SourceRun) -> dict[str, float]:
    """How far `model`'s costs are off on `run`'s own calls (the first per worker left out): per
    kind ("train_step", "generate"), the median of measured ÷ modelled seconds, the contention
    `run`'s calls met included. Both far from 1 by one factor: the machine ran at another speed;
    one alone: that part of the model is wrong for `run`'s sizes."""
    measured = _measure(run)
    kappa = next(iter(model.contention.values()), 0.0)
    out: dict[str, float] = {}
    for kind in ("train_step", "generate"):
        ratios = []
        for k in measured.calls:
            if k.kind != kind:
                continue
            alone = model.generate.cost(k.size, k.steps) if kind == "generate" else model.train_step.cost(k.size)
            if alone > 0:
                ratios.append(k.dur / (alone * (1 + kappa * k.load)))
        out[kind] = _median(ratios)
    return out


def fit_model(run: SourceRun) -> PlanModel:
    """Fit the cost model of `run` (see the module); UserError when the run has too little to fit."""
    spans = run.spans
    measured = _measure(run)
    calls, warm, trainer_lane, sampler_lanes, load_on = (
        measured.calls,
        measured.warm,
        measured.trainer_lane,
        measured.sampler_lanes,
        measured.load_on,
    )
    rows = [r for r in run.trajectories if r.get("status") in ("ok", "filtered", None)] or run.trajectories
    completion = [len(t) for r in rows if isinstance(t := r.get("completion_tokens"), list)]
    prompts = [len(t) for r in rows if isinstance(t := r.get("prompt_tokens"), list)]
    if not completion:
        raise UserError(f"{run.run_dir}: no trajectory log to measure completion lengths from (trajectories/)")
    tokens_per_sequence = statistics.fmean(completion) + (statistics.fmean(prompts) if prompts else 0.0)

    decode = [k for k in calls if k.kind == "generate"]
    steps_of = [k for k in calls if k.kind == "train_step"]

    def fitted(c: float) -> tuple[DecodeCost, LinearCost]:
        gen = fit_decode([k.size for k in decode], [k.steps for k in decode], [k.dur / (1 + c * k.load) for k in decode])
        return gen, LinearCost(*_linear([k.size for k in steps_of], [k.dur / (1 + c * k.load) for k in steps_of]))

    def cost_of(k: _Call, gen: DecodeCost, train: LinearCost) -> float:
        return gen.cost(k.size, k.steps) if k.kind == "generate" else train.cost(k.size)

    def costs(c: float) -> list[float]:
        gen, train = fitted(c)
        return [cost_of(k, gen, train) for k in calls]

    kappa = fit_contention([(k.dur, k.load) for k in calls], costs)
    gen, train = fitted(kappa)
    for call in warm:
        excess = call.dur / (1 + kappa * call.load) - cost_of(call, gen, train)
        if call.kind == "generate":
            gen.warmup_s = max(gen.warmup_s, excess)
        else:
            train.warmup_s = max(train.warmup_s, excess)
    train.warmup_s += _stalls([k for k in calls if k.kind == "train_step"], train, kappa)

    def alone(name: str, worker: str = "trainer") -> float:
        return _quartile(
            [s.dur / (1 + kappa * load_on(worker, s.start, s.end)) for s in spans if s.lane == trainer_lane and s.name == name]
        )

    def med(name: str) -> float:
        return _quartile([s.dur for s in spans if s.name == name])

    diag: dict[str, dict[str, float]] = {}
    for kind in ("generate", "train_step"):
        mine = [k for k in calls if k.kind == kind]
        errors = [abs(cost_of(k, gen, train) * (1 + kappa * k.load) / k.dur - 1) for k in mine if k.dur > 0]
        diag[kind] = {"spans": float(len(mine)), "median_abs_error": _median(errors), "mean_load": statistics.fmean(k.load for k in mine)}
    first_generate = min((s.start for s in spans if s.lane in sampler_lanes and s.name == "generate"), default=0.0)
    trainer_end = max(s.end for s in spans if s.lane == trainer_lane and s.name in ("train_step", "optim_step"))
    wall = run.summary.get("wall_time_s")
    tail = max(0.0, float(wall) - trainer_end) if isinstance(wall, int | float) else 0.0
    successes = _success_rates(rows)
    return PlanModel(
        source=str(run.run_dir),
        cpu_count=os.cpu_count() or 1,
        contention={"cpu" if device_name(run.cfg.train.device) == "cpu" else "cuda": kappa},
        generate=gen,
        tokens_per_sequence=tokens_per_sequence,
        train_step=train,
        optim_step_s=alone("optim_step"),
        get_metrics_s=med("get_metrics"),
        load_s=med("weight_sync"),
        checkpoint_s=med("checkpoint"),
        pack_s=med("pack"),
        bookkeeping_s={p: med(p) for p in ("reduce_metrics", "log_metrics", "log_trajectories", "on_step_end", "release_memory")},
        env_step_s=[s.dur for s in spans if s.lane == "env" and s.name == "env_step"],
        fixed_s=first_generate + tail,
        prompt_tokens=max(1, round(statistics.fmean(prompts))) if prompts else 1,
        completion_lengths=_histogram(completion),
        success_rates=_histogram(successes, 2),
        ray=_ray_costs(spans),
        fit=diag,
    )


def _ray_costs(spans: list[Span]) -> dict[str, float]:
    """A Ray source's round trips (see the module); {} when the trace has no trainer actor lane."""
    work = [s for s in spans if s.lane == timeline.ACTOR_TRAINER and s.name in ("train_step", "optim_step")]
    if not work:
        return {}
    gaps = [b.start - a.end for a, b in zip(work, work[1:]) if a.name == "train_step" and b.name == "optim_step" and b.start >= a.end]
    calls = [
        (s.args.get("sequences"), float(end) - float(start) - s.dur)
        for s in spans
        if s.lane.startswith("actor:sampler/")
        and s.name == "generate"
        and isinstance(start := s.args.get("call_start"), int | float)
        and isinstance(end := s.args.get("call_end"), int | float)
    ]
    windows = [max(0.0, w) for _, w in calls]
    rows = [float(r) for r, _ in calls if isinstance(r, int) and not isinstance(r, bool)]
    if len(rows) < len(calls) or not rows:  # a trace without the calls' rows: one round trip a call
        return {"trainer_call_s": _median(gaps), "sampler_call_s": max(0.0, _median(windows))}
    base, per_row = _linear(rows, windows)  # the requests out and the results back grow with the rows
    return {"trainer_call_s": _median(gaps), "sampler_call_s": base, "sampler_call_per_row_s": per_row}


def _decode_sizes(span: Span, generations: int, max_new_tokens: int) -> tuple[float, float]:
    """A generate span's decode rows and passes: its `sequences` and `steps` where the trace has
    them, else n groups × `generations` rows and `max_new_tokens` passes (traces before they were
    recorded)."""
    rows, steps = span.args.get("sequences"), span.args.get("steps")
    n = span.args.get("n")
    if not isinstance(rows, int) or isinstance(rows, bool):
        rows = n * generations if isinstance(n, int) else 0
    if not isinstance(steps, int) or isinstance(steps, bool):
        steps = max_new_tokens
    return float(rows), float(max(1, steps))


def _stalls(calls: Sequence[_Call], cost: LinearCost, kappa: float) -> float:
    """Seconds the trainer's outlying calls (beyond 3 median absolute residuals of the fit, the
    ones the fit left out) took beyond the model: torch's slow first steps on the source. Charged
    once, to the planned trainer's first call, so the planned run's wall time holds them too."""
    residuals = [k.dur / (1 + kappa * k.load) - cost.cost(k.size) for k in calls]
    if not residuals:
        return 0.0
    bound = 3 * statistics.median(abs(r) for r in residuals)
    return sum(r for r in residuals if r > bound > 0)


def _success_rates(rows: list[dict[str, object]]) -> list[float]:
    """Per prompt: the share of its trajectories whose reward is the best any of them got (a
    binary task's success rate; a prompt whose rewards all tie is 0 or 1 alike for filtering)."""
    by_prompt: dict[str, list[float]] = {}
    for r in rows:
        reward = r.get("reward")
        if isinstance(reward, int | float):
            by_prompt.setdefault(str(r.get("prompt")), []).append(float(reward))
    out = []
    for rewards in by_prompt.values():
        top = max(rewards)
        out.append(sum(1 for x in rewards if x >= top) / len(rewards) if top > min(rewards) else float(rewards[0] > 0))
    return out


def model_summary(m: PlanModel) -> dict[str, Any]:
    """The model's headline figures, for the console."""
    return {
        "contention": m.contention,
        "generate_base_ms": m.generate.base_s * 1e3,
        "generate_per_pass_ms": m.generate.per_step_s * 1e3,
        "generate_per_row_pass_us": m.generate.per_row_step_s * 1e6,
        "generate_row_exponent": m.generate.row_exponent,
        "train_step_base_ms": m.train_step.base_s * 1e3,
        "train_step_per_1k_tokens_ms": m.train_step.per_token_s * 1e6,
        "optim_step_ms": m.optim_step_s * 1e3,
        "sync_round_ms": m.load_s * 1e3,
    }
