"""A member of a 3-process gloo weight group for tests/unit/test_weight_transports.py (run in a
spawned process): round 1 must arrive bit for bit (fp32, bf16, a tied name sharing one tensor);
then rank 2 dies and the others report how fast their round 2 failed."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def payload() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    embed = torch.randn(300, 64, generator=g)
    return {
        "embed.weight": embed,
        "layer.weight": torch.randn(64, 64, generator=g),
        "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
        "lm_head.weight": embed,
    }


def member(rank: int, port: int, queue: Any) -> None:
    import torch

    from relayrl.backends.ray.collective import Member, layout_of

    sent = payload()
    if rank == 0:
        m = Member.join("127.0.0.1", port, "gloo", 60.0, 2, source=0, layout=layout_of(sent, bucket_bytes=40_000))
    else:
        m = Member.join("127.0.0.1", port, "gloo", 60.0, 2, receiver=rank - 1)
    if rank == 0:
        m.send(1, 5, sent)
        queue.put((rank, "sent"))
    else:
        version, got = m.receive(1)
        same = version == 5 and list(got) == list(sent) and all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in sent.items())
        queue.put((rank, "identical" if same and got["lm_head.weight"] is got["embed.weight"] else "differs"))
    if rank == 2:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.0)  # rank 2 is dead by now
    start = time.monotonic()
    try:
        if rank == 0:
            m.send(2, 6, sent)
        else:
            m.receive(2)
        queue.put((rank, "round 2 passed", 0.0))
    except Exception:
        queue.put((rank, "round 2 failed", time.monotonic() - start))
