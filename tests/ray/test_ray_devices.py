"""On Ray a worker whose device is CUDA asks the cluster for a GPU: on a cluster without one
(this machine's), `relayrl train --ray` with train.device or rollout.device = "cuda" exits 2 in
one line naming the device key and what the cluster has, before any actor waits."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from relayrl.backends.ray.cluster import RayCluster  # noqa: E402
from support.cli import relayrl  # noqa: E402
from support.rayutil import local_cluster  # noqa: E402

cluster = pytest.fixture(scope="module")(local_cluster)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (
            "train.device=cuda",
            "error: ray.trainer_resources (with train.device = 'cuda')={GPU=1}: the trainer actor asks for GPU=1 "
            "but the Ray cluster has no GPU (it has {CPU=2})",
        ),
        (
            "rollout.device=cuda:1",
            "error: ray.sampler_resources (with rollout.device = 'cuda:1')={GPU=1}: each sampler actor asks for GPU=1 "
            "but the Ray cluster has no GPU (it has {CPU=2})",
        ),
    ],
)
def test_a_cuda_device_on_a_cluster_without_gpus_is_refused_in_one_line(
    cluster: RayCluster, tmp_path: Path, setting: str, expected: str
) -> None:
    args = ["train", "--ray", "--set", f"ray.address={cluster.address}", "--set", f"run.output_dir={tmp_path}", "--set", setting]
    res = relayrl(*args, cwd=tmp_path, env={"COLUMNS": "300"}, timeout=180)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [expected]


def test_auto_asks_for_no_gpu_on_a_cluster_without_one(cluster: RayCluster) -> None:
    """ "auto" on a GPU-less cluster asks for nothing more than the user's tables."""
    import ray

    from relayrl.backends.ray.build import with_gpu

    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    assert gpus == 0.0
    assert with_gpu({}, "auto", gpus) == {}
