"""`relayrl bench plan`: calibrated from one default-recipe torch run, predict real torch runs that
change one thing at a time, run them, and print predicted against measured.

Invariant: the model is fitted once, from the source run, and never adjusted to the runs it
predicts; the measured runs share this machine with whatever else runs on it (noisy), so each
figure is printed with the source run measured in the same invocation.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from relayrl.config.schema import load_config
from relayrl.errors import UserError
from relayrl.plan.check import errors
from relayrl.plan.fit import call_errors, fit_model, scale
from relayrl.plan.predict import predict
from relayrl.plan.source import measured_figures, read_source
from relayrl.recipes import default_recipe

# one change at a time from the default recipe (num_samplers 1, max_staleness 1, 32 groups of 16)
CHANGES: dict[str, list[str]] = {
    # the source's own config measured again: how far the machine's noise alone moves the figures
    "none (source again)": [],
    "num_samplers 1->2": ["rollout.num_samplers=2"],
    "max_staleness 1->0": ["rollout.max_staleness=0"],
    "max_staleness 1->2": ["rollout.max_staleness=2"],
    "groups_per_step x2": ["rollout.groups_per_step=64"],
    "num_generations 16->8": ["rollout.num_generations=8"],
}
TARGETS = {"samples_per_s": 0.15, "trainer_busy_fraction": 0.05}  # relative; points (absolute)


def _real_run(sets: list[str], steps: int, root: Path, name: str, ray: bool) -> Path:
    from relayrl.orchestrator.build import build_program

    overrides = [f"run.steps={steps}", f"run.output_dir={root}", f"run.name={name}", "run.save_model=false", *sets]
    if ray:
        overrides.append("ray.enabled=true")
    cfg = load_config(default_recipe(), overrides)
    asyncio.run(build_program(cfg, run_dir=root / name).run())
    return root / name


def run_plan_bench(
    steps: int = 30, seeds: int = 2, changes: list[str] | None = None, ray: bool = False, keep: Path | None = None
) -> dict[str, object]:
    """Figures: {"source": measured, "runs": {label: {"predicted", "measured", "errors", "ok"}}};
    `keep`: write the real runs there (source, run0, ...) instead of a temporary directory."""
    unknown = sorted(set(changes or []) - set(CHANGES))
    if unknown:
        raise UserError(f"--change {unknown[0]!r}: not one of {', '.join(repr(k) for k in CHANGES)}")
    picked = {k: v for k, v in CHANGES.items() if changes is None or k in changes}
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-plan-") as tmp:
        root = Path(keep) if keep is not None else Path(tmp)
        source = read_source(_real_run([], steps, root, "source", ray))
        model = fit_model(source)
        out["source"] = dict(measured_figures(source))
        out["model"] = {"contention": model.contention, "fit": model.fit}
        runs: dict[str, object] = {}
        for i, (label, sets) in enumerate(picked.items()):
            target = load_config(source.run_dir / "config.toml", sets)
            predicted = predict(target, model, seeds).as_dict()
            target_run = read_source(_real_run(sets, steps, root, f"run{i}", ray))
            measured = dict(measured_figures(target_run))
            errs = errors(predicted, measured)
            # which part is wrong: the source's model on the target's own calls, measured ÷ modelled
            # (never fed back into the prediction): train and generate off by one factor = the
            # machine ran at another speed than when the source was measured (a shared machine);
            # generate alone = the generation cost model is wrong for the target's batches
            calls = call_errors(model, target_run)
            # a diagnostic, never the headline: the same prediction with the source's costs scaled
            # to the speed the target's calls ran at (the factors above), i.e. what is left of the
            # error once the machine's drift between the two runs is taken out
            sped = model
            for work, kind in (("train", "train_step"), ("generate", "generate")):
                if calls[kind] > 0:
                    sped = scale(sped, work, calls[kind])
            at_speed = errors(predict(target, sped, seeds).as_dict(), measured)
            rate, busy = errs["samples_per_s"]["error"], errs["trainer_busy_fraction"]["error"]
            ok = isinstance(rate, float) and isinstance(busy, float) and abs(rate) <= TARGETS["samples_per_s"]
            ok = ok and isinstance(busy, float) and abs(busy) <= TARGETS["trainer_busy_fraction"]
            row: dict[str, object] = {"sets": sets, "predicted": predicted, "measured": measured, "errors": errs, "ok": ok}
            runs[label] = {**row, "calls": calls, "at_speed": at_speed}
        out["runs"] = runs
    return out


def bench_text(figures: dict[str, object]) -> str:
    """The table: per change, samples/s and trainer busy predicted / measured / error, and a mark."""
    src = figures["source"]
    runs = figures["runs"]
    assert isinstance(src, dict) and isinstance(runs, dict)
    lines = [
        f"source (default recipe, measured): {src['samples_per_s']:.1f} samples/s, trainer busy {src['trainer_busy_fraction']:.1%}",
        f"{'change':<24}{'samples/s pred':>15}{'meas':>9}{'err':>8}   {'busy pred':>9}{'meas':>8}{'err':>10}   target"
        "   its calls, measured / modelled: train, generate   at its calls' speed: err, busy err",
    ]
    for label, r in runs.items():
        e, speed = r["errors"], r["at_speed"]
        rate, busy = e["samples_per_s"], e["trainer_busy_fraction"]

        def num(v: object, fmt: str) -> str:
            return format(v, fmt) if isinstance(v, float) else "-"

        lines.append(
            f"{label:<24}{num(rate['predicted'], '.1f'):>15}{num(rate['measured'], '.1f'):>9}{num(rate['error'], '+.1%'):>8}   "
            f"{num(busy['predicted'], '.1%'):>9}{num(busy['measured'], '.1%'):>8}"
            f"{(num(busy['error'] * 100, '+.1f') + ' pt') if isinstance(busy['error'], float) else '-':>10}   "
            f"{'ok' if r['ok'] else 'MISSED':<6}   {num(r['calls']['train_step'], '.2f'):>5}, {num(r['calls']['generate'], '.2f'):<34}"
            f"{num(speed['samples_per_s']['error'], '+.1%'):>7}, {num(speed['trainer_busy_fraction']['error'] * 100, '+.1f')} pt"
        )
    lines.append(
        "(its calls: the median of the target run's own train_step / generate durations over what the source's model gives"
        " for their sizes and contention; both far from 1 = the machine ran at another speed than when the source was"
        " measured; generate alone = the generation model is wrong for those batches. At its calls' speed: the prediction"
        " again with the source's train and generate costs scaled by those two factors, a diagnostic of the error left"
        " once the machine's drift is out, never the headline)"
    )
    return "\n".join(lines) + "\n"
