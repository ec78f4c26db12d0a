"""In-process sampler: a Hugging Face causal LM sampled with torch, off the event loop.

Job: turn `SampleRequest`s into `GenerateResult`s, and multi-turn `TurnRequest`s into
`TurnResult`s, with the weights of one policy version, and swap weights in place when the trainer
publishes a new version.

What computes and where it runs are separate: `SamplerCompute` is the synchronous compute (plain
methods, torch, no threads or event loop), `LocalSampler` hosts one in a `ThreadHost` and
implements the `Sampler` protocol. Another host (e.g. a Ray actor) wraps the same compute class.

Invariants:
- all compute (sampling, greedy evaluation, weight loads) runs in this replica's one named worker
  thread ("relayrl-sampler-<replica>"), never on the event loop; calls run in the order they were
  made, so a load never races a generate, and a generate samples with the weights loaded when
  the call was made and reports exactly that version;
- except with `interruptible` (rollout.interruptible at max_staleness > 0): a load then runs in
  its own thread ("relayrl-sampler-<replica>-load") without waiting for a running `generate`, and
  lands between two of its forward passes (`relayrl.backends.local.gate`: no pass mixes two
  versions); the generation goes on with the new weights over the KV cache of its earlier
  tokens (the accepted approximation), each token's log-prob is the version's that drew it, each
  completion records its `versions` segments, and the result's `policy_version` is the oldest
  (its first token's). Its RNG stays seeded by the version the call started with. Multi-turn
  turns (`generate_turns`) are interrupted the same way: each turn records its own segments and
  its oldest version. Greedy evaluation holds the weights for its whole call, and so do turns
  when not interruptible;
- a weight load is all or nothing: the payload is checked (names, shapes) before any tensor is
  copied, so a bad payload leaves the previous version intact; a LoRA run's payload (adapters
  only) is merged into the base weights kept at the first one, W = W0 + scaling · B · A, never onto
  an already merged weight (`relayrl.models.lora.AdapterMerger`);
- a cancelled call does not return before its worker-thread work has stopped (sampling checks an
  abort flag between decode steps), so cancellation never leaves compute running behind the caller;
- sampling is reproducible: each request draws from its own RNG, seeded by (run seed, the
  request's `seed_key` — its prompt's index in the run's prompt stream —, policy version), so what
  a group samples depends on those and the weights only — not on the replica, the batch it rides
  in, the timing, or a resume (which re-dispatches in-flight prompts with their indices) — and two
  dispatches of one prompt never sample alike; a turn's RNG is seeded the same way from its `rng_key`;
- a turn samples what re-reading its whole context would (up to float rounding): an episode's
  session (the KV cache of the tokens it has fed, from its previous turn) is continued only when
  it was computed with the weights loaded now and covers a proper prefix of the turn's context;
  otherwise the context is read again. A weight load drops every session — except when
  interruptible: a session then survives loads and is continued with the newer weights (its keys
  and values computed with older ones: the approximation a load inside one generation already
  makes, and no turn after a load re-reads its whole context). At most
  `max_sessions` are kept, holding at most `max_session_bytes` of tensors when set, the least
  recently used evicted first (an evicted episode re-reads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from relayrl.backends.local.gate import WeightGate
from relayrl.backends.local.generation import (
    RowCache,
    SampledSequence,
    SamplingAborted,
    SamplingParams,
    TurnInput,
    TurnStats,
    sample,
    sample_turns,
)
from relayrl.backends.local.gpumem import step_peak_gb
from relayrl.backends.local.streams import enter_stream, receive, worker_stream
from relayrl.backends.protocols import Sampler
from relayrl.models.lora import AdapterMerger, is_adapter_payload
from relayrl.threads import ThreadHost
from relayrl.types import Completion, GenerateResult, SampleRequest, TurnRequest, TurnResult, Weights

__all__ = ["DEFAULT_MAX_SESSIONS", "LocalSampler", "SamplerCompute", "SamplingAborted"]

T = TypeVar("T")

DEFAULT_MAX_SESSIONS = 4096


@dataclasses.dataclass(slots=True)
class _Session:
    """An episode's KV cache after its last turn, and the policy version that computed it."""

    version: int
    cache: RowCache


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


def _setup_worker_thread(torch_threads: int | None, nice: int, stream: torch.cuda.Stream | None = None) -> None:
    """Runs first in the sampler's thread: its torch intra-op threads, its scheduling priority
    (Linux: niceness is per thread and inherited by the OpenMP threads it starts), and on CUDA the
    replica's own stream (`relayrl.backends.local.streams`)."""
    if nice and hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    if torch_threads:
        torch.set_num_threads(torch_threads)
    enter_stream(stream)


