"""`relayrl bench engines` on the tiny model only, one short repeat: both engines report figures."""

from __future__ import annotations

import pytest

import support.vllmenv  # noqa: F401  (sets the environment vLLM reads at its import)
from relayrl.bench.engines import run_engines

pytestmark = pytest.mark.slow


def test_bench_engines_reports_both_engines_side_by_side() -> None:
    figures = run_engines(models=("tiny",), repeats=1, versions=1)
    tiny = figures["tiny"]
    assert isinstance(tiny, dict) and tiny["load"] == [64, 16, 4]
    for engine in ("hf", "vllm"):
        f = tiny[engine]
        assert f["tokens_per_s"] > 0 and f["weight_load_s"] > 0 and f["startup_s"] > 0, (engine, f)


def test_bench_weights_vllm_puts_the_engines_file_and_collective_transports_side_by_side() -> None:
    """`relayrl bench weights --vllm` on the tiny model: real engines, each version by file and
    through vLLM's weight-transfer API (a collective round that fell back to the file fails it),
    both staging bytes in host memory on the CPU: the file written and read back per replica (about
    two copies each), the collective's bucket packed once and received once per engine."""
    from relayrl.bench.weights import run_weights

    figures = run_weights(["tiny"], replicas=2, versions=1, dtype="float32", ray=False, sharded=False, vllm=True)
    transports = figures["models"]["tiny"]["transports"]  # type: ignore[index]
    assert {"direct", "file", "vllm_file", "vllm_collective"} <= set(transports)
    file, collective = transports["vllm_file"], transports["vllm_collective"]
    assert file["seconds_per_version"] > 0 and collective["seconds_per_version"] > 0
    assert file["host_copies"] == pytest.approx(4.0, abs=0.5)  # 2 replicas x (written + read)
    assert collective["host_copies"] == pytest.approx(3.0, abs=0.5)  # packed once + received by 2 engines


def test_bench_weights_vllm_on_ray_receives_the_collective_in_the_engine_and_stages_less() -> None:
    """`relayrl bench weights --vllm` with Ray, one replica on the tiny model: the vLLM engine in a
    Ray sampler actor, each version through the object store, by the collective received in the
    actor and loaded by file (the path before the engine received it), and by the collective
    received in the engine's worker (a round received elsewhere fails the benchmark). Host
    copies tell the paths apart: the object store's put, then the file written and read (3); the
    bucket packed, received in the actor, written and read (4); packed and received in the engine (2)."""
    from relayrl.bench.weights import run_weights

    figures = run_weights(["tiny"], replicas=1, versions=1, dtype="float32", ray=True, sharded=False, vllm=True)
    transports = figures["models"]["tiny"]["transports"]  # type: ignore[index]
    rows = {name: transports[name] for name in ("vllm_ray_object_store", "vllm_ray_collective_actor", "vllm_ray_collective")}
    assert all(row["seconds_per_version"] > 0 for row in rows.values()), rows
    assert rows["vllm_ray_object_store"]["host_copies"] == pytest.approx(3.0, abs=0.5)
    assert rows["vllm_ray_collective_actor"]["host_copies"] == pytest.approx(4.0, abs=0.5)
    assert rows["vllm_ray_collective"]["host_copies"] == pytest.approx(2.0, abs=0.5)
