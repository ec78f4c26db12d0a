"""rollout.weight_transport (issue 31 §1): which transport applies where, "auto"'s choice, a
transport that does not apply refused in one line naming the key (exit 2 from the CLI), and the
collective transport's bucket layout (tied names sent once, one dtype per bucket, bounded), and
its stream from the sharded trainer's ranks (shards assembled bit for bit)."""

from __future__ import annotations

from typing import Any

import pytest

from relayrl.backends.transports import applicable, resolve
from relayrl.config.schema import ConfigError, load_config
from support.cli import relayrl


@pytest.mark.parametrize(
    ("sets", "auto", "fits"),
    [
        (["run.backend=local"], "direct", ("direct",)),
        (["run.backend=sim"], "direct", ("direct",)),
        # vLLM in one process: the collective through vLLM's weight-transfer API (auto: on a GPU of the trainer's own)
        (["run.backend=local", "rollout.engine=vllm"], "file", ("file", "collective")),
        (["run.backend=local", "ray.enabled=true"], "object_store", ("collective", "object_store")),
        # vLLM engines in Ray actors: the collective received in each engine's worker (faster than the
        # object store's file per engine, benchmarks/README.md), one trainer rank
        (["run.backend=local", "ray.enabled=true", "rollout.engine=vllm"], "collective", ("collective", "object_store")),
        (
            ["run.backend=local", "ray.enabled=true", "rollout.engine=vllm", "train.world_size=2"],
            "object_store",
            ("collective", "object_store"),
        ),
        (["run.backend=sim", "ray.enabled=true"], "object_store", ("object_store",)),
        # the sharded trainer streams its shards (when set: "auto" keeps the object store, NCCL unmeasured)
        (["run.backend=local", "ray.enabled=true", "train.world_size=2"], "object_store", ("collective", "object_store")),
        (["run.backend=local", "ray.enabled=true", "train.world_size=2", "train.lora.r=4"], "object_store", ("object_store",)),
    ],
)
def test_auto_picks_the_fastest_transport_that_applies(sets: list[str], auto: str, fits: tuple[str, ...]) -> None:
    cfg = load_config(None, sets)
    assert applicable(cfg) == fits
    assert resolve(cfg) == auto  # a trainer on the CPU
    # on a GPU no engine shares: the collective (NCCL) where it applies, one rank
    on_cuda = "collective" if "collective" in fits and cfg.train.world_size == 1 else auto
    assert resolve(cfg, trainer_on_cuda=True) == on_cuda
    for transport in fits:  # each that applies is accepted and runs as set
        assert resolve(load_config(None, [*sets, f"rollout.weight_transport={transport}"])) == transport


@pytest.mark.parametrize(
    ("sets", "transport"),
    [
        (["run.backend=local"], "collective"),
        (["run.backend=local"], "object_store"),
        (["run.backend=local"], "file"),
        (["run.backend=local", "rollout.engine=vllm"], "direct"),
        (["run.backend=local", "ray.enabled=true"], "direct"),
        (["run.backend=sim", "ray.enabled=true"], "collective"),
        (["run.backend=local", "ray.enabled=true", "train.world_size=2", "train.lora.r=4"], "collective"),
    ],
)
def test_a_transport_that_does_not_apply_is_refused_in_one_line_naming_the_key(sets: list[str], transport: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [*sets, f"rollout.weight_transport={transport}"])
    message = str(err.value)
    assert "rollout.weight_transport" in message and repr(transport) in message and "does not apply" in message
    assert "\n" not in message


def test_the_cli_refuses_an_inapplicable_transport_with_exit_2() -> None:
    res = relayrl("train", "--set", "run.backend=local", "--set", "rollout.weight_transport=collective", timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if "rollout.weight_transport" in line]
    assert len(lines) == 1 and "does not apply" in lines[0], res.stderr


@pytest.mark.torch
def test_the_collective_layout_sends_a_tied_weight_once_in_bounded_buckets_of_one_dtype() -> None:
    import torch

    from relayrl.backends.ray.collective import layout_of

    embed = torch.randn(10, 4)
    payload = {
        "embed.weight": embed,
        "a": torch.randn(3, 4),
        "norm": torch.ones(4, dtype=torch.bfloat16),
        "b": torch.randn(5),
        "lm_head.weight": embed,  # tied
    }
    layout = layout_of(payload, bucket_bytes=60 * 4)
    assert layout.aliases == {"lm_head.weight": "embed.weight"}
    assert layout.names == tuple(payload)
    assert [e.name for e in layout.entries] == ["embed.weight", "a", "b", "norm"]  # grouped by dtype, in order
    for dtype, numel in layout.buckets:
        assert numel * torch.empty((), dtype=dtype).element_size() <= 60 * 4
    assert {layout.buckets[e.bucket][0] for e in layout.entries if e.name != "norm"} == {torch.float32}
    assert layout.buckets[next(e.bucket for e in layout.entries if e.name == "norm")][0] == torch.bfloat16
    assert layout.nbytes == (40 + 12 + 5) * 4 + 4 * 2  # the unique bytes: the tied tensor once


