"""Metric sinks: where each step's reduced metrics go — metrics.jsonl always, and optionally
TensorBoard, Weights & Biases (offline) and MLflow (local file store).

Invariant: metrics.jsonl is never lost silently — the JSONL sink is written first for every step
and any error it raises propagates. Every other sink is guarded: its first error (at
construction, at `log` or at `close`) is reported once, naming the sink and the error, and the
sink is then disabled while the run goes on. No sink touches the network: W&B runs offline and
MLflow writes a file store inside the run directory.

Resume: metrics.jsonl is rewound to the checkpoint and the redone steps are appended; every
other sink starts its record afresh (TensorBoard's event files in `tensorboard/`, W&B's offline
runs in `wandb/`, the MLflow runs tagged with this run directory: removed, or marked deleted) and
is given the rows of the steps before the checkpoint again from metrics.jsonl, so no step appears
twice in any of them and none is missing.

Sinks are called from the bookkeeping thread only (never on the event loop); they are not
thread-safe and need not be.
"""

from __future__ import annotations

import json
import numbers
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from relayrl.config.schema import OPTIONAL_SINKS, SINK_EXTRAS, ConfigError
from relayrl.rundir.jsonl import JsonlWriter, read_rows

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    from tensorboardX import SummaryWriter
    from wandb.sdk.wandb_run import Run as WandbRun

MetricValue = float | int | None
Metrics = Mapping[str, MetricValue]
Reporter = Callable[[str], None]

DEFAULT_PROJECT = "relayrl"
RUN_DIR_TAG = "relayrl.run_dir"  # MLflow tag naming the run directory that wrote a run


class SinkDisabledWarning(RuntimeWarning):
    """An optional metric sink failed and was switched off for the rest of the run."""


@runtime_checkable
class MetricSink(Protocol):
    """Receives one step's metrics at a time, in step order."""

    def log(self, step: int, metrics: Metrics) -> None: ...

    def close(self) -> None: ...


def _numeric(metrics: Metrics) -> dict[str, float | int]:
    """The values a scalar dashboard can plot: None and non-numbers dropped, `step` omitted (it is
    the x-axis), bools and numpy scalars as Python numbers."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if key == "step" or value is None:
            continue
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, int | float):
            out[key] = value
        elif isinstance(value, numbers.Integral):  # numpy integers
            out[key] = int(value)
        elif isinstance(value, numbers.Real):  # numpy floats other than float64
            out[key] = float(value)
    return out


def _jsonable(config: Mapping[str, object]) -> dict[str, object]:
    """A JSON round-trip of the config: Paths, enums and other objects become strings."""
    loaded: dict[str, object] = json.loads(json.dumps(dict(config), default=str))
    return loaded


def _flatten(config: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """Nested config → {"rollout.num_generations": "8", ...} (MLflow params are flat strings)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def _missing_extra(sink: str, exc: ImportError) -> ImportError:
    return ImportError(
        f"telemetry sink {sink!r} needs an optional package ({exc.name or exc}); "
        f"install it with: pip install 'relayrl[{SINK_EXTRAS[sink]}]'"
    )


def metrics_row(step: int, metrics: Metrics) -> dict[str, object]:
    """One step's metrics.jsonl row: `step` first, then the metrics."""
    row: dict[str, object] = {"step": step}
    row.update((k, v) for k, v in metrics.items() if k != "step")
    return row


class JsonlSink:
    """metrics.jsonl: one JSON object per step (`step` first), each a whole line followed by a
    flush, so a crash loses at most the line being written. Errors propagate."""

    name = "jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer = JsonlWriter(path)

    def log(self, step: int, metrics: Metrics) -> None:
        self._writer.write_many([metrics_row(step, metrics)])

    def close(self) -> None:
        self._writer.close()


