"""The GPU memory preflight (issue 30 §3; review T12), on a pretend 141 GiB CUDA device: every copy a
run keeps on a GPU is counted from the model's config.json (instantiated on the `meta` device,
nothing downloaded or allocated) before anything loads; a Qwen2.5-7B-shaped run that cannot fit is
refused in one line naming the keys to change (exit 2: a ConfigError), a 0.5B-shaped one fits."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from relayrl.backends.local.build import compute, gpu_preflight
from relayrl.bench.gpu_check import QWEN2_05B
from relayrl.config.schema import Config, ConfigError, load_config
from relayrl.config.sizing import GiB, Placement, activation_bytes, model_shape, plan_gpu_memory, precision_bytes
from support.fakecuda import pretend_cuda


def _qwen(directory: Path, **shape: int | bool) -> Path:
    Qwen2Config(num_attention_heads=28, max_position_embeddings=32768, **shape).save_pretrained(directory)  # type: ignore[arg-type]
    return directory


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _qwen(
        tmp_path_factory.mktemp("qwen7b"),
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def qwen05b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen05b")
    Qwen2Config(**QWEN2_05B).save_pretrained(directory)
    return directory


def _cfg(model: Path, *sets: str) -> Config:
    return load_config(None, ["run.backend=local", f"model.path={model}", "train.device=cuda:0", "rollout.device=cuda:0", *sets])


def test_the_shape_comes_from_the_config_on_the_meta_device(qwen7b: Path) -> None:
    shape = model_shape(qwen7b)
    assert shape is not None
    assert 7.5e9 < shape.params < 7.7e9  # Qwen2.5-7B: 7.62 B
    assert shape.kv_per_token == 2 * 28 * 4 * 128


def test_a_7b_run_that_cannot_fit_exits_2_naming_the_keys_before_loading(monkeypatch: pytest.MonkeyPatch, qwen7b: Path) -> None:
    pretend_cuda(monkeypatch, count=1, total_gib=141)
    cfg = _cfg(qwen7b, "model.dtype=auto", "rollout.num_samplers=2")
    with pytest.raises(ConfigError) as info:  # the build itself: no weights there to load, so it must stop first
        compute(cfg, threading.Event())
    message = str(info.value)
    assert "\n" not in message and message.startswith("GPU memory: cuda:0 (141.0 GiB)")
    for key in ("model.dtype", "rollout.num_samplers", "train.gradient_checkpointing", "rollout.gpu_memory_utilization"):
        assert key in message
    for copy in ("trainer parameters", "gradients", "optimizer moments", "snapshot", "sampler 0", "sampler 1", "evaluation engine"):
        assert copy in message


def test_a_05b_run_fits_and_every_copy_is_counted(monkeypatch: pytest.MonkeyPatch, qwen05b: Path) -> None:
    pretend_cuda(monkeypatch, count=1, total_gib=141)
    cfg = _cfg(qwen05b, "model.dtype=auto", "rollout.num_samplers=2", "algorithm.kl_beta=0.01")
    plan = gpu_preflight(cfg, torch.device("cuda", 0), torch.device("cuda", 0))
    assert plan is not None
    uses = {u.what: u.nbytes for u in plan.uses}
    p = 494_032_768
    assert uses["trainer parameters"] == uses["gradients"] == 4 * p  # fp32 master weights
    assert uses["optimizer moments"] == 8 * p
    assert uses["KL reference"] == 2 * p  # bf16 compute copy
    assert uses["sampler 0"] > 2 * p and uses["sampler 1"] == uses["sampler 0"]
    assert set(uses) >= {"snapshot", "activations", "evaluation engine"}


def test_the_keys_change_the_estimate(qwen05b: Path) -> None:
    shape = model_shape(qwen05b)
    assert shape is not None
    memory = {0: (141 * GiB, 141 * GiB)}

    def need(*sets: str) -> int:
        cfg = _cfg(qwen05b, *sets)
        where = Placement(trainer=0, samplers=[0] * cfg.rollout.num_samplers, evaluation=0)
        return sum(u.nbytes for u in plan_gpu_memory(cfg, shape, where, memory, cuda_bf16=True, max_model_len=4096).uses)

    assert need("model.dtype=bfloat16") < need("model.dtype=float32")
    assert precision_bytes("bfloat16-pure", True) == (2, 2) and precision_bytes("bfloat16", True) == (4, 2)
    assert precision_bytes("auto", True) == (4, 2) and precision_bytes("auto", False) == (4, 4)
    assert need("rollout.num_samplers=1") < need("rollout.num_samplers=3")
    big = ("train.row_tokens=4096", "train.rows_per_microbatch=8")
    on, off = _cfg(qwen05b, *big, "train.gradient_checkpointing=true"), _cfg(qwen05b, *big)
    assert activation_bytes(on, shape, 2) < activation_bytes(off, shape, 2) - 30 * GiB  # the layers kept, not the logits


def test_the_cpu_has_no_gpu_plan(qwen7b: Path) -> None:
    cpu = torch.device("cpu")
    assert gpu_preflight(load_config(None, ["run.backend=local", f"model.path={qwen7b}"]), cpu, cpu) is None
