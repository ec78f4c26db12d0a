"""The GPU check's sections (issue 30), run by `scripts/gpu_check.sh` as
`python -m relayrl.bench.gpu_check --out-dir DIR`: each section in a process of its own under its
own time bound, the next one starting whatever the last one did, the whole within a budget (8
minutes on one H200 by default), and `DIR/gpu_check.json` (versions, device, and each section's
status, seconds and figures) written beside the printed table after every section.

Sections: `environment` (driver, torch and its CUDA, free GPU memory, /dev/shm, bf16); the
default recipe on CUDA in float32 (`recipe-fp32`) and bfloat16 (`recipe-bf16`): held-out gain,
samples/s, trainer busy, peak GPU memory; a LoRA run (`lora`); `bench-trainer` (`relayrl bench
trainer --device cuda`); `qwen2-0.5b`: a randomly initialised Qwen2 of Qwen2.5-0.5B's shape,
built on the `meta` device and materialised on the GPU (nothing downloaded), timing relayrl's
trainer step (TrainerCompute), decode loop (`generation.sample`) and weight export; `vllm`: the
default recipe with `rollout.engine=vllm`, only where `import vllm` works. Without a usable CUDA
device the check stops after `environment`, saying so in one line (gpu_check.json still written).

This module imports only the standard library at the top: the driver runs before anything is
known about the Python it runs in; the sections import what they need.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from relayrl.bench.qwen2 import QWEN2_05B, build_random_qwen2  # (the standard library only, at its top)

__all__ = ["SECTIONS", "Section", "main", "nvidia_smi", "run_check"]

#: The whole check's budget (s): every section's bound is cut to what is left of it.
DEFAULT_BUDGET_S = 460.0
#: A section that would get less than this is skipped ("out of time").
MIN_SECTION_S = 15.0

QWEN2_TINY: dict[str, Any] = {**QWEN2_05B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
QWEN2_TINY.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    limit_s: float  # its own time bound
    needs_gpu: bool
    what: str


SECTIONS: tuple[Section, ...] = (
    Section("environment", 60, False, "driver, torch, CUDA, free GPU memory, /dev/shm, bf16"),
    Section("recipe-fp32", 100, True, "the default recipe on cuda, model.dtype=float32"),
    Section("recipe-bf16", 100, True, "the default recipe on cuda, model.dtype=bfloat16"),
    Section("lora", 70, True, "the default recipe on cuda with train.lora.r=8 (100 steps)"),
    Section("bench-trainer", 60, True, "relayrl bench trainer --device cuda"),
    Section("qwen2-0.5b", 90, True, "random Qwen2.5-0.5B-shaped model: trainer step, decode loop, weight export"),
    Section("vllm", 120, True, "the default recipe with rollout.engine=vllm (only where vllm imports)"),
)

#: The 0.5B section's trainer steps: (figures key, model.dtype, train.gradient_checkpointing)
TRAIN_CASES: tuple[tuple[str, str, bool], ...] = (
    ("train", "float32", False),
    ("train_bf16", "bfloat16", False),
    ("train_bf16_checkpointing", "bfloat16", True),
)

RECIPE_SETTINGS: dict[str, list[str]] = {
    "recipe-fp32": ["model.dtype=float32"],
    "recipe-bf16": ["model.dtype=bfloat16"],
    "lora": ["model.dtype=float32", "train.lora.r=8", "train.learning_rate=2e-3", "run.steps=100", "eval.every_steps=50"],
    "vllm": ["model.dtype=float32", "rollout.engine=vllm", "run.steps=100", "eval.every_steps=50"],
}


def say(message: str) -> None:
    print(f"gpu_check: {message}", flush=True)


# -- nvidia-smi --------------------------------------------------------------------------------


def nvidia_smi() -> dict[str, Any]:
    """What `nvidia-smi` says (driver, the CUDA version the driver supports, the GPUs), or
    {"error": ...} where it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found"}
    try:
        header = subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
        listing = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"nvidia-smi failed: {exc}"}
    driver = re.search(r"Driver Version:\s*([0-9.]+)", header)
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", header)
    return {
        "driver_version": driver.group(1) if driver else None,
        "driver_cuda_version": cuda.group(1) if cuda else None,
        "gpus": [line.strip() for line in listing.splitlines() if line.strip().startswith("GPU ")],
    }