class TensorBoardSink:
    """TensorBoard event file under `<run_dir>/tensorboard/` (tensorboardX; no TensorFlow, no
    `tensorboard` server package needed to write). Flushed every step."""

    name = "tensorboard"

    def __init__(self, logdir: Path, *, config: Mapping[str, object] | None = None, fresh: bool = False) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise _missing_extra(self.name, exc) from exc
        logdir.mkdir(parents=True, exist_ok=True)
        if fresh:  # a resumed run: the earlier event files hold steps that are being redone
            for old in logdir.glob("events.out.tfevents.*"):
                old.unlink()
        self.logdir = logdir
        self._writer: SummaryWriter = SummaryWriter(logdir=str(logdir), flush_secs=3600)
        if config:
            text = json.dumps(_jsonable(config), indent=2, sort_keys=True)
            self._writer.add_text("config", f"```\n{text}\n```", global_step=0)

    def log(self, step: int, metrics: Metrics) -> None:
        walltime = time.time()
        for key, value in _numeric(metrics).items():
            self._writer.add_scalar(key, value, global_step=step, walltime=walltime)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run in offline mode under `<run_dir>/wandb/` (never the network;
    `wandb sync <run_dir>/wandb/offline-run-*` uploads it later). Console capture, system stats,
    git and code saving are off, so it neither wraps stdout nor starts a monitor."""

    name = "wandb"

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        project: str = DEFAULT_PROJECT,
        config: Mapping[str, object] | None = None,
        fresh: bool = False,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing_extra(self.name, exc) from exc
        run_dir.mkdir(parents=True, exist_ok=True)
        if fresh:  # a resumed run: the earlier offline runs hold steps that are being redone
            for old in (run_dir / "wandb").glob("offline-run-*"):
                shutil.rmtree(old)
        settings = wandb.Settings(
            mode="offline",
            silent=True,
            console="off",
            disable_git=True,
            save_code=False,
            disable_job_creation=True,
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            x_save_requirements=False,
        )
        self._run: WandbRun = wandb.init(
            dir=str(run_dir),
            project=project,
            name=run_name,
            config=_jsonable(config or {}),
            settings=settings,
            reinit="create_new",  # never finish or reuse another run in this process
        )
        self.sync_dir = Path(self._run.settings.sync_dir)

    def log(self, step: int, metrics: Metrics) -> None:
        self._run.log(_numeric(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run in a local file store, `file:<run_dir>/mlruns` by default (never the network).

    Uses `MlflowClient` only — no global active run, no global tracking URI. MLflow ≥ 3 refuses
    file stores unless `MLFLOW_ALLOW_FILE_STORE=true`, and phones home unless
    `MLFLOW_DISABLE_TELEMETRY=true`; both are set in this process (if unset) before MLflow loads.
    """

    name = "mlflow"
    _MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch
    _MAX_PARAMS = 100  # ... and of params per log_batch
    _MAX_PARAM_LEN = 6000

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        experiment: str = DEFAULT_PROJECT,
        config: Mapping[str, object] | None = None,
        tracking_uri: str | None = None,
        fresh: bool = False,
    ) -> None:
        self.tracking_uri = tracking_uri or f"file:{(run_dir / 'mlruns').resolve()}"
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        if self.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing_extra(self.name, exc) from exc
        self._metric_cls: type[Metric] = Metric
        self._client: MlflowClient = MlflowClient(tracking_uri=self.tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
        tag = {RUN_DIR_TAG: str(run_dir.resolve())}
        if fresh:  # a resumed run: this run directory's earlier MLflow runs hold steps being redone
            query = f"tags.`{RUN_DIR_TAG}` = '{tag[RUN_DIR_TAG]}'"
            for old in self._client.search_runs([experiment_id], filter_string=query):
                self._client.delete_run(old.info.run_id)
        self.run_id: str = self._client.create_run(experiment_id, run_name=run_name, tags=tag).info.run_id
        params = [Param(k, v[: self._MAX_PARAM_LEN]) for k, v in _flatten(_jsonable(config or {})).items()]
        for i in range(0, len(params), self._MAX_PARAMS):
            self._client.log_batch(self.run_id, params=params[i : i + self._MAX_PARAMS])

    def log(self, step: int, metrics: Metrics) -> None:
        timestamp = int(time.time() * 1000)
        batch = [self._metric_cls(k, float(v), timestamp, step) for k, v in _numeric(metrics).items()]
        for i in range(0, len(batch), self._MAX_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + self._MAX_BATCH])

    def close(self) -> None:
        self._client.set_terminated(self.run_id, "FINISHED")


def warn_reporter(message: str) -> None:
    """Default reporter: a `SinkDisabledWarning` (shown once per sink by the warnings module)."""
    warnings.warn(message, SinkDisabledWarning, stacklevel=3)


class GuardedSink:
    """Wraps an optional sink: its first error is reported once (sink name, stage, error) and
    the sink is disabled; later calls do nothing."""

    def __init__(self, name: str, sink: MetricSink, report: Reporter = warn_reporter) -> None:
        self.name = name
        self._sink: MetricSink | None = sink
        self._report = report
        self.error: str | None = None

    @property
    def enabled(self) -> bool:
        """False once the sink has failed (a closed healthy sink stays enabled)."""
        return self.error is None

    def _fail(self, stage: str, exc: BaseException) -> None:
        sink, self._sink = self._sink, None
        self.error = f"{type(exc).__name__}: {exc}"
        self._report(
            f"metric sink {self.name!r} disabled after an error in {stage}: {self.error}; the run goes on (metrics.jsonl is unaffected)"
        )
        if sink is not None and stage != "close":
            try:
                sink.close()
            except Exception:  # already reported this sink's failure once
                pass

    def log(self, step: int, metrics: Metrics) -> None:
        if self._sink is None:
            return
        try:
            self._sink.log(step, metrics)
        except Exception as exc:
            self._fail(f"log(step={step})", exc)

    def close(self) -> None:
        if self._sink is None:
            return
        try:
            self._sink.close()
        except Exception as exc:
            self._fail("close", exc)
        self._sink = None


