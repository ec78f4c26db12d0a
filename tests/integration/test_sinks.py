"""Metric sinks: metrics.jsonl is always written and its errors propagate; an optional sink that
fails is reported once and disabled while the run goes on; TensorBoard, W&B (offline) and MLflow
(local file store) really log, and the values are read back from what they wrote to disk."""

from __future__ import annotations

import json
import os
import struct
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from relayrl.config.schema import ConfigError
from relayrl.telemetry import sinks as sinks_mod
from relayrl.telemetry.sinks import (
    GuardedSink,
    JsonlSink,
    Metrics,
    MetricSink,
    SinkDisabledWarning,
    SinkSet,
    build_sinks,
)

# No third-party telemetry, no network: set before any test imports MLflow or W&B.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")

# W&B's import builds pydantic models whose field docstrings pydantic reads with `ast.parse`; on
# CPython 3.11 (< 3.11.8, gh-106905) an `ast.parse` while another thread converts an AST can fail
# with "SystemError: AST constructor recursion depth mismatch", which left `wandb` half-imported
# for every later test in one CI run (threads that earlier tests left were running). Imported here,
# at collection, before any test runs a thread.
for _sink_module in ("wandb", "mlflow", "tensorboardX"):
    try:
        __import__(_sink_module)
    except ImportError:
        pass

CONFIG: dict[str, object] = {"run": {"name": "t", "seed": 0}, "rollout": {"num_generations": 4, "max_staleness": 1}}


def _metrics(step: int) -> dict[str, float | int | None]:
    return {
        "step": step,
        "policy_version": step + 1,
        "reward_mean": 0.25 * step,
        "boundary_gap_sec": None,  # the first step has no gap
        "num_trajectories": 16,
        "train/loss": 1.0 / (step + 1),
    }


def _read_jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def restore_env() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class _Recorder:
    def __init__(self, fail_at: int | None = None, fail_close: bool = False) -> None:
        self.steps: list[int] = []
        self.closed = False
        self.fail_at = fail_at
        self.fail_close = fail_close

    def log(self, step: int, metrics: Metrics) -> None:
        if step == self.fail_at:
            raise PermissionError("401 Unauthorized: bad API key")
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True
        if self.fail_close:
            raise OSError(28, "No space left on device")


def test_jsonl_sink_writes_one_flushed_line_per_step(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    assert isinstance(sink, MetricSink)
    for step in range(3):
        sink.log(step, _metrics(step))
        rows = _read_jsonl(tmp_path / "metrics.jsonl")  # readable before close: flushed per step
        assert len(rows) == step + 1
    sink.close()
    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1] == _metrics(1)
    assert list(rows[0])[0] == "step"
    assert rows[0]["boundary_gap_sec"] is None


def test_unknown_sink_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"telemetry\.sinks.*'tensorbord'") as info:
        build_sinks(tmp_path, ["wandb", "tensorbord"], "t", CONFIG)
    assert isinstance(info.value, ConfigError)
    assert not (tmp_path / "metrics.jsonl").exists()  # validated before anything is built


