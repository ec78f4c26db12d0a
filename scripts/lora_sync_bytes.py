"""Bytes per weight-sync version, full weights against LoRA adapters (train.lora), on the shipped
tiny model and a random ~50 M-parameter Qwen2 (built here, no download): what the trainer's
`export_weights` hands the samplers per version, and the time to export it and merge it into a
sampler's copy (ms, one CPU process).

    PYTHONPATH=src python scripts/lora_sync_bytes.py [--json]
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings

import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.bench.suite import _bench_model  # the weight-sync benchmark's models
from relayrl.config.schema import LoraConfig
from relayrl.models.lora import AdapterMerger, payload_bytes, wrap


def _ms(fn: object, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(name: str) -> list[dict[str, object]]:
    settings = TrainerSettings(learning_rate=1e-3, total_steps=1, loss=LossConfig())
    model = _bench_model(name)
    params = sum(p.numel() for p in model.parameters())
    rows: list[dict[str, object]] = []
    full = TrainerCompute(copy.deepcopy(model), settings)
    payload = full.export().payload
    assert isinstance(payload, dict)
    rows.append({"model": name, "params": params, "sync": "full", "bytes": payload_bytes(payload), "export_ms": _ms(full.export)})
    for r in (8, 16):
        trainer = TrainerCompute(wrap(copy.deepcopy(model), LoraConfig(r=r, alpha=2.0 * r), seed=0), settings)
        adapters = trainer.export().payload
        assert isinstance(adapters, dict)
        merger = AdapterMerger(copy.deepcopy(model))
        rows.append(
            {
                "model": name,
                "params": params,
                "sync": f"lora r={r}",
                "bytes": payload_bytes(adapters),
                "export_ms": _ms(trainer.export),
                "merge_ms": _ms(lambda a=adapters, m=merger: m.merge(a, "bench")),
            }
        )
    return rows


def main() -> None:
    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    rows = [row for name in ("tiny", "qwen2-50m") for row in measure(name)]
    if "--json" in sys.argv:
        print(json.dumps(rows))
        return
    for row in rows:
        full = float(next(r["bytes"] for r in rows if r["model"] == row["model"] and r["sync"] == "full"))  # type: ignore[arg-type]
        size, params = float(row["bytes"]), float(row["params"])  # type: ignore[arg-type]
        merge = f", merge {row['merge_ms']:.1f} ms" if "merge_ms" in row else ""
        print(
            f"{row['model']:>10} ({params / 1e6:.1f} M params)  {row['sync']:<10} {size / 2**20:8.3f} MiB/version "
            f"({size / full:7.2%} of full)  export {row['export_ms']:.1f} ms{merge}"
        )


if __name__ == "__main__":
    main()
