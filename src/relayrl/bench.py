"""Benchmarks that print figures: the step boundary (inline vs overlapped) and the control plane.

Invariant: each benchmark runs its configurations one after the other in this process on the
same workload and reports their ratio; nothing here asserts a time (machines are noisy).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from relayrl.config import Config, load_config
from relayrl.program import RunResult
from relayrl.run import build_program
from relayrl.telemetry import timeline

# The seed's large-model profile (seconds): host-side costs burn CPU holding the GIL.
BOUNDARY_PROFILE: dict[str, float] = {
    "sim.get_metrics": 0.4,
    "sim.reduce_metrics": 0.3,
    "sim.log_metrics": 0.1,
    "sim.log_trajectories": 0.1,
    "sim.on_step_end": 0.1,
    "sim.release_memory": 0.5,
    "sim.pack_per_microbatch": 0.3,
    "sim.train_step": 1.0,
    "sim.optim_step": 0.3,
    "sim.weight_sync": 0.1,
    "sim.generate_per_request": 0.01,
}


@dataclass(slots=True)
class BoundaryFigures:
    gap_median_s: float
    busy_fraction: float
    loop_lag_max_ms: float
    step_time_median_s: float
    wall_s: float

    def as_dict(self) -> dict[str, float]:
        return {
            "gap_median_s": self.gap_median_s,
            "busy_fraction": self.busy_fraction,
            "loop_lag_max_ms": self.loop_lag_max_ms,
            "step_time_median_s": self.step_time_median_s,
            "wall_s": self.wall_s,
        }


def boundary_config(overlap: bool, steps: int, time_scale: float, extra: list[str] | None = None) -> Config:
    overrides = [f"{key}={value * time_scale!r}" for key, value in BOUNDARY_PROFILE.items()]
    overrides += [
        f"run.steps={steps}",
        "run.name=bench-boundary",
        "rollout.num_generations=8",
        "rollout.groups_per_step=8",
        "rollout.max_staleness=1",
        "rollout.prompts_per_request=8",
        "train.row_tokens=256",
        "train.rows_per_microbatch=3",
        "train.share_prompt=false",  # the seed profile's micro-batch count
        f"orchestrator.overlap_bookkeeping={'true' if overlap else 'false'}",
    ]
    return load_config(None, overrides + (extra or []))


def _summary_float(result: RunResult, key: str) -> float:
    """A figure the run already put in its summary (NaN when it has none, e.g. no boundary)."""
    value = result.summary.get(key)
    return float(value) if isinstance(value, int | float) else float("nan")


def _figures(result: RunResult) -> BoundaryFigures:
    lags = [float(r.metrics.get("loop_lag_max_ms") or 0.0) for r in result.results]
    return BoundaryFigures(
        gap_median_s=_summary_float(result, "boundary_gap_median_s"),
        busy_fraction=_summary_float(result, "trainer_busy_fraction"),
        loop_lag_max_ms=max(lags, default=0.0),
        step_time_median_s=statistics.median(rec.step_time_sec for rec in result.records),
        wall_s=_summary_float(result, "wall_time_s"),
    )


def run_boundary(steps: int = 6, time_scale: float = 1.0, extra: list[str] | None = None) -> dict[str, object]:
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
        for label, overlap in (("inline", False), ("overlapped", True)):
            cfg = boundary_config(overlap, steps, time_scale, extra)
            program = build_program(cfg, run_dir=Path(tmp) / label)
            out[label] = _figures(asyncio.run(program.run())).as_dict()
    inline_gap = out["inline"]["gap_median_s"]  # type: ignore[index]
    over_gap = out["overlapped"]["gap_median_s"]  # type: ignore[index]
    out["ratio"] = over_gap / inline_gap if inline_gap else float("nan")
    out["time_scale"] = time_scale
    return out


def control_plane_config(steps: int, extra: list[str] | None = None) -> Config:
    overrides = [
        f"run.steps={steps}",
        "run.name=bench-control-plane",
        "rollout.num_generations=16",
        "rollout.groups_per_step=64",
        "rollout.max_staleness=2",
        "rollout.prompts_per_request=16",
        "train.row_tokens=4096",
        "train.rows_per_microbatch=2",
    ]
    return load_config(None, overrides + (extra or []))


def run_control_plane(steps: int = 40, one_core: bool = True, extra: list[str] | None = None) -> dict[str, object]:
    if one_core and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[0]})
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
        cfg = control_plane_config(steps, extra)
        result = asyncio.run(build_program(cfg, run_dir=Path(tmp) / "cp").run())
    return {
        "trajectories": result.ledger.trajectories_trained,
        "wall_s": _summary_float(result, "wall_time_s"),
        "trajectories_per_s": _summary_float(result, "samples_per_s"),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


E2E_CONFIGS: dict[str, list[str]] = {
    "A": ["rollout.max_staleness=0", "orchestrator.overlap_bookkeeping=false"],  # the seed: synchronous, inline
    "B": ["rollout.max_staleness=0", "orchestrator.overlap_bookkeeping=true"],  # synchronous, overlapped
    "C": [],  # the default recipe as shipped
}


def run_e2e(steps: int = 8, recipe: Path | None = None, extra: list[str] | None = None, repeats: int = 1) -> dict[str, dict[str, float]]:
    """The default recipe, shortened, in configurations A, B and C (see E2E_CONFIGS), run
    `repeats` times round-robin (A B C A B C ...); each figure is the median over the repeats."""
    from relayrl.cli import default_recipe

    runs: dict[str, list[dict[str, float]]] = {label: [] for label in E2E_CONFIGS}
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
        for rep in range(repeats):
            for label, overrides in E2E_CONFIGS.items():
                cfg = load_config(recipe or default_recipe(), [f"run.steps={steps}", "eval.enabled=false", *overrides, *(extra or [])])
                result = asyncio.run(build_program(cfg, run_dir=Path(tmp) / f"{label}{rep}").run())
                all_spans = timeline.spans(result.tracer.events)
                runs[label].append({
                    "samples_per_s": _summary_float(result, "samples_per_s"),
                    "trainer_busy": _summary_float(result, "trainer_busy_fraction"),
                    "sampler_busy": timeline.lane_busy_fraction(all_spans, "sampler/", "generate"),
                    "gap_median_s": _summary_float(result, "boundary_gap_median_s"),
                    "exposed_bookkeeping_s": timeline.exposed_bookkeeping_time(all_spans),
                    "wall_s": _summary_float(result, "wall_time_s"),
                })
    return {label: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for label, rs in runs.items()}
