"""The flow of `relayrl plan` (the CLI only parses and prints): the model fitted or read, scaled
and written; the prediction(s); the sweep's table and PNG; the check's errors and plan-check.json."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relayrl.plan.check import errors, write_check
from relayrl.plan.fit import MODEL_FILE, PlanModel, fit_model, load_model, parse_scale, scale
from relayrl.plan.predict import predict, target_config
from relayrl.plan.source import measured_figures, read_source
from relayrl.plan.sweep import SWEEP_PNG, draw_sweep, parse_sweep, sweep_table


@dataclass(slots=True)
class PlanOptions:
    sets: Sequence[str] = ()
    scales: Sequence[str] = ()
    seeds: int = 3
    steps: int | None = None
    model: Path | None = None  # an edited plan-model.json instead of fitting
    out: Path | None = None  # where plan-model.json (and the sweep's PNG) go (default: the run directory)


def build_model(run_dir: Path, opts: PlanOptions) -> tuple[PlanModel, Path | None]:
    """The model (fitted from `run_dir`, or read from opts.model) with opts.scales applied, and
    where it was written (None when read from --model without --out)."""
    pairs = parse_scale(opts.scales)  # bad --scale first, before the fit
    model = load_model(opts.model) if opts.model is not None else fit_model(read_source(run_dir))
    for work, factor in pairs:
        model = scale(model, work, factor)
    if opts.model is not None and opts.out is None:
        return model, None
    out = (opts.out or run_dir) / MODEL_FILE
    model.write(out)
    return model, out


def plan(run_dir: Path, opts: PlanOptions) -> dict[str, object]:
    """`relayrl plan RUN_DIR`: {"source", "measured", "predicted", "sets", "scale", "model_file"}."""
    source = read_source(run_dir)
    target = target_config(run_dir, opts.sets)
    model, written = build_model(run_dir, opts)
    prediction = predict(target, model, opts.seeds, opts.steps)
    return {
        "source": str(run_dir),
        "sets": list(opts.sets),
        "scale": model.scaled,
        "model_file": str(written) if written else None,
        "measured": measured_figures(source),
        "predicted": prediction.as_dict(),
    }


def plan_sweep(run_dir: Path, spec: str, opts: PlanOptions) -> dict[str, object]:
    """`--sweep KEY=V1,...`: a prediction per value; the table and PNG (out dir / plan-sweep.png)."""
    key, values = parse_sweep(spec)
    source = read_source(run_dir)
    for value in values:  # every value checked before the first (long) prediction
        target_config(run_dir, [*opts.sets, f"{key}={value}"])
    model, written = build_model(run_dir, opts)
    rows = []
    for value in values:
        target = target_config(run_dir, [*opts.sets, f"{key}={value}"])
        rows.append((value, predict(target, model, opts.seeds, opts.steps).as_dict()))
    measured: dict[str, object] = dict(measured_figures(source))
    current = _current(source.cfg, key)
    measured["value"] = current
    png = draw_sweep(key, rows, (opts.out or run_dir) / SWEEP_PNG, measured)
    return {
        "source": str(run_dir),
        "key": key,
        "rows": [{"value": v, "predicted": p} for v, p in rows],
        "table": sweep_table(key, rows),
        "png": str(png),
        "model_file": str(written) if written else None,
        "measured": measured,
    }


def _current(cfg: object, key: str) -> object:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part, None)
    return node if isinstance(node, int | float) and not isinstance(node, bool) else None


def plan_check(run_a: Path, run_b: Path, opts: PlanOptions) -> dict[str, object]:
    """`--check RUN_A RUN_B`: B's config predicted from A's model; errors against B's figures;
    writes RUN_B/plan-check.json."""
    measured_b = measured_figures(read_source(run_b))
    target = target_config(run_b, opts.sets)
    model, written = build_model(run_a, opts)
    predicted = predict(target, model, opts.seeds, opts.steps).as_dict()
    result: dict[str, object] = {
        "target": str(run_b),
        "seeds": opts.seeds,
        "measured": measured_b,
        "predicted": predicted,
        "errors": errors(predicted, dict(measured_b)),
        "model_file": str(written) if written else None,
    }
    result["check_file"] = str(write_check(run_b, run_a, list(opts.sets), model.scaled, result))
    return result


_ROWS = (
    ("samples/s", "samples_per_s", 1.0, 1),
    ("trainer busy %", "trainer_busy_fraction", 100.0, 1),
    ("step time ms (median)", "step_time_s", 1e3, 1),
    ("staleness mean", "staleness_mean", 1.0, 2),
    ("sync round ms (median)", "sync_round_s", 1e3, 2),
)


def _num(value: object, factor: float, digits: int) -> str:
    return f"{float(value) * factor:.{digits}f}" if isinstance(value, int | float) else "-"


def plan_text(result: dict[str, object]) -> str:
    """`relayrl plan`'s console table: measured (source) beside predicted mean ± std [min, max]."""
    measured = result["measured"]
    predicted = result["predicted"]
    assert isinstance(measured, dict) and isinstance(predicted, dict)
    lines = [f"{'figure':<24}{'source run':>12}   predicted ({predicted.get('seeds')} seeds: mean ± std [min, max])"]
    for label, key, factor, digits in _ROWS:
        p = predicted.get(key)
        cell = (
            f"{_num(p['mean'], factor, digits)} ± {_num(p['std'], factor, digits)} "
            f"[{_num(p['min'], factor, digits)}, {_num(p['max'], factor, digits)}]"
            if isinstance(p, dict)
            else "-"
        )
        lines.append(f"{label:<24}{_num(measured.get(key), factor, digits):>12}   {cell}")
    src = measured.get("staleness") or {}
    pred = predicted.get("staleness") or {}
    assert isinstance(src, dict) and isinstance(pred, dict)
    for k in sorted(set(src) | set(pred), key=int):
        p = pred.get(k)
        cell = f"{p['mean']:.1%} ± {p['std']:.1%}" if isinstance(p, dict) else "-"
        s = src.get(k)
        lines.append(f"{'  staleness ' + k + ' share':<24}{(f'{s:.1%}' if isinstance(s, float) else '-'):>12}   {cell}")
    if predicted.get("assumed"):  # what the prediction took beyond the source's trace (Ray from a local run)
        lines.append(f"assumed: {predicted['assumed']}")
    return "\n".join(lines) + "\n"


def check_text(result: dict[str, object]) -> str:
    """`--check`'s console table: predicted, B's measured, the error of each figure."""
    from relayrl.plan.check import error_text

    errs = result["errors"]
    assert isinstance(errs, dict)
    lines = [f"{'figure':<24}{'predicted':>12}{'measured':>12}   error"]
    for label, key, factor, digits in _ROWS:
        e = errs[key]
        lines.append(
            f"{label:<24}{_num(e['predicted'], factor, digits):>12}{_num(e['measured'], factor, digits):>12}   {error_text(key, e)}"
        )
    return "\n".join(lines) + "\n"