# -- the sections (each runs in its own process: `--section NAME --result FILE`) ----------------


def section_environment(out_dir: Path, tiny: bool) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "nvidia_smi": nvidia_smi(),
    }
    with contextlib.suppress(OSError):
        shm = shutil.disk_usage("/dev/shm")
        figures["dev_shm_bytes"], figures["dev_shm_free_bytes"] = shm.total, shm.free
    versions: dict[str, str | None] = {}
    import importlib.metadata

    for dist in ("torch", "transformers", "tokenizers", "safetensors", "peft", "pydantic", "vllm", "ray", "fastapi"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    figures["versions"] = versions
    import relayrl

    figures["relayrl"] = {"version": relayrl.__version__, "path": str(Path(relayrl.__file__).parent)}
    try:  # after the figures above: they are reported even where torch cannot import
        import torch
    except Exception as exc:
        figures["torch_error"] = f"{type(exc).__name__}: {_first_line(str(exc))}"
        figures["cuda_available"] = False
        return figures
    figures["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    available = bool(torch.cuda.is_available())
    figures["cuda_available"] = available
    devices = []
    if available:
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            props = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "index": i,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "total_bytes": total,
                    "free_bytes": free,
                    "multiprocessors": props.multi_processor_count,
                }
            )
        figures["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
    figures["devices"] = devices
    return figures


def _peak_gpu_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return max(int(torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count()))


def recipe_args(name: str, out_dir: Path, device: str = "cuda") -> list[str]:
    """`relayrl train` arguments of a recipe section (the default recipe plus its settings)."""
    settings = [f"run.name={name}", f"run.output_dir={out_dir}", f"train.device={device}", f"rollout.device={device}"]
    settings += RECIPE_SETTINGS[name]
    return ["train", *(a for s in settings for a in ("--set", s))]


def section_recipe(name: str, out_dir: Path, tiny: bool) -> dict[str, Any]:
    """The recipe in this process (so its peak GPU memory can be read after it), then its
    summary's figures (`recipe_figures`, which the driver also reads after a timeout)."""
    if name == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise _Skip("vllm is not installed in this Python")
        try:
            import vllm  # noqa: F401
        except Exception as exc:  # a broken install: its own error in one line
            raise _Skip(f"`import vllm` fails: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    args = recipe_args(name, out_dir, "cpu" if tiny else "cuda")
    if tiny:  # the CPU test of this code path
        args += ["--set", "run.steps=2", "--set", "task.heldout_size=8", "--set", "eval.every_steps=0"]
    from relayrl.cli.main import app

    code = 0
    try:
        app(args, standalone_mode=False)
    except SystemExit as exc:
        code = int(exc.code or 0) if isinstance(exc.code, int) or exc.code is None else 1
    figures = recipe_figures(out_dir / name)
    peak = _peak_gpu_bytes()
    if figures.get("peak_gpu_memory_bytes") is None:
        figures["peak_gpu_memory_bytes"] = peak
        figures["peak_gpu_memory_source"] = "torch.cuda.max_memory_allocated (this process)" if peak is not None else "not recorded"
    if code:
        raise _Failed(f"relayrl train exited {code}", figures)
    return figures


_GPU_MEMORY_KEY = re.compile(r"(gpu|cuda).*mem|mem.*(gpu|cuda)", re.IGNORECASE)


def recipe_figures(run_dir: Path) -> dict[str, Any]:
    """Held-out gain, samples/s, trainer busy and peak GPU memory from a run directory's
    summary.json and metrics.jsonl (whatever of them exists: a run cut short has fewer)."""
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        before, after = s.get("accuracy_before"), s.get("accuracy_after")
        out.update(
            status=s.get("status"),
            steps=s.get("steps_completed"),
            wall_time_s=s.get("wall_time_s"),
            heldout_before=before,
            heldout_after=after,
            heldout_gain=(after - before) if before is not None and after is not None else None,
            samples_per_s=s.get("samples_per_s"),
            trainer_busy=s.get("trainer_busy_fraction"),
        )
        for key, value in s.items():
            if _GPU_MEMORY_KEY.search(key) and isinstance(value, int | float):
                out["peak_gpu_memory_bytes"], out["peak_gpu_memory_source"] = value, f"summary.json {key}"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and "peak_gpu_memory_bytes" not in out:
        peak: tuple[float, str] | None = None
        steps = 0
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                steps += 1
                for key, value in row.items():
                    if _GPU_MEMORY_KEY.search(key) and isinstance(value, int | float) and (peak is None or value > peak[0]):
                        peak = (value, key)
        out.setdefault("steps", steps)
        if peak is not None:
            out["peak_gpu_memory_bytes"], out["peak_gpu_memory_source"] = peak[0], f"metrics.jsonl {peak[1]}"
    return out


def section_bench_trainer(out_dir: Path, tiny: bool) -> dict[str, Any]:
    import torch

    from relayrl.bench.trainer import run_trainer

    sizes = [1, 2] if torch.cuda.device_count() >= 2 else [1]
    figures = run_trainer(sizes, model="tiny" if tiny else "50m", steps=2 if tiny else 4, device="cpu" if tiny else "cuda")
    return {
        "params": figures["params"],
        "configs": [
            {"world_size": c["world_size"], "tokens_per_s": c["tokens_per_s"], "startup_s": c["startup_s"]}
            for c in figures["configs"]  # type: ignore[attr-defined]
        ],
    }


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def section_qwen2(out_dir: Path, tiny: bool) -> dict[str, Any]:
    import torch

    from relayrl.algorithms.losses import LossConfig
    from relayrl.backends.local.generation import SamplingParams, sample
    from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
    from relayrl.bench.trainer import _steps
    from relayrl.models.checkpointing import enable_gradient_checkpointing

    device = "cpu" if tiny else "cuda"
    dims = QWEN2_TINY if tiny else QWEN2_05B
    cuda = device == "cuda"
    start = time.perf_counter()
    model = build_random_qwen2(dims, device)
    _sync(device)
    params = sum(p.numel() for p in model.parameters())
    figures: dict[str, Any] = {"shape": "tiny (CPU test)" if tiny else "Qwen2.5-0.5B", "params": params}
    figures["build_s"] = time.perf_counter() - start
    # the trainer step: relayrl's TrainerCompute (float32 AdamW) on packed micro-batches, in float32,
    # in "bfloat16" (bfloat16 compute on float32 masters: what "auto" picks on a bf16 GPU) and in
    # "bfloat16" with train.gradient_checkpointing (its peak memory against the plain one's)
    steps, microbatches, row_tokens = (2, 2, 64) if tiny else (3, 4, 2048)
    batches = _steps(dims["vocab_size"], steps, microbatches, row_tokens)
    for key, precision, checkpointing in TRAIN_CASES:
        if checkpointing:
            enable_gradient_checkpointing(model)
        compute = TrainerCompute(model, TrainerSettings(learning_rate=1e-5, total_steps=steps, loss=LossConfig(), precision=precision))
        figures[key] = {**_train_figures(compute, batches, device), "dtype": precision, "gradient_checkpointing": checkpointing}
        figures[key].update(microbatches=microbatches, row_tokens=row_tokens)
    # the weight export: what every committed version costs
    # the weight export: what every committed version costs
    _sync(device)
    t0 = time.perf_counter()
    weights = compute.export()
    _sync(device)
    export_ms = (time.perf_counter() - t0) * 1e3
    payload = cast(dict[str, Any], weights.payload)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in payload.values()}
    figures["export"] = {
        "ms": export_ms,
        "bytes": sum(storages.values()),
        "param_bytes": sum(p.numel() * p.element_size() for p in compute.model.parameters()),  # each parameter once
        "tensors": len(payload),
        "storages": len(storages),
    }
    del weights, compute
    # the decode loop: relayrl's own sampler loop on a bf16 copy where the GPU supports it
    decode_dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    model = model.to(decode_dtype).eval()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    prompts_n, samples, prompt_len, new = (4, 2, 8, 8) if tiny else (32, 8, 64, 128)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, dims["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in range(prompts_n)]
    params_ = SamplingParams(temperature=1.0, max_new_tokens=new, eos_token_ids=(1,))
    with torch.no_grad():
        sample(model, prompts[:2], 2, SamplingParams(max_new_tokens=4, eos_token_ids=(1,)), torch.Generator().manual_seed(1))
        _sync(device)
        t0 = time.perf_counter()
        groups = sample(model, prompts, samples, params_, torch.Generator().manual_seed(2))
        _sync(device)
    seconds = time.perf_counter() - t0
    produced = sum(len(s.tokens) for g in groups for s in g)
    figures["decode"] = {
        "tokens_per_s": produced / seconds if seconds else None,
        "sequences": prompts_n * samples,
        "prompt_tokens": prompt_len,
        "max_new_tokens": new,
        "tokens": produced,
        "dtype": str(decode_dtype).removeprefix("torch."),
        "peak_gpu_memory_bytes": _peak_gpu_bytes() if cuda else None,
    }
    return figures


def _train_figures(compute: Any, batches: Sequence[Sequence[Any]], device: str) -> dict[str, Any]:
    """Train `batches` (steps of micro-batches) on `compute`; the first step warms up. Tokens/s
    over the others and the peak GPU memory of all of them."""
    import torch

    cuda = device == "cuda"
    if cuda:
        gc.collect()  # (the previous case's trainer and optimizer state)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    timed, tokens = 0.0, 0
    for k, step in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        for tb in step:
            compute.train_step(tb)
        compute.optim_step()  # (includes the snapshot `export` a step commits)
        _sync(device)
        if k > 0:
            timed += time.perf_counter() - t0
            tokens += sum(tb.num_tokens for tb in step)
    return {
        "tokens_per_s": tokens / timed if timed else None,
        "steps_timed": len(batches) - 1,
        "peak_gpu_memory_bytes": _peak_gpu_bytes() if cuda else None,
    }


class _Skip(Exception):
    """The section does not apply here (e.g. vllm not installed): skipped, saying why."""


class _Failed(Exception):
    """The section failed with these figures so far."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


RUNNERS: dict[str, Callable[[Path, bool], dict[str, Any]]] = {
    "environment": section_environment,
    "recipe-fp32": lambda out, tiny: section_recipe("recipe-fp32", out, tiny),
    "recipe-bf16": lambda out, tiny: section_recipe("recipe-bf16", out, tiny),
    "lora": lambda out, tiny: section_recipe("lora", out, tiny),
    "bench-trainer": section_bench_trainer,
    "qwen2-0.5b": section_qwen2,
    "vllm": lambda out, tiny: section_recipe("vllm", out, tiny),
}


def run_section(name: str, out_dir: Path, result: Path, tiny: bool = False) -> int:
    """One section in this process; its outcome ({"status", "figures", "error"}) to `result`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        outcome: dict[str, Any] = {"status": "ok", "figures": RUNNERS[name](out_dir, tiny)}
    except _Skip as exc:
        outcome = {"status": "skipped", "figures": {}, "error": str(exc)}
    except _Failed as exc:
        outcome = {"status": "failed", "figures": exc.figures, "error": str(exc)}
    except BaseException as exc:  # any failure is this section's: reported, and the next one runs
        import traceback

        traceback.print_exc()
        outcome = {"status": "failed", "figures": {}, "error": f"{type(exc).__name__}: {_first_line(str(exc))}"}
    result.write_text(json.dumps(outcome, default=str))
    return 0 if outcome["status"] != "failed" else 1


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


# -- the driver ---------------------------------------------------------------------------------


def _run_bounded(name: str, out_dir: Path, limit_s: float, tiny: bool) -> dict[str, Any]:
    """Run a section in its own process group under `limit_s`; its outcome with `seconds`."""
    result = out_dir / f"{name}.result.json"
    result.unlink(missing_ok=True)
    if name in RECIPE_SETTINGS:  # a run directory of an earlier check must not lend its figures to this one
        shutil.rmtree(out_dir / name, ignore_errors=True)
    log = out_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "relayrl.bench.gpu_check", "--section", name, "--out-dir", str(out_dir), "--result", str(result)]
    if tiny:
        cmd.append("--tiny")
    start = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - start
    outcome: dict[str, Any]
    if result.is_file():
        outcome = json.loads(result.read_text())
    elif timed_out:
        figures = recipe_figures(out_dir / name) if name in RECIPE_SETTINGS else {}
        outcome = {"status": "timeout", "figures": figures, "error": f"ran past its bound of {limit_s:.0f} s (figures so far kept)"}
    else:
        tail = _first_line("\n".join(log.read_text(errors="replace").splitlines()[-1:]))
        outcome = {"status": "failed", "figures": {}, "error": f"exited {proc.returncode} without a result: {tail}"}
    outcome.update(name=name, seconds=round(seconds, 2), limit_s=limit_s, log=str(log))
    return outcome


def _cell(figures: dict[str, Any], name: str) -> str:
    """The table's figures column for a section."""

    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, int | float) else "n/a"

    def mib(v: Any) -> str:
        return f"{v / 2**20:,.0f} MiB" if isinstance(v, int | float) else "not recorded"

    if name == "environment":
        devs = figures.get("devices") or []
        dev = f"{len(devs)}x {devs[0]['name']}, {devs[0]['free_bytes'] / 2**30:.0f} GiB free" if devs else "no CUDA device"
        torch_ = figures.get("torch") or {}
        shm = figures.get("dev_shm_bytes")
        driver = (figures.get("nvidia_smi") or {}).get("driver_version")
        return (
            f"torch {torch_.get('version', 'n/a')} (CUDA {torch_.get('cuda')}), driver {driver}, "
            f"{dev}, bf16 {figures.get('bf16_supported', 'n/a')}, /dev/shm {mib(shm)}"
        )
    if name in RECIPE_SETTINGS:
        return (
            f"held-out {num(figures.get('heldout_before'), '.2f')} -> {num(figures.get('heldout_after'), '.2f')} "
            f"(gain {num(figures.get('heldout_gain'), '+.2f')}), {num(figures.get('samples_per_s'), '.0f')} samples/s, "
            f"trainer busy {num(figures.get('trainer_busy'), '.1%')}, peak GPU {mib(figures.get('peak_gpu_memory_bytes'))}"
        )
    if name == "bench-trainer":
        return ", ".join(f"world {c['world_size']}: {c['tokens_per_s']:,.0f} tokens/s" for c in figures.get("configs", []))
    if name == "qwen2-0.5b":
        d, e = figures.get("decode") or {}, figures.get("export") or {}
        train = "; ".join(
            f"{key.removeprefix('train').strip('_').replace('_', '+') or 'fp32'} {num(t.get('tokens_per_s'), ',.0f')} tokens/s "
            f"(peak {mib(t.get('peak_gpu_memory_bytes'))})"
            for key, *_ in TRAIN_CASES
            if (t := figures.get(key))
        )
        return (
            f"{num(figures.get('params'), ',')} params; train {train}, "
            f"decode {num(d.get('tokens_per_s'), ',.0f')} tokens/s ({d.get('dtype', 'n/a')}), "
            f"export {num(e.get('ms'), '.0f')} ms / {mib(e.get('bytes'))} (parameters {mib(e.get('param_bytes'))})"
        )
    return ""


