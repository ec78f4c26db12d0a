"""`relayrl bench weights`' rows for a sharded trainer (train.world_size = 2): a version from two
FSDP2 trainer ranks to `replicas` receivers over the collective transport, two ways, in the same
run:

- `sharded_gathered`: the full state dict gathered to rank 0's CPU (`get_model_state_dict`,
  full and offloaded, as `ShardedCompute.export` does without streaming), then sent from rank 0
  alone (a stream of one source: one copy into flat buckets, then the broadcasts, as the
  one-trainer collective packs each bucket once);
- `sharded_stream`: each rank's own shards copied (its commit snapshot) and streamed from every
  rank (`Member.join` / `send_shards`, what the sharded Ray trainer does with
  rollout.weight_transport = "collective"); the receivers assemble the tensors.

Processes: the two ranks and the receivers, spawned (no Ray: the collective code the actors run,
in plain processes), one compute thread each. Each receiver zeroes its model before every
version and loads what it received (`load_state_dict`), and checks after the last that its model
equals the trainer's (`identical`). Per version: from the first rank's start to the last
receiver's load, on one clock (CLOCK_MONOTONIC, shared by the processes); the median of
`versions` after one warm-up; bytes: the model's unique bytes; host copies: bytes staged in host
memory (STAGED) per version over them (the gathered rows: the gather and its buckets on rank 0,
each receiver's buckets; the stream: each receiver's, a rank's snapshot being its send buffers,
as `ShardedCompute` counts); rank 0's peak: the largest host buffer of the version rank
0 held at once (the whole model when gathered, its shards when streamed).
"""

from __future__ import annotations

import multiprocessing
import queue as queues
import statistics
import time
from typing import Any, cast

__all__ = ["run_sharded"]

#: how long the processes may take, start-up (building the model) included
DEADLINE_S = 900.0


def _source(
    index: int, model_name: str, dtype: str, receivers: int, versions: int, ports: tuple[int, int, int], barrier: Any, out: Any
) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from relayrl.backends.ray.collective import Member, local_shards, pack_shards, stream_layout
    from relayrl.backends.transports import STAGED
    from relayrl.bench.weight_models import build_model
    from relayrl.models.sharing import tied_names

    torch.set_num_threads(1)
    group_port, gathered_port, stream_port = ports
    model = build_model(model_name, dtype)
    ties = tied_names(model)
    # the gathered version's layout: every tensor whole, rank 0's (a stream of one source)
    whole_spec, _ = local_shards(model.state_dict(keep_vars=True), 0)
    single = stream_layout([whole_spec])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=index, world_size=2)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)

    def gathered() -> dict[str, torch.Tensor]:
        state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
        for name, first in ties.items():  # gathered per name: a tied weight kept once, as the export does
            if name in state:
                state[name] = state[first]
        return state

    one = None
    if index == 0:
        one = Member.join("127.0.0.1", gathered_port, "gloo", 600.0, receivers, source=0, layout=single)
    spec, _ = local_shards(model.state_dict(keep_vars=True), index)
    specs: list[Any] = [None, None]
    dist.all_gather_object(specs, spec)
    stream = stream_layout(specs)
    member = Member.join("127.0.0.1", stream_port, "gloo", 600.0, receivers, source=index, layout=stream if index == 0 else None)
    for way in ("gathered", "stream"):
        for v in range(versions + 1):
            barrier.wait()
            before = STAGED.read()
            start = time.monotonic()
            if way == "gathered":
                state = gathered()
                peak = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values()) if index == 0 else 0
                if one is not None:
                    _, whole = local_shards(state, 0)
                    STAGED.add(2 * peak)  # the gather into rank 0's memory, the buckets packed from it (as `Member.send` counts)
                    one.send_shards(1 + v, v, pack_shards(single, 0, whole, torch.device("cpu")))
                del state
            else:
                _, local = local_shards(model.state_dict(keep_vars=True), index)
                flats = pack_shards(stream, index, local, torch.device("cpu"))  # the commit's snapshot of this rank's rows
                peak = sum(t.numel() * t.element_size() for t in flats.values())
                member.send_shards(1 + v, v, flats)
                del flats
            out.put(("source", index, way, v, start, STAGED.read() - before, peak))
    barrier.wait()
    member.close()
    if one is not None:
        one.close()


