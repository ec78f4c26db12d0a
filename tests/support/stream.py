"""A member of a 4-process weight stream for tests/unit/test_weight_transports.py (run in a
spawned process, no Ray): two trainer ranks shard a small model with FSDP2 (uneven rows, a
bfloat16 unit, a tied weight) and stream their shards; two receivers must assemble the whole
model bit for bit. Then receiver 1 dies and the others report how fast their round 2 failed."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def model() -> Any:
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)  # 5 rows over 2 ranks: 3 + 2
            self.layers = nn.ModuleList([nn.Linear(4, 3), nn.Linear(3, 4).to(torch.bfloat16)])  # 3 rows: 2 + 1; bias 1-D
            self.one = nn.Linear(4, 1)  # 1 row: 1 + 0
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight  # tied

    torch.manual_seed(11)
    return Net()


def member(role: str, index: int, ports: tuple[int, int], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from relayrl.backends.ray.collective import Member, local_shards, pack_shards, stream_layout

    group_port, stream_port = ports
    net = model()
    expected = {k: v.detach().clone() for k, v in net.state_dict().items()}
    if role == "source":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=index, world_size=2)
        for layer in net.layers:
            fully_shard(layer)
        fully_shard(net.one)
        fully_shard(net)
        spec, local = local_shards(net.state_dict(keep_vars=True), index)
        specs: list[Any] = [None, None]
        dist.all_gather_object(specs, spec)
        layout = stream_layout(specs, bucket_bytes=48)
        flats = pack_shards(layout, index, local, torch.device("cpu"))
        m = Member.join("127.0.0.1", stream_port, "gloo", 60.0, 2, source=index, layout=layout if index == 0 else None)
        m.send_shards(1, 5, flats)
        queue.put((role, index, "sent"))
    else:
        m = Member.join("127.0.0.1", stream_port, "gloo", 60.0, 2, receiver=index)
        version, got = m.receive(1)
        same = version == 5 and list(got) == list(expected)
        same = same and all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expected.items())
        tied = got["head.weight"] is got["embed.weight"]
        queue.put((role, index, "identical" if same and tied else f"differs {sorted(got)}"))
    if role == "receiver" and index == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.0)  # receiver 1 is dead by now
    start = time.monotonic()
    try:
        if role == "source":
            m.send_shards(2, 6, flats)
        else:
            m.receive(2)
        queue.put((role, index, "round 2 passed", 0.0))
    except Exception:
        queue.put((role, index, "round 2 failed", time.monotonic() - start))
