"""Benchmarks that print figures: the step boundary (inline vs overlapped), the control plane,
the default recipe end to end, a soak (a long run: does anything grow with the steps?), weight
sync on Ray and scale by simulation on Ray (8 sampler replicas, heavy-tailed generation).

Invariant: each benchmark runs its configurations one after the other in this process on the
same workload and reports their ratio; nothing here asserts a time (machines are noisy).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from relayrl.analysis import timeline
from relayrl.config.schema import Config, ConfigError, load_config
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.program import RunResult
from relayrl.recipes import default_recipe
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.tracer import load_trace
from relayrl.types import Weights

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
        "orchestrator.checkpoint_every=0",  # not what it measures
    ]
    return load_config(None, overrides + (extra or []))


def _summary_float(result: RunResult, key: str) -> float:
    """A figure the run already put in its summary (NaN when it has none, e.g. no boundary)."""
    value = result.summary.get(key)
    return float(value) if isinstance(value, int | float) else float("nan")


def _figures(result: RunResult) -> BoundaryFigures:
    results = list(result.results)  # read back from metrics.jsonl once
    lags = [float(r.metrics.get("loop_lag_max_ms") or 0.0) for r in results]
    return BoundaryFigures(
        gap_median_s=_summary_float(result, "boundary_gap_median_s"),
        busy_fraction=_summary_float(result, "trainer_busy_fraction"),
        loop_lag_max_ms=max(lags, default=0.0),
        step_time_median_s=statistics.median(float(r.metrics["step_time_sec"] or 0.0) for r in results),
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
        "orchestrator.checkpoint_every=0",  # not what it measures
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
# (D) C hosted on Ray actors, on a local cluster the benchmark starts once for all of D's runs
# (joined with ray.address=auto). Neither the cluster start nor the actors' start-up (model
# loading, in build_program) is in D's wall time: the run's clock starts after the build.
E2E_RAY_CONFIG: dict[str, list[str]] = {"D": ["ray.enabled=true", "ray.address=auto"]}
E2E_RAY_TARGETS: dict[str, float] = {"d_over_c": 0.85, "gap_median_s": 0.005, "trainer_busy": 0.95}


def _e2e_figures(result: RunResult) -> dict[str, float]:
    all_spans = timeline.spans(result.tracer.events)  # read back from trace.json
    return {
        "samples_per_s": _summary_float(result, "samples_per_s"),
        "trainer_busy": _summary_float(result, "trainer_busy_fraction"),
        # with Ray the sampler/<i> generate spans are recorded driver-side around the remote call
        "sampler_busy": timeline.lane_busy_fraction(all_spans, "sampler/", "generate"),
        "gap_median_s": _summary_float(result, "boundary_gap_median_s"),
        "exposed_bookkeeping_s": timeline.exposed_bookkeeping_time(all_spans),
        "wall_s": _summary_float(result, "wall_time_s"),
    }


def run_e2e(
    steps: int = 8, recipe: Path | None = None, extra: list[str] | None = None, repeats: int = 1, ray: bool = False
) -> dict[str, dict[str, float]]:
    """The default recipe, shortened, in configurations A, B and C (see E2E_CONFIGS), plus D (C on
    Ray actors, see E2E_RAY_CONFIG) with `ray`, run `repeats` times round-robin (A B C A B C ...);
    each figure is the median over the repeats."""

    configs = {**E2E_CONFIGS, **(E2E_RAY_CONFIG if ray else {})}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in configs}
    cluster = None
    try:
        with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
            for rep in range(repeats):
                for label, overrides in configs.items():
                    if label in E2E_RAY_CONFIG and cluster is None:
                        from relayrl.backends.ray.cluster import connect
                        from relayrl.config.schema import RayConfig

                        cluster = connect(RayConfig())  # once, before the first D run: not in D's figures
                    cfg = load_config(recipe or default_recipe(), [f"run.steps={steps}", "eval.enabled=false", *overrides, *(extra or [])])
                    result = asyncio.run(build_program(cfg, run_dir=Path(tmp) / f"{label}{rep}").run())
                    runs[label].append(_e2e_figures(result))
    finally:
        if cluster is not None:
            cluster.close()
    return {label: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for label, rs in runs.items()}


# -- soak: a long sim run that samples what a run keeps --------------------------------------

SOAK_TIME_SCALE = 0.01  # the boundary profile ÷ 100: 2000 steps take ~75 s on 2 cores
SOAK_SAMPLE_EVERY = 100
SOAK_TARGETS: dict[str, float] = {"rss_drift_fraction": 0.05, "step_time_ratio": 1.2, "release_time_ratio": 1.2}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # a peak, not the current size


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))  # native threads too (torch, glibc)
    except OSError:
        import threading

        return threading.active_count()


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1  # not Linux: unknown


@dataclass(slots=True)
class SoakSample:
    step: int
    rss_bytes: int
    threads: int
    fds: int
    tasks: int


class SoakSampler(Callback):
    """Samples RSS, threads, open fds and asyncio tasks at the start of every `every`-th step (and
    of `extra` steps), on the event loop. Per-step figures are read from the run's files after it."""

    def __init__(self, every: int = SOAK_SAMPLE_EVERY, extra: tuple[int, ...] = ()) -> None:
        self.every = every
        self.extra = set(extra)
        self.samples: list[SoakSample] = []

    def on_step_begin(self, step: int) -> None:
        if (step - 1) % self.every == 0 or step in self.extra:  # steps 1, 1 + every, ...
            self.samples.append(SoakSample(step, _rss_bytes(), _thread_count(), _fd_count(), len(asyncio.all_tasks())))