class SamplerCompute:
    """One sampler replica's model and its synchronous compute. Not thread-safe: its host calls
    it from one thread at a time. `abort` (checked between decode steps) stops a call early.

    `params` sets temperature, top-p and the token budget of `generate`; when its
    `eos_token_ids` is empty, the tokenizer's and the model's generation-config EOS ids are used.
    `replica` names the replica in its results and errors; `seed` (the run's) seeds each
    request's RNG with the request's prompt id and the policy version (see the module docstring).
    `max_sessions` bounds the episodes whose KV cache `generate_turns` keeps (0: none, every turn
    re-reads its context), `max_session_bytes` (None: no bound) the bytes their tensors hold.
    `turn_stats` counts what `generate_turns` prefilled and reused. `interruptible`: loads may
    come from another thread while a call runs and land between its forward passes (`generate`
    always lets them; `generate_turns` only then), and sessions survive loads (see the module).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        *,
        replica: int = 0,
        version: int = 0,
        seed: int = 0,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_session_bytes: int | None = None,
        interruptible: bool = False,
    ) -> None:
        if max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {max_sessions}")
        if max_session_bytes is not None and max_session_bytes < 0:
            raise ValueError(f"max_session_bytes must be >= 0 or None, got {max_session_bytes}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        if not params.eos_token_ids:
            params = dataclasses.replace(params, eos_token_ids=_eos_ids(model, tokenizer))
        self.params = params
        self.replica = replica
        self.gate = WeightGate(version)  # forward passes hold it; a load lands between two of them
        self.seed = seed
        self.max_sessions = max_sessions
        self.max_session_bytes = max_session_bytes
        self.interruptible = interruptible
        self._session_bytes = 0  # held by the sessions' tensors
        self.turn_stats = TurnStats()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._merger: AdapterMerger | None = None  # made by the first adapter payload (a LoRA run)
        state = model.state_dict()
        self._shapes = {name: tuple(t.shape) for name, t in state.items()}
        # Tied parameters (e.g. lm_head.weight = embed_tokens.weight) may be absent from a payload.
        seen: set[int] = set()
        self._aliases: set[str] = set()
        for name, tensor in state.items():
            ptr = tensor.data_ptr()
            if ptr in seen:
                self._aliases.add(name)
            seen.add(ptr)

    @property
    def version(self) -> int:
        """The policy version whose weights are loaded now."""
        return self.gate.version

    def generate(self, requests: Sequence[SampleRequest], abort: threading.Event | None = None) -> list[GenerateResult]:
        """Sample every request with the weights loaded now (and, when a load lands meanwhile,
        the newer ones after it: see the module); results carry the oldest version."""
        requests = list(requests)
        if not requests:
            return []
        version = self.version
        groups = sample(
            self.model,
            [r.prompt_tokens for r in requests],
            [r.num_samples for r in requests],
            self.params,
            None,
            pad_token_id=self._pad_token_id,
            abort=abort,
            generators=[self._rng(r.seed_key, version) for r in requests],
            gate=self.gate,
        )
        first = next((seq.versions[0][1] for group in groups for seq in group if seq.versions), version)  # the prefill's
        return [
            GenerateResult(request=request, completions=self._completions(group), policy_version=first, replica=self.replica)
            for request, group in zip(requests, groups)
        ]

    def generate_turns(self, requests: Sequence[TurnRequest], abort: threading.Event | None = None) -> list[TurnResult]:
        """Sample the next turn of every episode (one completion each) with the weights loaded now
        (interruptible: and, when a load lands meanwhile, the newer ones after it; each result
        carries its turn's oldest version), continuing each episode's session where it is valid
        (see the module docstring), and keep every episode's new session. Sessions are changed
        only when the call succeeds."""
        requests = list(requests)
        if not requests:
            return []
        seen: set[str] = set()
        for request in requests:
            if request.episode in seen:
                raise ValueError(
                    f"LocalSampler replica {self.replica}: episode {request.episode!r} appears twice in one generate_turns call"
                )
            seen.add(request.episode)
        if self.interruptible:  # each forward pass holds the gate: a load lands between two of them
            return self._generate_turns(requests, self.version, abort, self.gate)
        with self.gate.step() as version:
            return self._generate_turns(requests, version, abort, None)

    def _generate_turns(
        self, requests: list[TurnRequest], version: int, abort: threading.Event | None, gate: WeightGate | None
    ) -> list[TurnResult]:
        """The turns, sampled from RNGs seeded with `version` (the call's first); with `gate`
        (interruptible) each pass holds it and a turn's result carries its oldest version."""
        inputs: list[TurnInput] = []
        for request in requests:
            session = self._sessions.get(request.episode)
            cache = None
            if session is not None and (self.interruptible or session.version == version):
                covered = session.cache.tokens
                if len(covered) < len(request.context) and request.context[: len(covered)] == covered:
                    cache = session.cache
            inputs.append(TurnInput(request.context, request.max_new_tokens, self._rng(request.rng_key, version), cache))
        outputs = sample_turns(
            self.model,
            inputs,
            self.params,
            pad_token_id=self._pad_token_id,
            abort=abort,
            keep_caches=self.max_sessions > 0,
            stats=self.turn_stats,
            gate=gate,
        )
        completions = self._completions([o.sequence for o in outputs])
        results: list[TurnResult] = []
        for request, output, completion in zip(requests, outputs, completions):
            self._drop(request.episode)
            runs = output.sequence.versions
            if output.cache is not None:
                self._sessions[request.episode] = _Session(runs[-1][1] if runs else version, output.cache)
                self._session_bytes += output.cache.nbytes
            oldest = runs[0][1] if runs else version  # its first token's
            results.append(TurnResult(request.episode, completion, oldest, self.replica, output.cached_tokens))
        bytes_bound = self.max_session_bytes
        while self._sessions and (
            len(self._sessions) > self.max_sessions or (bytes_bound is not None and self._session_bytes > bytes_bound)
        ):
            self._drop(next(iter(self._sessions)))  # the least recently used
        return results

    def end_episodes(self, episodes: Sequence[str], abort: threading.Event | None = None) -> None:
        """Forget these episodes' sessions; unknown names are ignored."""
        for name in episodes:
            self._drop(name)

    def _drop(self, episode: str) -> None:
        session = self._sessions.pop(episode, None)
        if session is not None:
            self._session_bytes -= session.cache.nbytes

    @property
    def session_episodes(self) -> list[str]:
        """The episodes holding a session, least recently used first."""
        return list(self._sessions)

    @property
    def session_bytes(self) -> int:
        """Bytes the sessions' KV tensors hold."""
        return self._session_bytes

    def _rng(self, key: str, version: int) -> torch.Generator:
        """The RNG one request samples from: seeded by (run seed, key, version); the key is a
        request's `seed_key` or a turn's `rng_key`."""
        digest = hashlib.blake2b(f"{self.seed}\x00{key}\x00{version}".encode(), digest_size=8).digest()
        return torch.Generator(device=self.model.device).manual_seed(int.from_bytes(digest, "little") >> 1)

    def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int, abort: threading.Event | None = None) -> list[list[int]]:
        """Greedy completion tokens (EOS included when produced) of each prompt, for evaluation.
        Does not draw from the sampling RNG."""
        prompts = [list(p) for p in prompts_tokens]
        if not prompts:
            return []
        params = dataclasses.replace(self.params, greedy=True, max_new_tokens=max_new_tokens)
        with self.gate.step():
            out = sample(self.model, prompts, 1, params, None, pad_token_id=self._pad_token_id, abort=abort)
        return [group[0].tokens for group in out]

    def load_weights(self, weights: Weights, abort: threading.Event | None = None) -> None:
        """Copy `weights.payload` (a state dict of tensors) into the model and take its version,
        all or nothing (the payload is checked first). The sender may reuse its tensors after.
        Waits for the running forward pass, if any, and holds the next one until it is done.
        A LoRA run's payload holds adapters only: they are merged into the base weights
        (`relayrl.models.lora.AdapterMerger`)."""
        if abort is not None and abort.is_set():
            return
        where = f"LocalSampler replica {self.replica}, weights version {weights.version}"
        payload = weights.payload
        if not isinstance(payload, dict) or not all(isinstance(t, torch.Tensor) for t in payload.values()):
            raise TypeError(f"{where}: payload must be dict[str, torch.Tensor], got {type(payload).__name__}")
        if is_adapter_payload(payload):
            if self._merger is None:
                self._merger = AdapterMerger(self.model)
            with self.gate.load(weights.version):
                self._forget_sessions()
                receive(weights.ready, payload.values(), self.model.device)
                self._merger.merge(payload, where)  # checks everything before changing a weight
            return
        unexpected = sorted(set(payload) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(payload) - self._aliases)
        wrong = sorted(n for n, t in payload.items() if n in self._shapes and tuple(t.shape) != self._shapes[n])
        if unexpected or missing or wrong:
            raise ValueError(
                f"{where}: payload does not match the model: unexpected {unexpected[:5]}, missing {missing[:5]}, wrong shape {wrong[:5]}"
            )
        with self.gate.load(weights.version):
            self._forget_sessions()
            receive(weights.ready, payload.values(), self.model.device)  # on CUDA: after the exporter's copies
            with torch.no_grad():
                self.model.load_state_dict(payload, strict=False)

    def _forget_sessions(self) -> None:
        """Drop every session at a load: computed with the weights about to be replaced. Not
        when interruptible: sessions are then kept and continued with the newer weights (see the
        module), and only the sampling thread touches them (a load runs in another)."""
        if not self.interruptible:
            self._sessions.clear()
            self._session_bytes = 0

    def _completions(self, group: list[SampledSequence]) -> list[Completion]:
        texts = self.tokenizer.batch_decode([s.tokens for s in group], skip_special_tokens=True)
        return [
            Completion(
                tokens=s.tokens,
                logprobs=s.logprobs,
                text=text,
                finish_reason=s.finish_reason,
                versions=s.versions if len(s.versions) > 1 else None,
            )
            for s, text in zip(group, texts)
        ]


class LocalSampler(Sampler):
    """A `SamplerCompute` hosted in its own worker thread (implements `Sampler` and
    `GreedyEngine`). Each call gets its own abort flag: cancelling one stops its compute (between
    decode steps) and waits for it, without aborting the calls queued after it.

    `torch_threads` caps torch's intra-op threads in the worker thread only (the setting is
    per-thread), e.g. to leave the other cores to a trainer in the same process.
    `nice` lowers the thread's scheduling priority, so that on a machine with few cores the trainer
    (usually the bottleneck) keeps its cores and the sampler runs on what is left.
    `max_sessions` and `max_session_bytes` bound the multi-turn episodes' KV caches kept
    (`SamplerCompute`). `interruptible`: weight loads run in a thread of their own and land
    between two forward passes of a running generation (see the module).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        *,
        replica: int = 0,
        version: int = 0,
        seed: int = 0,
        torch_threads: int | None = None,
        nice: int = 0,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_session_bytes: int | None = None,
        interruptible: bool = False,
        own_gpu: bool = False,
    ) -> None:
        self._own_gpu = own_gpu  # its CUDA device is used by no trainer in this process (its peak is its own)
        self.compute = SamplerCompute(
            model,
            tokenizer,
            params,
            replica=replica,
            version=version,
            seed=seed,
            max_sessions=max_sessions,
            max_session_bytes=max_session_bytes,
            interruptible=interruptible,
        )
        self.torch_threads = torch_threads
        stream = worker_stream(model.device)  # both threads' (CUDA): loads and forwards stay in gate order
        self._host = ThreadHost(f"sampler-{replica}", initializer=_setup_worker_thread, initargs=(torch_threads, nice, stream))
        # interruptible: loads do not queue behind generate calls, they run here
        self._load_host = (
            ThreadHost(f"sampler-{replica}-load", initializer=_setup_worker_thread, initargs=(torch_threads, nice, stream))
            if interruptible
            else None
        )

    @property
    def interruptible(self) -> bool:
        return self._load_host is not None

    def gpu_mem_peak_gb(self) -> float | None:
        """Its CUDA device's peak allocated GiB since the last call (reset then), when no trainer
        in this process uses that device (one allocator counts per device: a sampler sharing the
        trainer's GPU is counted in train/gpu_mem_peak_gb)."""
        return step_peak_gb(self.compute.model.device) if self._own_gpu else None

    @property
    def params(self) -> SamplingParams:
        return self.compute.params

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        """Sample every request with the weights loaded when the call starts."""
        batch = list(requests)
        if not batch:
            return []
        return await self._call(lambda abort: self.compute.generate(batch, abort))

    async def generate_turns(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Sample the next turn of every episode with the weights loaded when the call starts."""
        batch = list(requests)
        if not batch:
            return []
        return await self._call(lambda abort: self.compute.generate_turns(batch, abort))

    async def end_episodes(self, episodes: Sequence[str]) -> None:
        """Forget these episodes' KV caches (in call order, after the turns already asked for)."""
        names = list(episodes)
        if not names or self._host.closed:
            return  # a closed sampler samples no more turns: its caches are moot
        await self._call(lambda abort: self.compute.end_episodes(names, abort))

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        prompts = [list(p) for p in prompts_tokens]
        if not prompts:
            return []
        return await self._call(lambda abort: self.compute.greedy(prompts, max_new_tokens, abort))

    async def load_weights(self, weights: Weights) -> None:
        await self._call(lambda abort: self.compute.load_weights(weights, abort), self._load_host)

    async def close(self) -> None:
        """Stop the worker threads; queued calls are cancelled. Idempotent."""
        await self._host.aclose(abort=False)
        if self._load_host is not None:
            await self._load_host.aclose(abort=False)

    async def _call(self, fn: Callable[[threading.Event], T], host: ThreadHost | None = None) -> T:
        host = host if host is not None else self._host
        if host.closed:
            raise RuntimeError(f"LocalSampler replica {self.compute.replica} is closed")
        abort = threading.Event()
        return await host.call(lambda: fn(abort), abort)
