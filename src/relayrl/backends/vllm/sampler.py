"""A sampler replica on one vLLM `AsyncLLM` engine (`rollout.engine = "vllm"`).

Job: turn `SampleRequest`s into `GenerateResult`s and `TurnRequest`s into `TurnResult`s with the
weights of one policy version, greedy completions for evaluation, and in-place weight loads.

Invariants:
- a call samples with the weights loaded when it starts and reports that version: a weight load
  first writes its file (calls keep running and starting meanwhile), then takes the gate: it
  waits for the calls running then, and calls made after that wait for the load (calls run
  concurrently otherwise, so vLLM batches them together);
- except with `interruptible` (rollout.interruptible at max_staleness > 0): a load then waits only
  for running greedy calls (evaluation), not for sampling calls. It pauses the engine between two
  steps keeping the requests in flight (`pause_generation(mode="keep")`), loads, resets the prefix
  cache with the running requests (their KV so far is recomputed with the new weights), labels the
  engine with the new version and resumes: each request's later tokens, and their log-probs, are
  the new weights' over the whole prefix. The engine labels every step's tokens with the version
  set when the step ran (vLLM's `weight_versions` spans; the label changes only while paused), so
  a completion's `versions` come from the engine, never from timing on this side; a result's
  `policy_version` is its oldest token's;
- a load is all or nothing from the caller's side: the payload is checked (names, shapes) before
  the engine sees it, since a reload that fails half-way leaves the engine dead; after it, the
  prefix cache is reset (running requests included), so no KV computed with old weights is reused;
- every sampled token's log-prob is log softmax(logits / temperature) of the token, the trainer's
  convention (engine.py); greedy log-probs are at temperature 1, as the hf engine's;
- sampling is reproducible as in the hf engine: each request's seed comes from (run seed, its
  `seed_key` or a turn's `rng_key`, policy version) only (vLLM gives the n samples of one request
  seeds seed, seed + 1, ...); unless its settings seed the engine only (`seed_requests` False,
  rollout.vllm_seeding: vLLM then draws the batch's noise at once, and what a request samples
  depends on what it was batched with);
- with the collective transport a round is received in the engine through vLLM's weight-transfer
  API (`receive_round`, after `join_transfer` joined the engine's worker to the weight group,
  its names checked against the model as a payload's are), taking the gate as a file load does:
  a load handed a `Round` (`relayrl.backends.vllm.broadcast`, in this process) that fails to
  receive leaves the group and loads the round's snapshot from its file instead (`fell_back`);
  in a Ray sampler actor the actor calls `receive_round`, and on failure loads from the object
  store;
- a weight file is written before the load takes the gate (sampling goes on while it is written),
  in /dev/shm when it has room for it, else in the temp directory on disk (Docker's and
  Kubernetes' /dev/shm is 64 MiB by default); its name carries this process's id, and files of
  processes that are gone (a crashed run) are removed when a replica starts
  (`remove_stale_weight_files`); the file is removed once loaded, whatever happens;
- a cancelled or failed call aborts its engine requests before it returns, so nothing keeps
  sampling for a caller that has gone;
- every call runs on one event loop, the first caller's (the engine's client and the gate belong
  to it): a call made from another loop is run there (a Ray actor serves an interruptible
  replica's loads on its `load` concurrency group's own loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from relayrl.abandoned import abandon
from relayrl.backends.protocols import Sampler
from relayrl.backends.transports import STAGED
from relayrl.backends.vllm.engine import SHUTDOWN_TIMEOUT_S, EngineSettings, start_engine
from relayrl.processes import alive
from relayrl.types import Completion, GenerateResult, SampleRequest, TurnRequest, TurnResult, Weights

__all__ = ["VllmSampler", "model_shapes", "remove_stale_weight_files", "request_seed", "weights_dir"]

_TIED_HEAD = "lm_head.weight"
SHM = "/dev/shm"
SHM_SPARE_BYTES = 64 * 2**20  # left free in /dev/shm beside a weight file (others use it too)
FILE_PREFIX = "relayrl-vllm-"
_OWNED = re.compile(r"relayrl-vllm-p(\d+)-")  # relayrl-vllm-p<pid>-<replica>-<random>.safetensors
OWNERLESS_AGE_S = 3600.0  # a file without an owner pid (an older relayrl's) is stale after this long
# a file whose owner pid is not alive here is stale only once this old: with --ipc=host, /dev/shm is
# shared with other containers, whose live runs' pids this process cannot see (each version a fresh file)
OWNED_STALE_AGE_S = 600.0
_T = TypeVar("_T")


def request_seed(seed: int, key: str, version: int) -> int:
    """The engine seed of one request: (run seed, key, version), as the hf engine seeds its RNG."""
    digest = hashlib.blake2b(f"{seed}\x00{key}\x00{version}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits: vLLM adds the sample index


def model_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the model directory's safetensors files (empty: none there)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def weights_dir(nbytes: int) -> str:
    """Where a weight file of `nbytes` goes: /dev/shm (no disk write) when it is there, writable
    and has room for it (SHM_SPARE_BYTES to spare), else the temp directory on disk."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK):
        try:
            if shutil.disk_usage(SHM).free >= nbytes + SHM_SPARE_BYTES:
                return SHM
        except OSError:
            pass
    return tempfile.gettempdir()