KEYS = {"seconds_per_version", "gb_per_s", "host_copies", "bytes_per_version"}


@pytest.mark.torch
def test_bench_weights_json_has_each_transports_figures_per_model() -> None:
    import json

    res = relayrl("bench", "weights", "--models", "tiny", "--versions", "1", "--no-ray", "--no-sharded", "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    figures = json.loads(res.stdout)
    tiny = figures["models"]["tiny"]
    assert tiny["export_bytes"] == tiny["unique_param_bytes"] > 0
    assert set(tiny["transports"]) == {"direct", "file"}  # in one process (--no-ray)
    for t in tiny["transports"].values():
        assert set(t) == KEYS and t["seconds_per_version"] > 0 and t["gb_per_s"] > 0
    assert tiny["transports"]["direct"]["host_copies"] == 0.0
    assert tiny["transports"]["file"]["host_copies"] == pytest.approx(2 * figures["replicas"])  # written and read per replica
    assert "met" not in figures["target"]  # (not measured without Ray)


@pytest.mark.torch
def test_the_collective_group_delivers_bit_identical_weights_and_a_dead_member_fails_the_others_fast() -> None:
    """Three processes in one gloo group (no Ray): a round arrives bit for bit with its dtypes and
    tied names; once a receiver died, the trainer's next broadcast and the other receiver's pending
    receive both fail in seconds, not at the group's 60 s timeout (each then falls back, see
    relayrl.backends.ray.collective)."""
    import multiprocessing
    import queue as queues

    from relayrl.backends.ray.collective import free_port
    from support.collective import member

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=member, args=(rank, port, q)) for rank in range(3)]
    for p in procs:
        p.start()
    got: dict[tuple[int, str], float] = {}
    try:
        deadline = 50.0
        while len(got) < 5 and deadline > 0:
            try:
                rank, what, *rest = q.get(timeout=1.0)
            except queues.Empty:
                deadline -= 1.0
                continue
            got[(rank, what)] = rest[0] if rest else 0.0
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert (0, "sent") in got and (1, "identical") in got and (2, "identical") in got, got
    assert (0, "round 2 failed") in got and (1, "round 2 failed") in got, got
    assert got[(0, "round 2 failed")] < 10 and got[(1, "round 2 failed")] < 10, got


def _chunks(t: Any, ranks: int) -> list[Any]:
    """FSDP2's Shard(0) rows of `t` per rank: torch.chunk's, the last ranks possibly empty."""
    import torch

    if t.dim() == 0:
        return [t.reshape(-1)] + [t.reshape(-1)[:0]] * (ranks - 1)
    parts = list(torch.chunk(t, ranks, dim=0))
    return parts + [t[:0]] * (ranks - len(parts))


@pytest.mark.torch
def test_the_stream_layout_assembles_whole_tensors_from_uneven_row_shards_bit_for_bit() -> None:
    """Shards as FSDP2 cuts dim 0 (uneven: 5 rows over 2 ranks are 3 + 2, 1 row is 1 + 0; 1-D
    and 0-d tensors; bfloat16 beside float32; a tied name sent once) travel in per-rank sends
    of bounded buckets, and the receivers' assembly is the whole payload, bit for bit."""
    import torch

    from relayrl.backends.ray.collective import ShardSpec, assemble, pack_shards, stream_layout

    g = torch.Generator().manual_seed(3)
    embed = torch.randn(5, 4, generator=g)
    payload = {
        "embed.weight": embed,
        "a": torch.randn(3, 4, generator=g),
        "norm": torch.randn(7, generator=g).to(torch.bfloat16),
        "one": torch.randn(1, 6, generator=g),
        "scale": torch.tensor(2.5),
        "lm_head.weight": embed,  # tied
    }
    distinct = {k: v for k, v in payload.items() if k != "lm_head.weight"}
    ranks = 2
    specs, locals_ = [], []
    for r in range(ranks):
        local = {k: _chunks(v, ranks)[r] for k, v in distinct.items()}
        tensors = tuple((k, v.dtype, tuple(v.shape), int(local[k].shape[0] if v.dim() else local[k].numel())) for k, v in distinct.items())
        specs.append(ShardSpec(tuple(payload), {"lm_head.weight": "embed.weight"}, tensors))
        locals_.append(local)
    layout = stream_layout(specs, bucket_bytes=16 * 4)
    assert layout.sources == 2 and layout.full.aliases == {"lm_head.weight": "embed.weight"}
    rows = {(s.src, p.name): p.numel for s in layout.sends for p in s.pieces}
    assert rows[(0, "embed.weight")] == 3 * 4 and rows[(1, "embed.weight")] == 2 * 4  # uneven dim 0
    assert (1, "one") not in rows and (1, "scale") not in rows  # rank 1 holds none of those rows: it sends nothing of them
    assert all(s.numel * torch.empty((), dtype=s.dtype).element_size() <= 16 * 4 or len(s.pieces) == 1 for s in layout.sends)
    flats: dict[int, torch.Tensor] = {}
    for r in range(ranks):
        own = pack_shards(layout, r, locals_[r], torch.device("cpu"))
        assert {layout.sends[i].src for i in own} == {r}
        flats.update(own)
    got = assemble(layout, flats)
    assert list(got) == list(payload)
    for name, t in payload.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    assert got["lm_head.weight"] is got["embed.weight"]
    assert layout.staging()  # the sends of several pieces go through one staging bucket per dtype