def print_table(report: dict[str, Any]) -> None:
    print(f"{'section':<14} {'status':<8} {'s':>6}  figures")
    for s in report["sections"]:
        text = _cell(s.get("figures") or {}, s["name"]) if s["status"] in ("ok", "failed", "timeout") else ""
        if s.get("error"):
            text = f"{text}; {s['error']}" if text else s["error"]
        print(f"{s['name']:<14} {s['status']:<8} {s['seconds']:>6.1f}  {text}")


def _write(out_dir: Path, report: dict[str, Any]) -> None:
    path = out_dir / "gpu_check.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(path)


def run_check(out_dir: Path, *, budget_s: float, only: Sequence[str] | None, mode: str, stop_reason: str | None, tiny: bool) -> int:
    """Run the sections in order; 0 when every section that ran is ok or skipped, 1 otherwise
    (or when the check stopped for want of a GPU)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    report: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": mode,
        "budget_s": budget_s,
        "versions": {},
        "device": {},
        "sections": [],
        "stopped": None,
    }
    failed = False
    for section in SECTIONS:
        if only and section.name not in only and section.name != "environment":
            continue
        if report["stopped"] is not None:
            break
        left = deadline - time.monotonic()
        outcome: dict[str, Any]
        if left < MIN_SECTION_S:
            outcome = {"name": section.name, "status": "skipped", "seconds": 0.0, "limit_s": 0, "figures": {}}
            outcome["error"] = f"out of time (the check's budget of {budget_s:.0f} s is spent)"
        else:
            say(f"{section.name}: {section.what} (bound {min(section.limit_s, left):.0f} s)")
            outcome = _run_bounded(section.name, out_dir, min(section.limit_s, left), tiny)
        report["sections"].append(outcome)
        failed |= outcome["status"] in ("failed", "timeout")
        if section.name == "environment":
            figures = outcome.get("figures") or {}
            torch_ = figures.get("torch") or {}
            report["versions"] = {
                "python": figures.get("python"),
                "relayrl": (figures.get("relayrl") or {}).get("version"),
                "torch": torch_.get("version"),
                "torch_cuda": torch_.get("cuda"),
                **{k: v for k, v in (figures.get("versions") or {}).items() if k != "torch"},
            }
            report["device"] = {
                "nvidia_smi": figures.get("nvidia_smi"),
                "devices": figures.get("devices"),
                "bf16_supported": figures.get("bf16_supported"),
                "dev_shm_bytes": figures.get("dev_shm_bytes"),
            }
            if stop_reason is None and not tiny and not figures.get("cuda_available"):
                if outcome["status"] != "ok" or figures.get("torch_error"):
                    why = f"torch cannot import: {figures.get('torch_error') or outcome.get('error')}"
                else:
                    why = "torch.cuda.is_available() is False"
                stop_reason = f"no usable CUDA GPU ({why}): the remaining sections need a real GPU"
            if stop_reason is not None:
                report["stopped"] = stop_reason
        _write(out_dir, report)
    report["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    _write(out_dir, report)
    print_table(report)
    say(f"wrote {out_dir / 'gpu_check.json'}")
    if report["stopped"] is not None:
        say(f"stopped: {report['stopped']}")
        return 1
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relayrl.bench.gpu_check", description="The GPU check's sections (issue 30).")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/gpu_check"))
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("RELAYRL_GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S)))
    parser.add_argument("--only", action="append", default=None, help="run only these sections (environment always runs)")
    parser.add_argument("--mode", default="index", help="how the environment was installed (index / offline), for the report")
    parser.add_argument("--stopped", default=None, help="stop after the environment section for this reason")
    parser.add_argument("--section", default=None, choices=[s.name for s in SECTIONS], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the sections' CPU test: tiny shapes on cpu
    args = parser.parse_args(argv)
    if args.section is not None:
        return run_section(args.section, args.out_dir, args.result or args.out_dir / f"{args.section}.result.json", args.tiny)
    return run_check(args.out_dir, budget_s=args.budget_s, only=args.only, mode=args.mode, stop_reason=args.stopped, tiny=args.tiny)


if __name__ == "__main__":
    sys.exit(main())