def remove_stale_weight_files(directories: Sequence[str] = (SHM, tempfile.gettempdir())) -> list[str]:
    """Remove the weight files (relayrl-vllm-*.safetensors) in `directories` whose owner process
    is gone (a run that crashed, or was killed, before removing its file) and that are older than
    OWNED_STALE_AGE_S (another container's live run sharing /dev/shm looks gone from here); a file
    naming no owner (written by an older relayrl) when older than OWNERLESS_AGE_S. Returns the
    paths removed."""
    removed = []
    now = time.time()
    for directory in dict.fromkeys(directories):
        try:
            names = [n for n in os.listdir(directory) if n.startswith(FILE_PREFIX) and n.endswith(".safetensors")]
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            owner = _OWNED.match(name)
            try:
                age = now - os.path.getmtime(path)
                stale = (age > OWNED_STALE_AGE_S and not alive(int(owner.group(1)))) if owner else age > OWNERLESS_AGE_S
                if stale:
                    os.unlink(path)
                    removed.append(path)
            except OSError:  # removed meanwhile, or not ours to remove
                continue
    return removed


def _write_weights(state: dict[str, torch.Tensor], replica: int) -> str:
    """`state` saved to a new safetensors file (see the module); its path."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    # staged in host memory: the file (and, for device tensors, the copy to the CPU it is written from)
    STAGED.add(nbytes + sum(t.numel() * t.element_size() for t in state.values() if t.device.type != "cpu"))
    fd, path = tempfile.mkstemp(prefix=f"{FILE_PREFIX}p{os.getpid()}-{replica}-", suffix=".safetensors", dir=weights_dir(nbytes))
    os.close(fd)
    try:
        save_file(state, path)
    except BaseException:
        os.unlink(path)
        raise
    return path


async def _stop_output_handler(engine: Any) -> None:
    """Cancel the engine's output handler (an asyncio task on the loop of its first call) before
    the engine core stops: left running, it sees the core go and logs an EngineDeadError at the
    end of every successful run."""
    handler = getattr(engine, "output_handler", None)
    if not isinstance(handler, asyncio.Task) or handler.done():
        return
    loop = handler.get_loop()
    if loop is asyncio.get_running_loop():
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(handler.cancel)


def _remove_written(write: asyncio.Future[str]) -> None:
    if not write.cancelled() and write.exception() is None:
        try:
            os.unlink(write.result())
        except OSError:
            pass


class VllmSampler(Sampler):
    """A sampler replica (implements `Sampler` and `GreedyEngine`) on its own vLLM engine.

    `temperature` and `max_new_tokens` are rollout.temperature and rollout.max_new_tokens;
    `replica` names it in results and errors; `seed` is the run's. `engine` (tests, benchmarks)
    is an engine already started with `settings`, else one is started here (blocking).
    `interruptible` (rollout.interruptible at max_staleness > 0): loads do not wait for running
    sampling calls (see the module)."""

    def __init__(
        self,
        settings: EngineSettings,
        *,
        temperature: float,
        max_new_tokens: int,
        replica: int = 0,
        version: int = 0,
        seed: int = 0,
        engine: Any = None,
        interruptible: bool = False,
    ) -> None:
        self.settings = settings
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.replica = replica
        self.version = version  # the policy version whose weights the engine holds
        self.seed = seed
        self._shapes = model_shapes(Path(settings.model))
        remove_stale_weight_files()
        self._engine = engine if engine is not None else start_engine(settings)
        self._ids = itertools.count()
        self.interruptible = interruptible
        self._running = 0  # calls sampling now
        self._pinned = 0  # of those, the calls a load waits for (all of them unless interruptible)
        self._loading = False  # a weight load waits for the pinned calls or runs
        self._label: int | None = None  # the version the engine labels its tokens with (interruptible)
        self._gate: asyncio.Condition | None = None  # made on the first call's event loop
        self._closed = False
        self._home: asyncio.AbstractEventLoop | None = None  # the loop every call runs on (the first caller's)
        self.last_load_s = 0.0  # seconds the last load took in the worker (benchmarks)
        self.transfer_member = False  # its engine is in the collective weight group (relayrl.backends.vllm.broadcast)
        self.fell_back = 0  # broadcast rounds whose receive failed here (loaded another way instead)

    @property
    def engine(self) -> Any:
        return self._engine

    # --- the Sampler protocol -------------------------------------------------------------

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        """Sample every request with the weights loaded when the call starts."""
        return await self._at_home(self._generate(list(requests)))

    async def _generate(self, batch: list[SampleRequest]) -> list[GenerateResult]:
        if not batch:
            return []
        async with self._sampling(pinned=not self.interruptible) as version:
            outputs = await self._run(
                [(r.prompt_tokens, self._params(r.num_samples, self.max_new_tokens, self._seed(r.seed_key, version))) for r in batch]
            )
        results = []
        for r, out in zip(batch, outputs, strict=True):
            completions, oldest = self._completions(out, r.num_samples, version)
            results.append(GenerateResult(request=r, completions=completions, policy_version=oldest, replica=self.replica))
        return results

    async def generate_turns(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Sample the next turn of every episode; the engine's prefix cache holds each episode's
        context KV between turns (full 32-token blocks), reset at every weight load."""
        return await self._at_home(self._generate_turns(list(requests)))

    async def _generate_turns(self, batch: list[TurnRequest]) -> list[TurnResult]:
        if not batch:
            return []
        async with self._sampling(pinned=not self.interruptible) as version:
            outputs = await self._run([(r.context, self._params(1, r.max_new_tokens, self._seed(r.rng_key, version))) for r in batch])
        results = []
        for r, out in zip(batch, outputs, strict=True):
            (completion,), oldest = self._completions(out, 1, version)
            results.append(TurnResult(r.episode, completion, oldest, self.replica, int(out.num_cached_tokens or 0)))
        return results

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completion tokens (EOS included when produced) of each prompt."""
        return await self._at_home(self._greedy([list(p) for p in prompts_tokens], max_new_tokens))

    async def _greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if not prompts:
            return []
        async with self._sampling(pinned=True):  # an evaluation is never interrupted
            outputs = await self._run([(p, self._params(1, max_new_tokens, None, greedy=True)) for p in prompts])
        return [list(out.outputs[0].token_ids) for out in outputs]

    async def load_weights(self, weights: Weights) -> None:
        """Write `weights.payload` (a state dict) to a safetensors file, load it in the engine's
        worker in place, and reset the prefix cache; the payload is checked first. With
        `interruptible`, the engine is paused around the load, its running requests kept (see
        the module)."""
        await self._at_home(self._load_weights(weights))

    async def _load_weights(self, weights: Weights) -> None:
        from relayrl.backends.vllm.broadcast import Round

        if isinstance(weights.payload, Round):  # the collective transport's round (relayrl.backends.vllm.broadcast)
            round_ = weights.payload
            try:
                await self._receive_round(round_.number, weights.version)
                return
            except Exception:  # the engine left the group: this version from its file instead
                weights = round_.snapshot
        state = self.loadable(weights)
        # written before the gate: calls keep sampling meanwhile
        write = asyncio.ensure_future(asyncio.to_thread(_write_weights, state, self.replica))
        try:
            path = await asyncio.shield(write)
        except asyncio.CancelledError:  # the thread writes on: its file is removed once written
            write.add_done_callback(_remove_written)
            abandon(write)
            raise
        try:
            await self._gated(lambda: self._swap(path, weights.version))
        finally:
            os.unlink(path)

    async def _gated(self, load: Callable[[], Awaitable[None]]) -> None:
        """Run `load` once the calls a load waits for have ended, calls made meanwhile held back
        (see the module); with `interruptible`, the engine paused around it."""
        gate = self._condition()
        try:  # a load cancelled while it waits must still readmit the calls behind it
            async with gate:
                self._loading = True
                await gate.wait_for(lambda: self._pinned == 0)
            if self.interruptible:
                await self._engine.pause_generation(mode="keep", clear_cache=False)
                try:
                    await load()
                finally:
                    await self._engine.resume_generation()
            else:
                await load()
        finally:
            async with gate:
                self._loading = False
                gate.notify_all()

    async def join_transfer(self, host: str, port: int, receiver: int, world: int, backend: str, timeout_s: float) -> None:
        """Join the collective weight group at `host`:`port` as receiver `receiver` of `world` - 1
        through vLLM's `init_weight_transfer_engine` (relayrl.backends.vllm.transfer; the engine
        must have been started with `weight_transfer`). Raises before the engine joins when the
        group's layout does not match the model (as `loadable`)."""
        await self._at_home(self._join_transfer(host, port, receiver, world, backend, timeout_s))

    async def _join_transfer(self, host: str, port: int, receiver: int, world: int, backend: str, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from relayrl.backends.ray.collective import read_layout

        refusal = self.transfer_refusal()
        if refusal is not None:
            raise RuntimeError(refusal)
        layout = await asyncio.to_thread(read_layout, host, port)
        shapes = {e.name: e.shape for e in layout.entries}
        names = [n for n in layout.names if n not in layout.aliases and (n != _TIED_HEAD or n in self._shapes)]
        self._check(f"VllmSampler replica {self.replica}, the collective weight group's layout", {n: shapes[n] for n in names})
        info = dict(host=host, port=port, receiver=receiver, world=world, backend=backend, timeout_s=timeout_s, names=names)
        await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        self.transfer_member = True

    async def receive_round(self, round_: int, version: int | None = None) -> int:
        """Receive collective round `round_` in the engine (joined by `join_transfer`), gated as a
        file load is; returns the version it carried (checked against `version` when given).
        Raises when the receive fails: the engine's worker left the group (the model untouched),
        this replica is no member from then on."""
        return await self._at_home(self._receive_round(round_, version))

    async def _receive_round(self, round_: int, version: int | None) -> int:
        try:
            await self._gated(lambda: self._receive(round_, version))
            return self.version
        except Exception:
            self.transfer_member = False
            self.fell_back += 1
            raise

    def transfer_refusal(self) -> str | None:
        """Why this replica cannot join a collective weight group (None: it can)."""
        if self._closed:
            return f"VllmSampler replica {self.replica} is closed"
        if not self.settings.weight_transfer:
            return f"VllmSampler replica {self.replica}: its engine was started without relayrl's weight-transfer engine"
        return None

    async def leave_transfer(self) -> None:
        """Leave the collective weight group (nothing when not a member)."""
        await self._at_home(self._leave_transfer())

    async def _leave_transfer(self) -> None:
        if self.transfer_member and self._engine is not None:
            self.transfer_member = False
            await self._engine.shutdown_weight_transfer_engine()

    async def staged_bytes(self) -> int:
        """The bytes this process and the engine's workers staged in host memory so far (benchmarks)."""
        return STAGED.read() + sum(await self._at_home(self._engine.collective_rpc("staged_bytes")))

    async def close(self) -> None:
        """Shut the engine down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        engine, self._engine = self._engine, None
        await _stop_output_handler(engine)
        await asyncio.to_thread(engine.shutdown, timeout=SHUTDOWN_TIMEOUT_S)

    # --- helpers ----------------------------------------------------------------------------

    async def _at_home(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await `coro` on the replica's loop (see the module): here when called from it, else run
        there (cancelling this call cancels it there)."""
        loop = asyncio.get_running_loop()
        if self._home is None or self._home.is_closed():
            self._home = loop
        if loop is self._home:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._home))

    async def _swap(self, path: str, version: int) -> None:
        """Load the weights file `path` into the engine (paused or idle) as `version`."""
        results = await self._engine.collective_rpc("update_from_file", args=(path,))
        await self._loaded(version, max(float(r["seconds"]) for r in results) if results else 0.0)

    async def _receive(self, round_: int, version: int | None) -> None:
        """Receive broadcast round `round_` (of `version`; None: the round says which) in the
        engine (paused or idle) through vLLM's weight-transfer API
        (relayrl.backends.vllm.transfer). Raises when the receive failed (the engine's worker left
        the group then; the model was not touched)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        start = time.perf_counter()
        await self._engine.start_weight_update()
        await self._engine.update_weights(WeightTransferUpdateRequest(update_info={"round": round_, "version": version}))
        await self._engine.finish_weight_update()
        if version is None:
            (version, *_) = await self._engine.collective_rpc("received_version")
            assert isinstance(version, int), f"the engine's worker received no version in round {round_}"
        await self._loaded(version, time.perf_counter() - start)

    async def _loaded(self, version: int, seconds: float) -> None:
        """After a load of `version` in the engine (paused or idle)."""
        if self.interruptible:  # every token of a step after this one is the new version's
            await self._engine.update_weight_version(str(version))
            self._label = version
        # running requests included: their KV so far is recomputed with the new weights
        await self._engine.reset_prefix_cache(reset_running_requests=True)
        self.last_load_s = seconds
        self.version = version

    def _condition(self) -> asyncio.Condition:
        if self._gate is None:
            self._gate = asyncio.Condition()
        return self._gate

    def _sampling(self, *, pinned: bool) -> _Sampling:
        if self._closed:
            raise RuntimeError(f"VllmSampler replica {self.replica} is closed")
        return _Sampling(self, pinned)

    def _seed(self, key: str, version: int) -> int | None:
        """A request's seed (None: the engine's stream, when its settings seed the engine only)."""
        return request_seed(self.seed, key, version) if self.settings.seed_requests else None

    def _params(self, n: int, max_tokens: int, seed: int | None, *, greedy: bool = False) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=n,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _run(self, prompts: list[tuple[list[int], Any]]) -> list[Any]:
        """The final output of each (prompt tokens, sampling params), all sent at once; on any
        error or cancellation every request still running is aborted before this returns."""
        ids = [f"relayrl-{self.replica}-{next(self._ids)}" for _ in prompts]
        tasks = [
            asyncio.ensure_future(self._one(request_id, tokens, params)) for request_id, (tokens, params) in zip(ids, prompts, strict=True)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            unfinished = [t for t in tasks if not t.done()]
            for task in unfinished:
                task.cancel()
            if unfinished:
                await asyncio.gather(*unfinished, return_exceptions=True)
            if any(not t.done() or t.cancelled() or t.exception() is not None for t in tasks):
                await asyncio.shield(self._engine.abort(ids))

    async def _one(self, request_id: str, tokens: list[int], params: Any) -> Any:
        final = None
        async for out in self._engine.generate({"prompt_token_ids": list(tokens)}, params, request_id):
            final = out
        if final is None or not final.finished:
            raise RuntimeError(f"VllmSampler replica {self.replica}: request {request_id} ended without a final output")
        return final

    def _completions(self, out: Any, n: int, version: int) -> tuple[list[Completion], int]:
        """The request's completions and the oldest version that sampled one of their tokens
        (`version`, the call's, unless interruptible); a completion's `versions` are set when
        its tokens are not all that oldest version's."""
        samples = sorted(out.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise RuntimeError(f"VllmSampler replica {self.replica}: request {out.request_id} returned {len(samples)} of {n} completions")
        completions = []
        segments = []
        for s in samples:
            tokens = [int(t) for t in s.token_ids]
            logprobs = [float(step[t].logprob) for t, step in zip(tokens, s.logprobs or [], strict=True)]
            reason = "length" if s.finish_reason == "length" else "stop"
            completions.append(Completion(tokens=tokens, logprobs=logprobs, text=s.text or "", finish_reason=reason))
            segments.append(self._segments(out.request_id, s, len(tokens), version))
        oldest = min(seg[0][1] for seg in segments)
        for completion, seg in zip(completions, segments, strict=True):
            if len(seg) > 1 or seg[0][1] != oldest:
                completion.versions = seg
        return completions, oldest

    def _segments(self, request_id: str, sample: Any, length: int, version: int) -> list[tuple[int, int]]:
        """(first token index, version) segments of one completion: the engine's weight-version
        spans with `interruptible`, else all `version`'s (no load ran beside the call)."""
        if not self.interruptible or length == 0:
            return [(0, version)]
        spans = getattr(sample, "weight_versions", None)
        where = f"VllmSampler replica {self.replica}: request {request_id} completion {sample.index}"
        if not spans or spans[0].start != 0 or spans[-1].end != length:
            raise RuntimeError(f"{where}: the engine's weight-version spans {spans!r} do not cover its {length} tokens")
        segments: list[tuple[int, int]] = []
        for span in spans:
            try:
                label = int(span.version)
            except ValueError:
                raise RuntimeError(
                    f"{where}: tokens {span.start}..{span.end} carry the weight version {span.version!r}, not a policy version"
                ) from None
            if span.end > span.start and (not segments or segments[-1][1] != label):
                segments.append((int(span.start), label))
        return segments

    def loadable(self, weights: Weights) -> dict[str, torch.Tensor]:
        """The payload as a state dict vLLM can load, tied aliases dropped; raises before the
        engine is touched when it does not match the model."""
        where = f"VllmSampler replica {self.replica}, weights version {weights.version}"
        payload = weights.payload
        if not isinstance(payload, dict) or not all(isinstance(t, torch.Tensor) for t in payload.values()):
            raise TypeError(f"{where}: payload must be dict[str, torch.Tensor], got {type(payload).__name__}")
        state: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in payload.items():
            ptr = tensor.data_ptr()
            if ptr in seen or (name == _TIED_HEAD and name not in self._shapes):
                continue  # a tied alias (vLLM ties the head itself)
            seen.add(ptr)
            state[name] = tensor.detach().contiguous()
        self._check(where, {name: tuple(t.shape) for name, t in state.items()})
        return state

    def _check(self, where: str, shapes: dict[str, tuple[int, ...]]) -> None:
        """Raises unless the tensors named with their `shapes` (tied aliases dropped) are the
        model's (when its shapes are known)."""
        if not self._shapes:
            return
        unexpected = sorted(set(shapes) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(shapes) - {_TIED_HEAD})
        wrong = sorted(n for n, shape in shapes.items() if n in self._shapes and shape != self._shapes[n])
        if unexpected or missing or wrong:
            raise ValueError(
                f"{where}: payload does not match the model: unexpected {unexpected[:5]}, missing {missing[:5]}, wrong shape {wrong[:5]}"
            )


class _Sampling:
    """`async with`: one sampling call, admitted once no weight load is waiting or running; yields
    the version it samples with. A load waits for the `pinned` calls; with `interruptible`, the
    engine's token label is set to the loaded version before the first call is admitted."""

    def __init__(self, sampler: VllmSampler, pinned: bool) -> None:
        self._sampler = sampler
        self._pinned = pinned

    async def __aenter__(self) -> int:
        s = self._sampler
        gate = s._condition()
        async with gate:
            await gate.wait_for(lambda: not s._loading)
            if s.interruptible and s._label != s.version:
                await s._engine.update_weight_version(str(s.version))
                s._label = s.version
            s._running += 1
            s._pinned += self._pinned
        return s.version

    async def __aexit__(self, *exc: object) -> None:
        s = self._sampler
        gate = s._condition()
        async with gate:
            s._running -= 1
            s._pinned -= self._pinned
            gate.notify_all()