class SinkSet:
    """The JSONL sink plus any number of guarded optional sinks, used as one `MetricSink`.

    `log` writes metrics.jsonl first (errors propagate), then each enabled optional sink.
    `close` closes the optional sinks (guarded), then the JSONL sink (errors propagate).
    """

    def __init__(self, jsonl: JsonlSink, optional: Iterable[GuardedSink] = (), *, report: Reporter = warn_reporter) -> None:
        self.jsonl = jsonl
        self.optional: list[GuardedSink] = list(optional)
        self.report = report
        self.disabled: dict[str, str] = {}  # sinks that failed at construction: name → error

    def add(self, name: str, sink: MetricSink) -> None:
        self.optional.append(GuardedSink(name, sink, self.report))

    @property
    def active(self) -> list[str]:
        """Names of the sinks still receiving metrics, "jsonl" first."""
        return ["jsonl", *(s.name for s in self.optional if s.enabled)]

    @property
    def failed(self) -> dict[str, str]:
        """Every optional sink that failed so far (at construction, log or close): name → error."""
        out = dict(self.disabled)
        out.update((s.name, s.error) for s in self.optional if s.error is not None)
        return out

    def log(self, step: int, metrics: Metrics) -> None:
        self.jsonl.log(step, metrics)
        for sink in self.optional:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.optional:
            sink.close()
        self.jsonl.close()


def _construct(name: str, run_dir: Path, run_name: str, config: Mapping[str, object], project: str, fresh: bool) -> MetricSink:
    if name == "tensorboard":
        return TensorBoardSink(run_dir / "tensorboard", config=config, fresh=fresh)
    if name == "wandb":
        return WandbSink(run_dir, run_name=run_name, project=project, config=config, fresh=fresh)
    if name == "mlflow":
        return MlflowSink(run_dir, run_name=run_name, experiment=project, config=config, fresh=fresh)
    raise AssertionError(name)  # names are validated before construction


def _logged_rows(path: Path, before: int) -> list[tuple[int, dict[str, MetricValue]]]:
    """The (step, metrics) rows of metrics.jsonl for steps before `before` (a resumed run's
    rewound file), to give a sink that starts afresh."""
    if not path.exists():
        return []
    rows, _ = read_rows(path, strict=False)
    out: list[tuple[int, dict[str, MetricValue]]] = []
    for row in rows:
        step = row.get("step")
        if isinstance(step, int) and step < before:
            out.append((step, {k: v for k, v in row.items() if k != "step" and (v is None or isinstance(v, int | float))}))
    return out


def validate_sink_names(names: Sequence[str]) -> list[str]:
    """The optional sinks named, deduplicated in order ("jsonl" accepted and dropped: it is
    always on). An unknown name raises `ConfigError` (a ValueError) naming `telemetry.sinks`."""
    chosen: list[str] = []
    for name in names:
        if name == "jsonl":
            continue
        if name not in OPTIONAL_SINKS:
            raise ConfigError(f"telemetry.sinks: unknown sink {name!r} (choose from jsonl, {', '.join(OPTIONAL_SINKS)})")
        if name not in chosen:
            chosen.append(name)
    return chosen


def build_sinks(
    run_dir: Path,
    names: Sequence[str],
    run_name: str,
    config: Mapping[str, object],
    *,
    project: str = DEFAULT_PROJECT,
    report: Reporter = warn_reporter,
    resume_step: int | None = None,
) -> SinkSet:
    """metrics.jsonl in `run_dir` plus each named optional sink ("tensorboard", "wandb",
    "mlflow"). `config` is the resolved run config, recorded as the run's hyperparameters;
    `project` is the W&B project and the MLflow experiment. A sink that cannot be built
    (missing package, bad settings, unwritable directory) is reported once via `report` and
    left out; the JSONL sink's own errors propagate. `resume_step`: the run resumes at that step
    (metrics.jsonl already rewound): each optional sink starts afresh and is given the rows of
    the steps before it (see the module docstring)."""
    chosen = validate_sink_names(names)
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks = SinkSet(JsonlSink(run_dir / "metrics.jsonl"), report=report)
    replay = _logged_rows(run_dir / "metrics.jsonl", resume_step) if resume_step is not None and chosen else []
    for name in chosen:
        try:
            sink = _construct(name, run_dir, run_name, config, project, fresh=resume_step is not None)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            sinks.disabled[name] = error
            report(f"metric sink {name!r} disabled: it could not be started: {error}; the run goes on (metrics.jsonl is unaffected)")
            continue
        sinks.add(name, sink)
        for step, metrics in replay:
            sinks.optional[-1].log(step, metrics)  # guarded: a failure disables this sink only
    return sinks