def _span_durations(trace: Path, name: str) -> dict[int, float]:
    """step -> duration (s) of the bookkeeping span `name`, read back from the run's trace file."""
    out: dict[int, float] = {}
    for s in timeline.spans(load_trace(trace)):
        if s.lane == "bookkeeping" and s.name == name:
            out[s.step] = s.dur
    return out


def _window_ratio(values: dict[int, float], warmup: int, total: int) -> tuple[float, float, float]:
    """(median of the first 10% of steps after `warmup`, median of the last 10%, last / first)."""
    width = max(1, (total - warmup) // 10)
    first = [values[s] for s in range(warmup + 1, warmup + 1 + width) if s in values]  # steps are numbered from 1
    last = [values[s] for s in range(total - width + 1, total + 1) if s in values]
    if not first or not last:
        return float("nan"), float("nan"), float("nan")
    a, b = statistics.median(first), statistics.median(last)
    return a, b, (b / a if a > 0 else float("nan"))


def soak_config(steps: int, time_scale: float = SOAK_TIME_SCALE, extra: list[str] | None = None) -> Config:
    return boundary_config(
        True,
        steps,
        time_scale,
        ["run.name=bench-soak", "orchestrator.release_memory=true", "orchestrator.checkpoint_every=0", *(extra or [])],
    )


def run_soak(steps: int = 2000, time_scale: float = SOAK_TIME_SCALE, extra: list[str] | None = None) -> dict[str, object]:
    """A long overlapped sim run with `release_memory` on (the case that degraded): does what the
    run keeps, its step time or its memory release time grow with the number of steps?"""
    if steps < 20:
        raise ConfigError(f"bench soak needs at least 20 steps, got {steps}")
    warmup = min(SOAK_SAMPLE_EVERY, steps // 10)  # caches, lazily started threads, the first freeze
    sampler = SoakSampler(extra=(warmup + 1, steps))  # at the start of the first step after the warm-up, and of the last
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
        run_dir = Path(tmp) / "soak"
        program = build_program(soak_config(steps, time_scale, extra), [sampler], run_dir=run_dir)
        result = asyncio.run(program.run())
        release = _span_durations(run_dir / "trace.json", "release_memory")
        step_times = {r.step: float(r.metrics.get("step_time_sec") or 0.0) for r in result.results}  # metrics.jsonl
    step_first, step_last, step_ratio = _window_ratio(step_times, warmup, steps)
    rel_first, rel_last, rel_ratio = _window_ratio(release, warmup, steps)
    start = next(s for s in sampler.samples if s.step == warmup + 1)
    end = sampler.samples[-1]
    return {
        "rss_drift_fraction": (end.rss_bytes - start.rss_bytes) / start.rss_bytes,
        "step_time_ratio": step_ratio,
        "release_time_ratio": rel_ratio,
        "threads_start": start.threads,
        "threads_end": end.threads,
        "fds_start": start.fds,
        "fds_end": end.fds,
        "tasks_start": start.tasks,
        "tasks_end": end.tasks,
        "steps": steps,
        "warmup_steps": warmup,
        "step_time_first_s": step_first,
        "step_time_last_s": step_last,
        "release_time_first_s": rel_first,
        "release_time_last_s": rel_last,
        "rss_start_mb": start.rss_bytes / 2**20,
        "rss_end_mb": end.rss_bytes / 2**20,
        "wall_s": _summary_float(result, "wall_time_s"),
        "samples": [
            {"step": s.step, "rss_mb": round(s.rss_bytes / 2**20, 2), "threads": s.threads, "fds": s.fds, "tasks": s.tasks}
            for s in sampler.samples
        ],
    }


# -- weight sync: one version from a trainer actor into N sampler actors -----------------------

WEIGHT_SYNC_MODELS = ("tiny", "qwen2-50m")
WEIGHT_SYNC_TARGET_GBPS = 2.0  # for qwen2-50m on one node
WEIGHT_SYNC_MAX_WARMUP = 8  # versions before the timed ones (numpy): enough to go round the object store


def _bench_model(name: str) -> Any:
    """The shipped tiny model (the local loader) or a random ~50 M-parameter Qwen2 built here."""
    import torch

    if name == "tiny":
        from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir

        model, _ = load_model_and_tokenizer(shipped_model_dir())
        return model
    if name == "qwen2-50m":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        return Qwen2ForCausalLM(config).eval()
    raise ConfigError(f"unknown weight-sync model {name!r} (one of {', '.join(WEIGHT_SYNC_MODELS)})")


@dataclass(slots=True)
class TensorState:
    """The baseline payload: the state dict as torch tensors, pickled into the object store
    (`backends.ray.transport.encode` converts a dict of tensors or a dataclass with tensor
    fields; this one's only field is a dict, so it travels pickled as it is)."""

    tensors: dict[str, Any]


class _ExportWorker:
    """Trainer-like worker hosted by the real `TrainerActor`: each export is a new version, so the
    actor puts it into the object store once; versions up to `numpy_versions` go as a plain
    state dict (numpy arrays in transport), later ones as a `TensorState` (pickled tensors)."""

    def __init__(self, name: str, numpy_versions: int) -> None:
        self._state = dict(_bench_model(name).state_dict())
        self._numpy_versions = numpy_versions
        self._version = 0

    async def export_weights(self) -> Weights:
        self._version += 1
        payload = dict(self._state) if self._version <= self._numpy_versions else TensorState(dict(self._state))
        return Weights(version=self._version, payload=payload)

    async def close(self) -> None:
        pass


class _LoadWorker:
    """Sampler-like worker hosted by the real `SamplerActor`: copies a version into its model."""

    def __init__(self, name: str) -> None:
        self._model = _bench_model(name)

    async def load_weights(self, weights: Weights) -> None:
        import torch

        payload = weights.payload
        state = payload.tensors if isinstance(payload, TensorState) else payload
        with torch.no_grad():
            self._model.load_state_dict(state)  # copies into the parameters

    async def close(self) -> None:
        pass


def _sync_one_model(name: str, replicas: int, versions: int, object_store_bytes: int) -> dict[str, object]:
    import functools

    import ray

    from relayrl.backends.ray.actors import SamplerActor, TrainerActor, trainer_call

    model = _bench_model(name)
    state = model.state_dict()
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    del model, state
    # A version put into object-store memory no process has touched yet pays its page faults
    # (~3x slower); a run syncs every step, so the steady state comes once the versions have gone
    # round the store. Numpy warms up that long (reported apart as the first version's time);
    # the tensors baseline then runs on the warm store after one warm-up version.
    numpy_warmup = min(WEIGHT_SYNC_MAX_WARMUP, -(-object_store_bytes // nbytes) + 1)
    warmups = {"numpy": numpy_warmup, "tensors": 1}
    trainer = TrainerActor.remote(functools.partial(_ExportWorker, name, numpy_warmup + versions))
    samplers = [SamplerActor.remote(functools.partial(_LoadWorker, name)) for _ in range(replicas)]
    actors = [trainer, *samplers]
    try:
        ray.get([a.ready.remote() for a in actors])
        out: dict[str, object] = {"params": params, "bytes": nbytes}
        for mode, warmup in warmups.items():
            times: list[tuple[float, float]] = []
            for _ in range(warmup + versions):
                started = time.perf_counter()
                weights = ray.get(trainer_call(trainer, "export_weights")).value  # put once into the object store
                exported = time.perf_counter()
                ray.get([s.call.remote("load_weights", weights) for s in samplers])  # every replica fetched and copied it
                times.append((time.perf_counter() - started, exported - started))
            timed = times[warmup:]
            seconds = statistics.median(t for t, _ in timed)
            out[mode] = {
                "s_per_version": seconds,
                "gb_per_s": nbytes / seconds / 1e9,
                "export_s": statistics.median(e for _, e in timed),
                "first_s_per_version": times[0][0],
                "warmup_versions": warmup,
            }
        numpy_f, tensors_f = cast(dict[str, float], out["numpy"]), cast(dict[str, float], out["tensors"])
        out["ratio_numpy_over_tensors"] = numpy_f["gb_per_s"] / tensors_f["gb_per_s"]
        return out
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def run_weight_sync(
    replicas: int = 2, models: tuple[str, ...] = WEIGHT_SYNC_MODELS, versions: int = 3, object_store_mb: int = 1024
) -> dict[str, object]:
    """Weight-sync bandwidth on a local Ray cluster started here (and shut down): per model, the
    real trainer actor exports one version (one `ray.put`) and `replicas` real sampler actors
    fetch it and copy it into a torch model; seconds per version (median of `versions`, after
    warm-up versions that go round the object store once; the cold first version is reported
    too) and GB/s (the version's bytes / those seconds), as numpy arrays (what relayrl sends)
    and, as the baseline, as pickled torch tensors."""
    if replicas < 1:
        raise ConfigError(f"bench weight-sync needs at least 1 replica, got {replicas}")
    for name in models:
        if name not in WEIGHT_SYNC_MODELS:
            raise ConfigError(f"unknown weight-sync model {name!r} (one of {', '.join(WEIGHT_SYNC_MODELS)})")
    from relayrl.backends.ray.cluster import connect
    from relayrl.config.schema import RayConfig

    cluster = connect(RayConfig(object_store_mb=object_store_mb))
    try:
        out: dict[str, object] = {name: _sync_one_model(name, replicas, versions, object_store_mb * 2**20) for name in models}
    finally:
        cluster.close()
    out["replicas"] = replicas
    out["target_gb_per_s"] = WEIGHT_SYNC_TARGET_GBPS
    return out


# -- ray scale: sim workers on Ray, 8 sampler replicas, heavy-tailed generation ---------------

RAY_SCALE_STALENESS = (1, 2)
RAY_SCALE_TARGET_BUSY = 0.95  # trainer busy fraction at max_staleness 2
# --interruptible (rollout.interruptible): sync rounds that do not wait for generations
RAY_SCALE_TARGET_SYNC_MEAN_S = 0.1  # mean sync round
RAY_SCALE_INTERRUPTIBLE_BUSY_STALENESS = 1  # trainer busy >= RAY_SCALE_TARGET_BUSY already at this max_staleness
# The profile ÷ 2: the bench takes ~1.5 min on 2 cores. Smaller scales measure this machine more
# than the design: each train_step is a Ray round trip awaited before the next is sent, and with
# 9 actors and the driver's GIL-bound host work sharing 2 cores one costs ~20 ms of trainer idle
# (2% of a 1 s micro-batch, 4% at this scale, 20% at 0.1).
RAY_SCALE_TIME_SCALE = 0.5
RAY_SCALE_CONTROL_PLANE_STEPS_FACTOR = 4  # the control-plane run is fast: more steps, a steadier rate
# The workload, per step (costs unscaled): 16 groups × 8 completions = 128 trajectories, one group
# per generate call, so 16 calls, two per replica: a slow call is not averaged away inside a big
# batch. Completion lengths are lognormal, median 128 tokens, σ = 1 (mean ≈ 210), clipped at
# 2,048; a call lasts until the longest of its 8 completions ends: ~510 tokens at the median
# call, ~1,170 at the 90th percentile, 2,048 (clipped) at the 99th. At 2.4 ms per token of that
# longest completion (+ 10 ms per request) a call takes ~1.5 s on average and up to ~4.9 s.
# Rows of 4,096 tokens hold any trajectory (12 + 2,048); ~28 k tokens per step pack into ~7–8
# rows, 2 rows per micro-batch: ~4 micro-batches (3–5 with the lengths' spread), so the trainer
# takes ~4 × 1.0 + 0.3 = 4.3 s per step. The 8 replicas need 16 × 1.5 / 8 ≈ 3.0 s of it (~70%):
# on average they keep up, and a call in the tail (longer than a whole step) is what the
# staleness window has to absorb.
RAY_SCALE_WORKLOAD: list[str] = [
    "rollout.groups_per_step=16",
    "rollout.num_generations=8",
    "rollout.prompts_per_request=1",
    "rollout.max_new_tokens=2048",
    "train.row_tokens=4096",
    "train.rows_per_microbatch=2",
    "train.share_prompt=false",  # the sim charges per micro-batch: one prompt copy per trajectory
    "sim.length_dist=lognormal",
    "sim.length_median=128",
    "sim.length_sigma=1.0",
    "orchestrator.checkpoint_every=0",
    "eval.enabled=false",
]
RAY_SCALE_GENERATE_PER_TOKEN = 0.0024  # seconds per token of a call's longest completion (unscaled)


def ray_scale_config(
    max_staleness: int,
    steps: int,
    replicas: int,
    time_scale: float,
    control_plane: bool = False,
    extra: list[str] | None = None,
    interruptible: bool = False,
) -> Config:
    """The ray-scale workload on a running cluster (ray.address=auto): the boundary profile plus
    per-token generation, × `time_scale`; `control_plane` zeroes every simulated cost (same
    shape, completion lengths and Ray hops); `interruptible`: rollout.interruptible."""
    costs: dict[str, float] = {**BOUNDARY_PROFILE, "sim.generate_per_token": RAY_SCALE_GENERATE_PER_TOKEN}
    scale = 0.0 if control_plane else time_scale
    overrides = [f"{key}={value * scale!r}" for key, value in costs.items()]
    overrides += [
        f"run.steps={steps}",
        f"run.name=bench-ray-scale-{'cp' if control_plane else f's{max_staleness}'}{'-int' if interruptible else ''}",
        f"rollout.max_staleness={max_staleness}",
        f"rollout.interruptible={str(interruptible).lower()}",
        f"rollout.num_samplers={replicas}",
        "ray.enabled=true",
        "ray.address=auto",
        *RAY_SCALE_WORKLOAD,
    ]
    return load_config(None, overrides + (extra or []))


def oldest_token_bound(cfg: Config, steps: int = 2000, seed: int = 0) -> float:
    """The trainer busy fraction `cfg`'s sim workload can reach with the orchestration free (no sync
    round, dispatch, packing, bookkeeping or Ray hop costs anything), under the rule that a
    trajectory's staleness is its oldest token's: step b's groups start no earlier than version
    b − max_staleness exists (the end of step b − max_staleness − 1), each replica runs one
    generate call at a time (the calls of all steps taken in dispatch order by the replica free
    first), the trainer starts step b once all its groups are back and takes its micro-batches'
    `sim.train_step` plus one `sim.optim_step`. Monte Carlo over `steps` steps (the first two not
    counted), with the sim sampler's own completion lengths and call delays."""
    from relayrl.backends.sim.workers import SimSampler
    from relayrl.packing import first_fit_decreasing

    r, t, sim = cfg.rollout, cfg.train, cfg.sim
    sampler = SimSampler(sim, r.max_new_tokens, seed)
    rng = random.Random(seed)
    free = [0.0] * r.num_samplers  # when each replica is next free
    ends: dict[int, float] = {}  # step -> when its optim_step ended (the version step + 1 exists)
    busy = total = 0.0
    for step in range(steps):
        allowed = ends.get(step - r.max_staleness - 1, 0.0)
        lengths: list[int] = []
        back = 0.0
        for _ in range(r.groups_per_step // r.prompts_per_request):
            call = [sampler.completion_length(rng) for _ in range(r.num_generations * r.prompts_per_request)]
            lengths += call
            i = min(range(len(free)), key=free.__getitem__)
            free[i] = max(free[i], allowed) + sampler.generation_delay(r.prompts_per_request, max(call))
            back = max(back, free[i])
        rows = len(first_fit_decreasing([sim.prompt_tokens + n for n in lengths], t.row_tokens))
        seconds = -(-rows // t.rows_per_microbatch) * sim.train_step + sim.optim_step
        ends[step] = max(ends.get(step - 1, 0.0), back) + seconds
        if step >= 2:
            busy += seconds
            total += ends[step] - ends[step - 1]
    return busy / total


def _ray_scale_figures(result: RunResult) -> dict[str, float]:
    results = list(result.results)  # metrics.jsonl, one row per step
    exposed = [float(r.metrics.get("exposed_generation_time") or 0.0) for r in results]
    after_first = exposed[1:] or exposed  # the first step waits for its groups whatever the window
    # a sync round lasts until every replica has loaded the version, each load queued behind the
    # generate call its replica is running (rollout.interruptible: loaded between two simulated
    # tokens of it); the window moves on only after the round
    rounds = [s.dur for s in timeline.spans(result.tracer.events) if s.lane == "orchestrator" and s.name == "weight_sync"]
    return {
        "trainer_busy": _summary_float(result, "trainer_busy_fraction"),
        "exposed_generation_mean_s": statistics.mean(after_first) if after_first else 0.0,
        "exposed_generation_max_s": max(after_first, default=0.0),
        "exposed_generation_first_s": exposed[0] if exposed else 0.0,
        "staleness_mean": statistics.mean(float(r.metrics.get("staleness_mean") or 0.0) for r in results),
        "staleness_max": max(float(r.metrics.get("staleness_max") or 0.0) for r in results),
        "step_time_median_s": statistics.median(float(r.metrics.get("step_time_sec") or 0.0) for r in results),
        "sync_round_mean_s": statistics.mean(rounds) if rounds else 0.0,
        "sync_round_max_s": max(rounds, default=0.0),
        "completions_per_s": _summary_float(result, "samples_per_s"),
        "wall_s": _summary_float(result, "wall_time_s"),
    }


def run_ray_scale(
    steps: int = 16,
    replicas: int = 8,
    time_scale: float = RAY_SCALE_TIME_SCALE,
    extra: list[str] | None = None,
    interruptible: bool = False,
) -> dict[str, object]:
    """Scale by simulation: sim workers on a local Ray cluster started here (once, before the
    runs and not in their figures; shut down at the end): `replicas` sampler actors with
    heavy-tailed generation latency and the seed's large-model costs × `time_scale`
    (RAY_SCALE_WORKLOAD), at max_staleness 1 and 2; then the same shape with every simulated cost
    zero, for the control plane's trajectories/s on Ray. `interruptible`: each max_staleness also
    runs with rollout.interruptible (labels `max_staleness_<s>_interruptible`), in the same cluster,
    for the waiting and the interruptible rounds side by side."""
    if steps < 2:
        raise ConfigError(f"bench ray-scale needs at least 2 steps, got {steps}")
    if replicas < 1:
        raise ConfigError(f"bench ray-scale needs at least 1 replica, got {replicas}")
    configs = {f"max_staleness_{s}": ray_scale_config(s, steps, replicas, time_scale, extra=extra) for s in RAY_SCALE_STALENESS}
    if interruptible:
        for s in RAY_SCALE_STALENESS:
            configs[f"max_staleness_{s}_interruptible"] = ray_scale_config(s, steps, replicas, time_scale, extra=extra, interruptible=True)
    cp_steps = steps * RAY_SCALE_CONTROL_PLANE_STEPS_FACTOR
    control = ray_scale_config(max(RAY_SCALE_STALENESS), cp_steps, replicas, time_scale, control_plane=True, extra=extra)
    import contextlib
    import sys

    from relayrl.backends.ray.cluster import connect
    from relayrl.config.schema import RayConfig

    out: dict[str, object] = {}
    with contextlib.redirect_stdout(sys.stderr):  # its start-up line: stdout may carry --json
        cluster = connect(RayConfig())
    try:
        with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
            for label, cfg in configs.items():
                out[label] = _ray_scale_figures(asyncio.run(build_program(cfg, run_dir=Path(tmp) / label).run()))
            result = asyncio.run(build_program(control, run_dir=Path(tmp) / "control_plane").run())
            out["control_plane"] = {
                "steps": cp_steps,
                "trajectories": result.ledger.trajectories_trained,
                "trajectories_per_s": _summary_float(result, "samples_per_s"),
                "wall_s": _summary_float(result, "wall_time_s"),
            }
    finally:
        cluster.close()
    out["oldest_token_bound"] = {str(s): oldest_token_bound(configs[f"max_staleness_{s}"]) for s in RAY_SCALE_STALENESS}
    out.update(
        replicas=replicas,
        steps=steps,
        time_scale=time_scale,
        interruptible=interruptible,
        cluster_start_s=cluster.start_seconds,
        target_trainer_busy=RAY_SCALE_TARGET_BUSY,
    )
    return out
