"""Predict a run: the real orchestrator on the modelled workers (relayrl.plan.workers) under the
target configuration, several seeds; the figures with their spread across seeds.

The target configuration is the source run's config.toml with the `--set` overrides, run on the
sim compute kind's driver side (collator, tokenizer: packing and bookkeeping burn the fitted host
costs) in a temporary directory, held-out evaluation off (its time is in the model's fixed_s).
A predicted run takes as long as the run it predicts (the modelled devices spend real time).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relayrl.config.schema import Config, load_config
from relayrl.errors import UserError
from relayrl.plan.check import FIGURES
from relayrl.plan.fit import PlanModel
from relayrl.plan.resources import devices_for
from relayrl.plan.source import SourceRun, measured_figures, read_source
from relayrl.plan.workers import PlanSampler, PlanTrainer, RayCosts, RayPlanTrainer


def target_config(source_dir: Path, sets: Sequence[str]) -> Config:
    """The source run's config with `sets` applied (UserError naming a bad key or value)."""
    return load_config(Path(source_dir) / "config.toml", list(sets))


def _sim_config(target: Config, model: PlanModel, seed: int, out_dir: Path, steps: int | None) -> Config:
    cfg = target.model_copy(deep=True)
    cfg.run.backend = "sim"
    cfg.run.seed = seed
    cfg.run.output_dir = str(out_dir)
    cfg.run.name = f"seed-{seed}"
    cfg.run.save_model = False
    if steps is not None:
        cfg.run.steps = steps
    cfg.ray.enabled = False
    cfg.eval.enabled = False
    cfg.telemetry.sinks = []
    cfg.sim.prompt_tokens = model.prompt_tokens
    cfg.sim.pack_per_microbatch = model.pack_s
    for part, seconds in model.bookkeeping_s.items():
        setattr(cfg.sim, part, seconds)
    return cfg


# predicting a Ray run from a local one: one actor call's round trip as measured on this kind of
# machine (shared/FACTS.md, Ray 2.60: 0.7-0.8 ms), for the trainer's and the samplers' calls alike
ASSUMED_RAY_CALL_S = 0.00075


def ray_costs(target: Config, model: PlanModel) -> tuple[RayCosts | None, str | None]:
    """The round trips a planned run on Ray pays: the source's when it ran on Ray, else assumed
    (ASSUMED_RAY_CALL_S; the second value says so); (None, None) when the target is not on Ray."""
    if not target.ray.enabled:
        return None, None
    if model.ray:
        ray = model.ray
        return RayCosts(ray.get("trainer_call_s", 0.0), ray.get("sampler_call_s", 0.0), ray.get("sampler_call_per_row_s", 0.0)), None
    note = (
        f"ray: the source ran without Ray; each actor call's round trip is assumed {ASSUMED_RAY_CALL_S * 1e3:.2f} ms"
        " and the weight transport the source's sync round"
    )
    return RayCosts(ASSUMED_RAY_CALL_S, ASSUMED_RAY_CALL_S), note


def _run_once(cfg: Config, model: PlanModel, ray: RayCosts | None, queue_ahead: bool) -> Path:
    from relayrl.backends.sim.build import compute
    from relayrl.orchestrator.build import build_program

    devices = devices_for(cfg, model.contention)
    parts = compute(cfg, threading.Event())
    trainer = (
        RayPlanTrainer(model, devices["trainer"], ray, queue_ahead, ppo_epochs=cfg.train.ppo_epochs)
        if ray is not None
        else PlanTrainer(model, devices["trainer"], ppo_epochs=cfg.train.ppo_epochs)
    )
    backend = parts.backend(
        trainer=trainer,
        samplers=[
            PlanSampler(model, devices[f"sampler/{i}"], cfg.rollout.max_new_tokens, cfg.run.seed, i, ray)
            for i in range(cfg.rollout.num_samplers)
        ],
        greedy=None,
        startup={},
        cleanup=lambda: None,
        attach_tracer=trainer.attach if isinstance(trainer, RayPlanTrainer) else lambda _tracer: None,
    )
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    asyncio.run(build_program(cfg, run_dir=run_dir, backend=backend).run())
    return run_dir


@dataclass(slots=True)
class Prediction:
    """Per seed figures and their spread."""

    per_seed: list[dict[str, object]]
    assumed: str | None = None  # what the prediction assumed beyond the source's trace

    def figure(self, name: str) -> dict[str, float] | None:
        values = [float(v) for f in self.per_seed if isinstance(v := f.get(name), int | float)]
        if not values:
            return None
        return {
            "mean": statistics.fmean(values),
            "std": statistics.pstdev(values),
            "min": min(values),
            "max": max(values),
        }

    def staleness(self) -> dict[str, dict[str, float]]:
        shares = [s if isinstance(s := f.get("staleness"), dict) else {} for f in self.per_seed]
        keys = sorted({k for s in shares for k in s}, key=int)
        out = {}
        for k in keys:
            values = [float(s.get(k, 0.0)) for s in shares]
            out[k] = {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values), "max": max(values)}
        return out

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {name: self.figure(name) for name in FIGURES}
        out["staleness"] = self.staleness()
        out["seeds"] = len(self.per_seed)
        if self.assumed:
            out["assumed"] = self.assumed
        return out


def _figures(run_dir: Path, model: PlanModel) -> dict[str, object]:
    run = read_source(run_dir)
    figures: dict[str, object] = dict(measured_figures(run))
    # the planned run has no held-out evaluation and no model start-up: put the source's time
    # outside training (model.fixed_s) in place of the planned run's own
    wall = run.summary.get("wall_time_s")
    ledger = run.summary.get("ledger")
    trained = ledger.get("trajectories_trained") if isinstance(ledger, dict) else None
    spans = run.spans
    first = min((s.start for s in spans if s.name == "generate"), default=0.0)
    end = max((s.end for s in spans if s.lane == "trainer" and s.name in ("train_step", "optim_step")), default=0.0)
    if isinstance(wall, int | float) and isinstance(trained, int) and wall > 0:
        own_fixed = first + max(0.0, float(wall) - end)
        adjusted = float(wall) - own_fixed + model.fixed_s
        figures["samples_per_s"] = trained / adjusted if adjusted > 0 else None
        figures["wall_time_s"] = adjusted
    return figures


def predict(target: Config, model: PlanModel, seeds: int = 3, steps: int | None = None) -> Prediction:
    """Run `target` on the modelled workers `seeds` times (seeds target.run.seed + i)."""
    if seeds < 1:
        raise UserError(f"--seeds {seeds}: at least 1")
    if target.task.environment is not None or target.task.agent is not None:
        raise UserError("plan: multi-turn and agent runs are not modelled yet (task.environment / task.agent set)")
    per_seed = []
    ray, assumed = ray_costs(target, model)
    with tempfile.TemporaryDirectory(prefix="relayrl-plan-") as tmp:
        for i in range(seeds):
            cfg = _sim_config(target, model, target.run.seed + i, Path(tmp), steps)
            per_seed.append(_figures(_run_once(cfg, model, ray, target.ray.queue_ahead), model))
    return Prediction(per_seed, assumed)


def source_figures(run: SourceRun) -> dict[str, object]:
    """The source run's measured figures (source.measured_figures)."""
    return dict(measured_figures(run))