@pytest.mark.torch
def test_the_stream_layout_refuses_ranks_whose_rows_do_not_add_up() -> None:
    import torch

    from relayrl.backends.ray.collective import ShardSpec, stream_layout

    a = ShardSpec(("w",), {}, (("w", torch.float32, (5, 2), 3),))
    b = ShardSpec(("w",), {}, (("w", torch.float32, (5, 2), 1),))
    with pytest.raises(ValueError, match=r"w: the ranks hold \[3, 1\] rows of 5"):
        stream_layout([a, b])


@pytest.mark.torch
def test_two_fsdp2_ranks_stream_their_shards_and_receivers_assemble_the_model_bit_for_bit() -> None:
    """Four processes, no Ray: two trainer ranks shard a small model with FSDP2 (uneven rows, a
    bfloat16 unit, a tied weight) and each streams its own shards; both receivers hold the whole
    model bit for bit. Once a receiver died, the trainer ranks' next round and the other
    receiver's fail in seconds, not at the groups' 60 s timeout (see relayrl.backends.ray.collective)."""
    import multiprocessing
    import queue as queues

    from relayrl.backends.ray.collective import free_port
    from support.stream import member

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    ports = (free_port(), free_port())
    roles = [("source", 0), ("source", 1), ("receiver", 0), ("receiver", 1)]
    procs = [ctx.Process(target=member, args=(role, i, ports, q)) for role, i in roles]
    for p in procs:
        p.start()
    got: dict[tuple[str, int, str], float] = {}
    try:
        deadline = 90.0
        while len(got) < 7 and deadline > 0:
            try:
                role, i, what, *rest = q.get(timeout=1.0)
            except queues.Empty:
                deadline -= 1.0
                continue
            got[(role, i, what)] = rest[0] if rest else 0.0
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert ("source", 0, "sent") in got and ("source", 1, "sent") in got, got
    assert ("receiver", 0, "identical") in got and ("receiver", 1, "identical") in got, got
    for who in (("source", 0), ("source", 1), ("receiver", 0)):
        assert (*who, "round 2 failed") in got and got[(*who, "round 2 failed")] < 10, got


def test_bench_weights_sharded_rows_stream_every_ranks_shards_whole_to_every_receiver() -> None:
    """`relayrl bench weights`' 2-rank rows on the tiny model: both ways deliver the trainer's
    model bit for bit to both receivers; rank 0 holds the whole model when it gathers and about
    half when it streams; the gather costs two host copies on rank 0 beside the receivers' one each."""
    from relayrl.bench.weights import run_weights

    figures = run_weights(["tiny"], replicas=2, versions=1, ray=False)
    tiny = figures["models"]["tiny"]  # type: ignore[index]
    gathered, stream = tiny["transports"]["sharded_gathered"], tiny["transports"]["sharded_stream"]
    assert gathered["identical"] == stream["identical"] == 1.0
    assert gathered["rank0_peak_bytes"] == tiny["export_bytes"]
    assert 0.4 * tiny["export_bytes"] < stream["rank0_peak_bytes"] < 0.6 * tiny["export_bytes"]
    assert gathered["host_copies"] == pytest.approx(4.0, abs=0.01) and stream["host_copies"] == pytest.approx(2.0, abs=0.01)
    assert gathered["seconds_per_version"] > 0 and stream["seconds_per_version"] > 0
