"""Several Ray nodes on one machine (`ray.cluster_utils.Cluster`): a head without CPUs and two
worker nodes, each with one CPU, one `sampler` slot and its own marker resource; a sim run whose
two sampler replicas ask for one `sampler` slot each lands one replica on each node, completes,
balances its ledger and passes the trace checker; replicas that could share a node are spread."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from relayrl.analysis.checker import check_run_dir  # noqa: E402
from relayrl.backends.ray.actors import RaySampler  # noqa: E402
from relayrl.backends.ray.cluster import RAY_ENV  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from support.simutil import run_checked, settled_groups, sim_config  # noqa: E402

STORE = 100 * 1024 * 1024  # bytes of object store per node


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    temp_dir = tempfile.mkdtemp(prefix="rr-ray-")  # short: Ray's socket paths have a length limit
    head = {"num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False, "temp_dir": temp_dir}
    with pytest.MonkeyPatch.context() as env:
        # Cluster writes the head's address to <RAY_TMPDIR>/ray/ray_current_cluster (by default
        # /tmp/ray/..., which it does not create): keep it in this cluster's own temp dir, so the
        # test neither needs nor touches what other Ray runs left on the machine
        env.setenv("RAY_TMPDIR", temp_dir)
        os.mkdir(os.path.join(temp_dir, "ray"))
        c = Cluster(initialize_head=False)
        try:
            c.add_node(**head)  # inside the try: a head that started is shut down if the rest fails
            for name in ("node_a", "node_b"):
                c.add_node(num_cpus=1, object_store_memory=STORE, resources={name: 1, "sampler": 1}, temp_dir=temp_dir)
            c.wait_for_nodes()
            ray.init(address=c.address, namespace="relayrl", log_to_driver=False)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()  # removes the address file under RAY_TMPDIR: still set here
            shutil.rmtree(temp_dir, ignore_errors=True)


def _node_of(actor: Any) -> str:
    """The marker resource (node_a / node_b) of the node the actor runs on."""
    from ray._private import state

    node_id = state.actors(actor_id=actor._actor_id.hex())["Address"]["NodeID"]
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            markers = [r for r in node["Resources"] if r.startswith("node_")]
            return markers[0] if markers else "head"
    raise AssertionError(f"actor on unknown node {node_id}")


@pytest.mark.slow
def test_sampler_replicas_on_two_nodes_complete_a_balanced_checked_run(cluster: Any, tmp_path: Path) -> None:
    cfg = sim_config(
        "ray.enabled=true",
        f"ray.address={cluster.address}",
        "rollout.num_samplers=2",
        "ray.sampler_resources={sampler=1}",  # one slot per node: the two replicas cannot share a node
        "sim.generate_per_request=0.005",
    )
    program = build_program(cfg, run_dir=tmp_path / "run")
    samplers = list(program.backend.samplers)
    assert all(isinstance(s, RaySampler) for s in samplers)
    nodes = sorted(_node_of(s.actor) for s in samplers)  # type: ignore[attr-defined]
    assert nodes == ["node_a", "node_b"]
    result = run_checked(program)
    ledger = result.ledger.as_dict()
    assert ledger["groups_trained"] == cfg.run.steps * cfg.rollout.groups_per_step
    assert settled_groups(ledger) == ledger["groups_dispatched"]
    assert check_run_dir(tmp_path / "run").ok
    assert ray.is_initialized()  # the run joined the cluster and left it running


def test_sampler_replicas_that_fit_on_one_node_are_spread_over_both(cluster: Any) -> None:
    # a tenth of a CPU each: both fit on one node, and Ray's default policy would pack them there
    cfg = sim_config("ray.enabled=true", f"ray.address={cluster.address}", "rollout.num_samplers=2", "ray.sampler_resources={CPU=0.1}")
    program = build_program(cfg, run_dir=None)
    try:
        assert sorted(_node_of(s.actor) for s in program.backend.samplers) == ["node_a", "node_b"]  # type: ignore[attr-defined]
    finally:
        asyncio.run(program.backend.close())