def _receiver(
    index: int, model_name: str, dtype: str, receivers: int, versions: int, ports: tuple[int, int, int], barrier: Any, out: Any
) -> None:
    import torch

    from relayrl.backends.ray.collective import Member
    from relayrl.backends.transports import STAGED
    from relayrl.bench.weight_models import build_model

    torch.set_num_threads(1)
    _, gathered_port, stream_port = ports
    expected = {k: v.detach().clone() for k, v in build_model(model_name, dtype).state_dict().items()}
    model = build_model(model_name, dtype, seed=1 + index)
    one = Member.join("127.0.0.1", gathered_port, "gloo", 600.0, receivers, receiver=index)
    member = Member.join("127.0.0.1", stream_port, "gloo", 600.0, receivers, receiver=index)
    identical: dict[str, bool] = {}
    for way, m in (("gathered", one), ("stream", member)):
        for v in range(versions + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()  # what arrives must be the whole model
            barrier.wait()
            before = STAGED.read()
            version, got = m.receive(1 + v)
            with torch.no_grad():
                model.load_state_dict(got, strict=False)
            end = time.monotonic()
            del got
            out.put(("receiver", index, way, v, end, STAGED.read() - before, version))
        identical[way] = all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())
    out.put(("identical", index, identical))
    barrier.wait()
    member.close()
    one.close()


def run_sharded(model: str, dtype: str, replicas: int, versions: int, nbytes: int) -> dict[str, dict[str, float]]:
    """The two sharded rows for `model` (see the module); `nbytes`: a version's unique bytes."""
    from relayrl.backends.ray.collective import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(2 + replicas)
    ports = (free_port(), free_port(), free_port())
    procs = [ctx.Process(target=_source, args=(i, model, dtype, replicas, versions, ports, barrier, out)) for i in range(2)]
    procs += [ctx.Process(target=_receiver, args=(i, model, dtype, replicas, versions, ports, barrier, out)) for i in range(replicas)]
    for p in procs:
        p.start()
    rows: list[tuple[Any, ...]] = []
    expected = 2 * 2 * (versions + 1) + replicas * 2 * (versions + 1) + replicas
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(rows) < expected:
            try:
                rows.append(out.get(timeout=1.0))
            except queues.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"a process exited with {dead[0].exitcode}" if dead else f"not done in {DEADLINE_S:.0f} s"
                    raise RuntimeError(f"bench weights, sharded rows ({model}): {why}") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    figures: dict[str, dict[str, float]] = {}
    for way in ("gathered", "stream"):
        times = []
        staged = 0
        for v in range(1, versions + 1):  # (version 0: the warm-up)
            starts = [r[4] for r in rows if r[0] == "source" and r[2] == way and r[3] == v]
            ends = [r[4] for r in rows if r[0] == "receiver" and r[2] == way and r[3] == v]
            times.append(max(ends) - min(starts))
            staged += sum(r[5] for r in rows if r[0] in ("source", "receiver") and r[2] == way and r[3] == v)
        peak = max(r[6] for r in rows if r[0] == "source" and r[1] == 0 and r[2] == way)
        seconds = statistics.median(times)
        figures[f"sharded_{way}"] = {
            "bytes_per_version": float(nbytes),
            "seconds_per_version": seconds,
            "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            "host_copies": staged / versions / nbytes if nbytes else 0.0,
            "rank0_peak_bytes": float(peak),
            "identical": float(all(r[2][way] for r in rows if r[0] == "identical")),
        }
    return figures