def test_jsonl_only_and_duplicates(tmp_path: Path) -> None:
    sinks = build_sinks(tmp_path, ["jsonl"], "t", CONFIG)
    assert sinks.active == ["jsonl"]
    sinks.log(0, _metrics(0))
    sinks.close()
    assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_failing_sink_warns_once_and_is_disabled_while_jsonl_goes_on(tmp_path: Path) -> None:
    flaky, healthy = _Recorder(fail_at=1), _Recorder()
    sinks = SinkSet(JsonlSink(tmp_path / "metrics.jsonl"))
    sinks.add("flaky", flaky)
    sinks.add("healthy", healthy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            sinks.log(step, _metrics(step))
        sinks.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, SinkDisabledWarning)]
    assert len(messages) == 1, messages
    assert "'flaky'" in messages[0] and "401 Unauthorized" in messages[0] and "log(step=1)" in messages[0]
    assert flaky.steps == [0] and flaky.closed  # closed once when disabled, never called again
    assert healthy.steps == [0, 1, 2, 3] and healthy.closed
    assert sinks.active == ["jsonl", "healthy"]
    assert sinks.failed == {"flaky": "PermissionError: 401 Unauthorized: bad API key"}
    assert [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def test_failing_close_is_reported_and_jsonl_still_closed(tmp_path: Path) -> None:
    reports: list[str] = []
    sinks = SinkSet(JsonlSink(tmp_path / "metrics.jsonl"), report=reports.append)
    sinks.add("disk", _Recorder(fail_close=True))
    sinks.log(0, _metrics(0))
    sinks.close()
    assert len(reports) == 1 and "'disk'" in reports[0] and "close" in reports[0] and "No space left" in reports[0]
    assert sinks.jsonl._writer._fh.closed


def test_jsonl_failure_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = _Recorder()
    sinks = SinkSet(JsonlSink(tmp_path / "metrics.jsonl"))
    sinks.add("other", other)
    sinks.log(0, _metrics(0))

    def full_disk(rows: list[dict[str, object]]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sinks.jsonl._writer, "write_many", full_disk)
    with pytest.raises(OSError, match="No space left"):
        sinks.log(1, _metrics(1))
    assert sinks.active == ["jsonl", "other"]  # the JSONL sink is never dropped


def test_sink_that_cannot_start_is_reported_once_and_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if the extra were not installed
    reports: list[str] = []
    sinks = build_sinks(tmp_path, ["tensorboard"], "t", CONFIG, report=reports.append)
    assert len(reports) == 1
    assert "'tensorboard'" in reports[0] and "relayrl[tensorboard]" in reports[0]
    assert sinks.active == ["jsonl"] and list(sinks.failed) == ["tensorboard"]
    sinks.log(0, _metrics(0))
    sinks.close()
    assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_default_reporter_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.warns(SinkDisabledWarning, match=r"'wandb'.*relayrl\[wandb\]"):
        sinks = build_sinks(tmp_path, ["wandb"], "t", CONFIG)
    sinks.close()


def test_guarded_sink_is_a_metric_sink() -> None:
    assert isinstance(GuardedSink("x", _Recorder()), MetricSink)


# --- the real back-ends, read back from disk -----------------------------------------------------


def _tfrecords(path: Path) -> Iterator[bytes]:
    """Records of a TFRecord file (length, masked crc, data, masked crc)."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        yield data[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto import event_pb2

    sinks = build_sinks(tmp_path, ["tensorboard"], "t", CONFIG)
    assert sinks.active == ["jsonl", "tensorboard"]
    for step in range(3):
        sinks.log(step, _metrics(step))
    sinks.close()
    (event_file,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars: dict[tuple[str, int], float] = {}
    for record in _tfrecords(event_file):
        event = event_pb2.Event.FromString(record)
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars[(value.tag, event.step)] = value.simple_value
    assert scalars[("reward_mean", 2)] == pytest.approx(0.5)
    assert scalars[("train/loss", 1)] == pytest.approx(0.5)
    assert scalars[("num_trajectories", 0)] == 16
    assert not any(tag in ("step", "boundary_gap_sec") for tag, _ in scalars)  # x-axis; None skipped


def _wandb_records(path: Path) -> Iterator[object]:
    """Records of a W&B offline `.wandb` file: a 7-byte header, then LevelDB-log framed protobuf
    `Record`s in 32 KiB blocks (crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            yield wandb_internal_pb2.Record.FromString(pending)  # type: ignore[attr-defined]
            pending = b""


def _finished_wandb_records(offline_dir: Path, timeout_s: float = 60.0) -> list[object]:
    """The records of the one offline run under `offline_dir` once its transaction log is complete.
    `run.finish()` returns when W&B's service has handled the run's exit, but the service writes
    the log in a process of its own and may flush it a moment later on a loaded machine: wait
    (bounded) for the exit record, which comes last."""
    import time

    (run_dir,) = offline_dir.glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_wandb_records(run_file))
        kinds = [r.WhichOneof("record_type") for r in records]  # type: ignore[attr-defined]
        if "exit" in kinds:
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{run_file}: no exit record {timeout_s:.0f} s after finish(); records: {kinds}")
        time.sleep(0.2)


def test_wandb_offline_run_holds_the_history(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    sinks = build_sinks(tmp_path, ["wandb"], "wb-run", CONFIG)
    assert sinks.active == ["jsonl", "wandb"], sinks.failed
    with ThreadPoolExecutor(1, thread_name_prefix="bookkeeping") as pool:  # as the run does
        for step in range(3):
            pool.submit(sinks.log, step, _metrics(step)).result()
        pool.submit(sinks.close).result()

    history: dict[int, dict[str, object]] = {}
    config_json = ""
    for record in _finished_wandb_records(tmp_path / "wandb"):
        kind = record.WhichOneof("record_type")  # type: ignore[attr-defined]
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}  # type: ignore[attr-defined]
            history[int(row["_step"])] = row
        elif kind == "run":
            config_json = str(record.run.config)  # type: ignore[attr-defined]
    assert sorted(history) == [0, 1, 2]
    assert history[2]["reward_mean"] == pytest.approx(0.5)
    assert history[1]["train/loss"] == pytest.approx(0.5)
    assert "boundary_gap_sec" not in history[0]
    assert "num_generations" in config_json


def test_mlflow_file_store_holds_the_metrics(tmp_path: Path, restore_env: None) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)  # the sink opts in to the file store itself
    sinks = build_sinks(tmp_path, ["mlflow"], "ml-run", CONFIG)
    assert sinks.active == ["jsonl", "mlflow"], sinks.failed
    (sink,) = sinks.optional
    run_id = sink._sink.run_id  # type: ignore[union-attr]
    for step in range(3):
        sinks.log(step, _metrics(step))
    sinks.close()

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    history = client.get_metric_history(run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert [m.value for m in client.get_metric_history(run_id, "train/loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert client.get_metric_history(run_id, "boundary_gap_sec") == []
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "ml-run"
    assert run.data.params["rollout.num_generations"] == "4"
    assert client.get_experiment(run.info.experiment_id).name == "relayrl"


def test_all_sinks_together(tmp_path: Path, restore_env: None) -> None:
    for module in ("tensorboardX", "wandb", "mlflow"):
        pytest.importorskip(module)
    sinks = build_sinks(tmp_path, ["mlflow", "tensorboard", "wandb", "wandb"], "all", CONFIG)
    assert sinks.active == ["jsonl", "mlflow", "tensorboard", "wandb"], sinks.failed
    for step in range(2):
        sinks.log(step, _metrics(step))
    sinks.close()
    assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "mlruns", "tensorboard", "wandb"]


def test_numeric_filter() -> None:
    import numpy as np

    numeric = sinks_mod._numeric({"step": 3, "a": None, "b": True, "c": 1.5, "d": 2, "e": "x", "f": np.int64(4), "g": np.float32(0.5)})  # type: ignore[dict-item]  # deliberately not metric values
    assert numeric == {"b": 1, "c": 1.5, "d": 2, "f": 4, "g": 0.5}
    assert type(numeric["f"]) is int and type(numeric["g"]) is float
    assert sinks_mod._flatten({"a": {"b": 1, "c": "x"}, "d": [1, 2]}) == {"a.b": "1", "a.c": "x", "d": "[1, 2]"}


def test_after_a_resume_no_sink_shows_a_step_twice(tmp_path: Path, restore_env: None) -> None:
    """A run with every sink crashes after step 4 (newest checkpoint: step 3) and is resumed to
    step 5: steps 4's rows from the crashed run are not kept next to the redone ones, and the
    steps before the checkpoint are all still there, in every sink."""
    import asyncio

    from mlflow.tracking import MlflowClient
    from tensorboardX.proto import event_pb2

    from relayrl.orchestrator.build import build_program
    from support.simutil import StopAt, Stopped, sim_config

    sets = ['telemetry.sinks=["tensorboard", "wandb", "mlflow"]', "orchestrator.checkpoint_every=2"]
    run_dir = tmp_path / "run"
    with pytest.raises(Stopped, match="stopped at step 5"):
        asyncio.run(build_program(sim_config(*sets, "run.steps=6"), [StopAt(5)], run_dir=run_dir).run())
    asyncio.run(build_program(sim_config(*sets, "run.steps=6"), run_dir=run_dir, resume=True).run())
    steps = list(range(1, 7))
    assert [r["step"] for r in _read_jsonl(run_dir / "metrics.jsonl")] == steps

    tb_steps = []
    for event_file in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
        for record in _tfrecords(event_file):
            event = event_pb2.Event.FromString(record)
            tb_steps += [event.step for v in event.summary.value if v.tag == "reward_mean"]
    assert sorted(tb_steps) == steps

    wb_steps = []  # the crashed run's offline record is gone: one offline run is left
    for wandb_record in _finished_wandb_records(run_dir / "wandb"):
        if wandb_record.WhichOneof("record_type") == "history":  # type: ignore[attr-defined]
            items = wandb_record.history.item  # type: ignore[attr-defined]
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
            if "reward_mean" in row:
                wb_steps.append(int(row["_step"]))
    assert sorted(wb_steps) == steps

    client = MlflowClient(tracking_uri=f"file:{run_dir / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "relayrl"]
    (live,) = client.search_runs([experiment.experiment_id])  # the crashed run's is marked deleted
    assert [m.step for m in client.get_metric_history(live.info.run_id, "reward_mean")] == steps
