"""rollout.interruptible on Ray: a sampler actor loads a version in its "load" concurrency group
while it runs a generate call, the generation's tokens carry both versions, and the run passes
check-trace (whose actors rule lets a load overlap a generate only in such a run)."""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from relayrl.analysis import timeline  # noqa: E402
from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402
from support.simutil import run_checked, settled_groups, sim_config  # noqa: E402

cluster = pytest.fixture(scope="module")(local_cluster)


@pytest.mark.slow
def test_sampler_actors_load_beside_a_running_generate(cluster: RayCluster, tmp_path: Path) -> None:
    sets = [
        "ray.enabled=true",
        "ray.address=auto",
        "rollout.num_samplers=2",
        "rollout.max_staleness=1",
        "rollout.interruptible=true",
        "rollout.max_new_tokens=8",
        "sim.generate_per_token=0.03",  # a generate call lasts up to 0.24 s: far longer than a step's training
        "sim.train_step=0.01",
        "run.steps=5",
    ]
    cfg = sim_config(*sets)
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=120.0)
    ledger = result.ledger.as_dict()
    assert settled_groups(ledger) == ledger["groups_dispatched"]
    all_spans = timeline.spans(result.tracer.events)
    beside = 0
    for replica in range(2):
        lane = [s for s in all_spans if s.lane == f"actor:sampler/{replica}"]
        loads = [s for s in lane if s.name == "load_weights"]
        generates = [s for s in lane if s.name == "generate"]
        beside += sum(1 for ld in loads if any(g.start < ld.start and ld.end < g.end for g in generates))
    assert beside, "no sampler actor loaded weights inside a running generate"
    interrupted = [s for s in all_spans if s.name == "generate" and s.lane.startswith("sampler/") and "versions" in s.args]
    assert interrupted and all(s.args["version"] == s.args["versions"][0] for s in interrupted)  # type: ignore[index]
