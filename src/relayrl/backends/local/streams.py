"""CUDA streams for in-process workers: a trainer and samplers sharing one GPU each compute on a
stream of their own, and a tensor one worker hands another carries an event.

Job: without this every worker thread launches on the device's default stream, so a sampler's
decode step queues behind the trainer's backward pass (and the other way round) even where the
GPU could run both; with it, their kernels interleave.

Invariants:
- `worker_stream(device)` is made once per worker (a `LocalTrainer`, a `LocalSampler` replica):
  a new `torch.cuda.Stream` on a CUDA device, None elsewhere (CPU: nothing changes);
- `enter_stream(stream)` runs first in every thread that hosts the worker (its `ThreadHost`
  initializer) and makes the stream that thread's current one for the thread's life (torch's
  current stream is per thread): every kernel the worker launches goes to it. A sampler's
  generate thread and its load thread share the sampler's stream, so a weight load and a forward
  pass stay in the order the `WeightGate` puts them in;
- a cross-thread handoff of device tensors: the producer calls `handoff()` after queueing the
  work that writes them (an event recorded on its current stream; None off CUDA), the consumer
  `receive(event, tensors, device)` before queueing work that reads them: its current stream waits for the
  event (on the device: the host does not wait), and the tensors are marked as used on that
  stream, so the caching allocator does not hand their memory out again while it still reads
  them. Handoffs: a trainer's exported weights (`Weights.ready`) to a sampler's load and to the
  checkpoint writer's thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch

__all__ = ["enter_stream", "handoff", "receive", "worker_stream"]


def worker_stream(device: torch.device | str) -> torch.cuda.Stream | None:
    """A worker's own stream on `device` when it is a CUDA device, else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def enter_stream(stream: torch.cuda.Stream | None) -> None:
    """In a worker thread's initializer: `stream` (None: none) is this thread's current stream
    from now on."""
    if stream is not None:
        torch.cuda.set_stream(stream)


def handoff(device: torch.device | str) -> torch.cuda.Event | None:
    """After queueing the work that writes tensors on `device` that another thread will read: an
    event recorded on this thread's current stream there (None off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def receive(event: object | None, tensors: Iterable[torch.Tensor], device: torch.device | str) -> None:
    """Before this thread reads `tensors` another thread wrote (this thread's worker computing on
    `device`): its current stream on `device` and on each CUDA tensor's device waits for `event`
    (a `handoff`'s; None: nothing to wait for), and the CUDA tensors are recorded as used there."""
    if event is None:
        return
    ready = cast(torch.cuda.Event, event)
    own = torch.device(device)
    waited: dict[torch.device, torch.cuda.Stream] = {}

    def stream_on(where: torch.device) -> torch.cuda.Stream:
        if where not in waited:
            waited[where] = torch.cuda.current_stream(where)
            waited[where].wait_event(ready)
        return waited[where]

    if own.type == "cuda":
        stream_on(own)
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(stream_on(tensor.device))
