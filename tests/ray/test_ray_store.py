"""The Ray object store is sized from the model (issue 31 §1, T10): it must hold 2 weight versions
plus 2 micro-batches; a size set too small is refused before any cluster starts, naming
`ray.object_store_mb` and the bytes needed; left at its default (0) it is sized up; a joined
cluster whose store is too small is refused. Checked with a Qwen2.5-0.5B-shaped config.json (no
weights: the shape is read on the meta device) and no cluster (`connect` replaced)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from relayrl.backends.ray import build  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.bench.gpu_check import QWEN2_05B  # noqa: E402
from relayrl.config.schema import ConfigError, RayConfig, load_config  # noqa: E402
from relayrl.config.sizing import MB, MICROBATCH_BYTES_PER_POSITION  # noqa: E402
from relayrl.models.loading import shipped_model_dir  # noqa: E402
from support.cli import relayrl  # noqa: E402

pytestmark = pytest.mark.torch


class _Connected(Exception):
    """Raised by the stand-in `connect`: how far the build got, with the config it was given."""


@pytest.fixture(scope="module")
def qwen_05b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config

    directory = tmp_path_factory.mktemp("qwen05b")
    Qwen2Config(**QWEN2_05B).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (the CLI loads the tokenizer after the preflights)
        shutil.copy(shipped_model_dir() / name, directory / name)
    return directory


def _params() -> int:
    """The 0.5B shape's parameter count, tied embedding once, computed from the config alone."""
    c = QWEN2_05B
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o
    return v * h + layers * (attention + 3 * h * i + 2 * h) + h


def _place(cfg: Any, monkeypatch: pytest.MonkeyPatch) -> list[RayConfig]:
    seen: list[RayConfig] = []

    def connect(ray_cfg: RayConfig) -> RayCluster:
        seen.append(ray_cfg)
        raise _Connected

    monkeypatch.setattr(build, "connect", connect)
    with pytest.raises(_Connected):
        build.place_on_ray(cfg, compute=None, evaluate=False)  # type: ignore[arg-type]
    return seen


def test_a_store_set_too_small_is_refused_naming_the_key_and_the_bytes(qwen_05b: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["run.backend=local", "ray.enabled=true", f"model.path={qwen_05b}", "ray.object_store_mb=256"])
    connected: list[RayConfig] = []
    monkeypatch.setattr(build, "connect", connected.append)
    with pytest.raises(ConfigError) as err:
        build.place_on_ray(cfg, compute=None, evaluate=False)  # type: ignore[arg-type]
    need = 2 * _params() * 4 + 2 * 256 * 4 * MICROBATCH_BYTES_PER_POSITION
    message = str(err.value)
    assert message.startswith("ray.object_store_mb = 256 is too small") and "\n" not in message
    assert f"{need:,} bytes" in message and f"at least {-(-need // MB)}" in message
    assert connected == []  # refused before any cluster starts


def test_the_cli_refuses_a_store_set_too_small_before_loading_anything(qwen_05b: Path, tmp_path: Path) -> None:
    """The directory has no weights: a run that got as far as loading the model would fail otherwise."""
    res = relayrl(
        "train", "--ray", "--set", "run.backend=local", "--set", f"model.path={qwen_05b}", "--set", "ray.object_store_mb=256",
        "--set", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ray.object_store_mb = 256 is too small"), res.stderr
    assert f"2 weight versions of {_params() * 4:,} bytes" in lines[0]  # fp32 master weights, the tied embedding once
    assert int(lines[0].rsplit("at least ", 1)[1].split()[0]) >= 2 * _params() * 4 / MB
    assert not (tmp_path / "runs").exists() and "Ray cluster" not in res.stdout


def test_the_default_store_is_sized_from_the_model(
    qwen_05b: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(None, ["run.backend=local", "ray.enabled=true", f"model.path={qwen_05b}"])
    assert cfg.ray.object_store_mb == 0  # the default: sized from the model
    (started,) = _place(cfg, monkeypatch)
    need = 2 * _params() * 4 + 2 * 256 * 4 * MICROBATCH_BYTES_PER_POSITION
    assert started.object_store_mb == -(-need // MB) > 3000  # 2 fp32 versions of ~0.5B parameters
    lines = [line for line in capsys.readouterr().out.splitlines() if "ray.object_store_mb" in line]
    assert len(lines) == 1 and f"{started.object_store_mb:,} MB" in lines[0]
    # bfloat16-pure weights: half the bytes per version
    pure = load_config(None, ["run.backend=local", "ray.enabled=true", f"model.path={qwen_05b}", "model.dtype=bfloat16-pure"])
    (half,) = _place(pure, monkeypatch)
    assert half.object_store_mb == -(-(2 * _params() * 2 + 2 * 256 * 4 * MICROBATCH_BYTES_PER_POSITION) // MB)
    # the shipped tiny model and the sim: the default size
    tiny = load_config(None, ["run.backend=local", "ray.enabled=true"])
    assert _place(tiny, monkeypatch)[0].object_store_mb == 256
    assert _place(load_config(None, ["ray.enabled=true"]), monkeypatch)[0].object_store_mb == 256


def test_a_joined_cluster_whose_store_is_too_small_is_refused(qwen_05b: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    cfg = load_config(None, ["run.backend=local", "ray.enabled=true", f"model.path={qwen_05b}", "ray.address=auto"])
    closed: list[RayCluster] = []
    cluster = RayCluster(address="10.0.0.1:6379", owned=False, start_seconds=0.0)
    monkeypatch.setattr(build, "_close", lambda cleanups, c: closed.append(c))
    monkeypatch.setattr(build, "connect", lambda ray_cfg: cluster)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"object_store_memory": 256.0 * MB}}])
    with pytest.raises(ConfigError, match=r"^ray.address = 'auto': the Ray cluster's smallest object store is 268,435,456 bytes"):
        build.place_on_ray(cfg, compute=None, evaluate=False)  # type: ignore[arg-type]
    assert closed == [cluster]  # left as the build leaves a failed start: closed (a joined one: disconnected)


def test_a_store_below_64_mb_is_refused() -> None:
    with pytest.raises(ConfigError, match="ray.object_store_mb"):
        load_config(None, ["ray.object_store_mb=32"])
