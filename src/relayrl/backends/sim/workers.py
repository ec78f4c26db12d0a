"""The sim backend's workers: deterministic latency-simulating sampler, trainer and collator.

Device-side costs (generation, train/optim steps, metric fetch, weight export) are `asyncio.sleep`s:
the simulated accelerator works while the orchestrator's thread is free. Host-side costs (packing;
the bookkeeping costs applied by the run) burn real CPU holding the GIL.

Invariant: given the same sequence of calls, outputs are a pure function of the seed; the success
rate of sampled answers rises with the policy version, so rewards have variance and "learning" is
visible. `get_metrics` reads the trainer's metrics slot when the fetch lands, and that slot is
overwritten by the next `optim_step`, exactly the hazard step-boundary rule 2 guards against.
With `interruptible` (rollout.interruptible), a weight load that lands during a simulated
generation counts from the next simulated token on: the call's first token is drawn when it
starts, token k at start + generate_base + generate_per_request × requests + generate_per_token × k,
and each token's version is the newest loaded by then (`Completion.versions`); what the call
draws stays a function of the version it started with. Multi-turn turns (`generate_turns`) are
stamped the same way, and a load then keeps the episodes' simulated caches (as the hf sampler
keeps its sessions when interruptible).
Several updates per step (`train.ppo_epochs`, `train.minibatches_per_step`) are simulated inside
`optim_step`, as the local trainer makes them: the step's micro-batches trained again
(`sim.train_step` each, for every pass after the first) and one `sim.optim_step` per update.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.backends.protocols import Sampler, Trainer
from relayrl.config.schema import Config, SimConfig
from relayrl.threads import burn_cpu
from relayrl.types import Completion, GenerateResult, MicroBatch, SampleRequest, TrainBatch, TurnRequest, TurnResult, Weights

YIELD_EVERY = 4096  # completions the sim sampler makes between two turns of the event loop


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


class SimSampler(Sampler):
    """Implements `Sampler`; `replica` only names the replica in its results."""

    def __init__(self, cfg: SimConfig, max_new_tokens: int, seed: int, replica: int = 0, *, interruptible: bool = False) -> None:
        self._replica = replica
        self._interruptible = interruptible
        self._loads: deque[tuple[float, int]] = deque(maxlen=64)  # (clock time, version) of recent loads
        self.clock = time.monotonic  # what times the loads and the simulated tokens (tests replace it)
        self._cfg = cfg
        self._max_new_tokens = max_new_tokens
        self._seed = seed
        self._version = 0
        self.generate_calls = 0
        self._sessions: dict[str, int] = {}  # episode -> context tokens its "cache" covers

    def success_rate(self, version: int) -> float:
        return min(0.95, self._cfg.base_success + self._cfg.learn_rate * version)

    def completion_length(self, rng: random.Random) -> int:
        """Tokens of one completion, drawn from `rng`: uniform on [1, max_new_tokens], or lognormal
        (median `length_median`, log-space spread `length_sigma`) clipped to that range."""
        if self._cfg.length_dist == "uniform":
            return rng.randint(1, self._max_new_tokens)
        z = rng.normalvariate(math.log(self._cfg.length_median), self._cfg.length_sigma)  # log of the length
        if z >= math.log(self._max_new_tokens):  # clipped in log space: exp never overflows
            return self._max_new_tokens
        return max(1, round(math.exp(z)))

    def generation_delay(self, num_requests: int, longest: int) -> float:
        """Simulated seconds of one generate call of `num_requests` requests whose longest
        completion has `longest` tokens: a batched decode runs until its longest sequence ends."""
        c = self._cfg
        return c.generate_base + c.generate_per_request * num_requests + c.generate_per_token * longest

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        started = self.clock()
        version = self._version
        self.generate_calls += 1
        p = self.success_rate(version)
        results: list[GenerateResult] = []
        longest = 0
        # uniform lengths drawn here as completion_length draws them (one call less per completion)
        uniform_max = self._max_new_tokens if self._cfg.length_dist == "uniform" else 0
        for req in requests:
            rng = random.Random(self._seed * 1_000_003 + req.group_id * 7919 + version)
            wrong = str(int(req.prompt.answer) + 1) if req.prompt.answer.lstrip("-").isdigit() else "?"
            completions: list[Completion] = []
            huge = req.num_samples >= YIELD_EVERY
            for i in range(req.num_samples):
                if huge and i % YIELD_EVERY == YIELD_EVERY - 1:
                    await asyncio.sleep(0)  # a huge request must not hold the event loop for seconds
                text = req.prompt.answer if rng.random() < p else wrong
                n = rng.randint(1, uniform_max) if uniform_max else self.completion_length(rng)
                if n > longest:
                    longest = n
                tokens = [rng.randrange(2, 64) for _ in range(n)]
                completions.append(Completion(tokens=tokens, logprobs=[-rng.random()] * n, text=text))
            results.append(GenerateResult(req, completions, version, self._replica))
        # the outputs are drawn first (the delay depends on their lengths), then the device time passes
        await _sleep(self.generation_delay(len(requests), longest))
        if self._interruptible:
            self._stamp_versions((c for r in results for c in r.completions), len(results), started, version)
        return results

    def _stamp_versions(self, completions: Iterable[Completion], num_requests: int, started: float, version: int) -> None:
        """Give each completion of a call of `num_requests` requests the versions of its simulated
        tokens (see the module)."""
        c = self._cfg
        first = started + c.generate_base + c.generate_per_request * num_requests  # when token 1 is drawn
        changes: list[tuple[int, int]] = [(0, version)]
        for at, loaded in list(self._loads):
            if at <= started or loaded <= changes[-1][1]:
                continue
            if c.generate_per_token > 0:
                token = max(1, math.ceil((at - first) / c.generate_per_token))
            else:
                token = 1 if at <= first else self._max_new_tokens
            if token >= self._max_new_tokens:
                break
            if token == changes[-1][0]:
                changes[-1] = (token, loaded)
            else:
                changes.append((token, loaded))
        if len(changes) == 1:
            return
        for completion in completions:
            segments = [s for s in changes if s[0] < len(completion.tokens)]
            if len(segments) > 1:
                completion.versions = segments

    async def generate_turns(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """One turn per episode: the right answer with the version's success rate, else a number
        one off it; each episode's context is "cached" from its previous turn on this replica
        (counted in `cached_tokens`) until weights are loaded (interruptible: kept)."""
        started = self.clock()
        version = self._version
        self.generate_calls += 1
        p = self.success_rate(version)
        results: list[TurnResult] = []
        longest = 0
        for req in requests:
            digest = hashlib.blake2b(f"{self._seed}\x00{req.rng_key}\x00{version}".encode(), digest_size=8).digest()
            rng = random.Random(int.from_bytes(digest, "little"))
            answer = req.prompt.answer if req.prompt is not None else "0"
            if rng.random() < p or not answer.lstrip("-").isdigit():
                text = answer
            else:
                text = str(int(answer) + rng.choice((-1, 1)))
            n = min(self.completion_length(rng), req.max_new_tokens)
            longest = max(longest, n)
            covered = self._sessions.get(req.episode, 0)
            cached = covered if 0 < covered < len(req.context) else 0
            self._sessions[req.episode] = len(req.context) + n - 1
            tokens = [rng.randrange(2, 64) for _ in range(n)]
            results.append(TurnResult(req.episode, Completion(tokens, [-rng.random()] * n, text), version, self._replica, cached))
        await _sleep(self.generation_delay(len(requests), longest))
        if self._interruptible:
            self._stamp_versions((r.completion for r in results), len(requests), started, version)
        return results

    async def end_episodes(self, episodes: Sequence[str]) -> None:
        for name in episodes:
            self._sessions.pop(name, None)

    async def load_weights(self, weights: Weights) -> None:
        self._version = weights.version
        self._loads.append((self.clock(), weights.version))
        if not self._interruptible:
            self._sessions.clear()


@dataclass(slots=True)
class _Accum:
    tokens: int = 0
    trajectories: int = 0
    adv_sum: float = 0.0
    microbatches: int = 0
    minibatches: set[int] = field(default_factory=set)
    later: int = 0  # micro-batches not of the first minibatch (trained in optim_step's first pass)


class SimTrainer(Trainer):
    def __init__(self, cfg: SimConfig, ppo_epochs: int = 1) -> None:
        self._cfg = cfg
        self._epochs = ppo_epochs
        self.version = 0
        self._accum = _Accum()
        self._slot: dict[str, float] = {}
        # (method, version at call) of the most recent calls: lets tests check order (bounded: a
        # long run keeps nothing that grows with its steps)
        self.calls: deque[tuple[str, int]] = deque(maxlen=256)

    async def train_step(self, batch: TrainBatch) -> None:
        self.calls.append(("train_step", self.version))
        await _sleep(self._cfg.train_step)
        self._accum.tokens += batch.num_tokens
        self._accum.trajectories += batch.num_sequences
        self._accum.adv_sum += sum(abs(a) for a in batch.advantages)
        self._accum.microbatches += 1
        self._accum.minibatches.add(batch.minibatch)
        self._accum.later += batch.minibatch > 0

    async def optim_step(self) -> int:
        self.calls.append(("optim_step", self.version))
        if self._accum.microbatches == 0:
            raise RuntimeError("optim_step called with no accumulated train_step")
        acc = self._accum
        updates = self._epochs * len(acc.minibatches)
        # the updates after the first: every micro-batch trained again per pass after the first (the
        # first pass's other minibatches too), one optimizer step each
        retrained = (self._epochs - 1) * acc.microbatches + acc.later
        await _sleep(self._cfg.optim_step * updates + self._cfg.train_step * retrained)
        self._slot = {
            "step": float(self.version),
            "loss": -acc.adv_sum / max(1, acc.trajectories) * 0.1,
            "grad_norm": 1.0 / (1.0 + self.version),
            "tokens": float(acc.tokens),
            "microbatches": float(acc.microbatches),
            "learning_rate": 1e-6,
            **({"updates": float(updates)} if updates > 1 else {}),
        }
        self._accum = _Accum()
        self.version += 1
        return self.version

    async def get_metrics(self) -> dict[str, float]:
        self.calls.append(("get_metrics", self.version))
        await _sleep(self._cfg.get_metrics)
        return dict(self._slot)  # read when the fetch lands, as a remote slot would be

    async def export_weights(self) -> Weights:
        version = self.version
        await _sleep(self._cfg.weight_sync)
        return Weights(version=version, payload=version)

    async def save_state(self, directory: Path) -> None:
        version = self.version
        await _sleep(self._cfg.weight_sync)
        (directory / "sim_trainer.json").write_text(json.dumps({"version": version}), encoding="utf-8")

    async def load_state(self, directory: Path) -> int:
        self.version = int(json.loads((directory / "sim_trainer.json").read_text(encoding="utf-8"))["version"])
        return self.version


class SimCollator:
    def __init__(self, cfg: SimConfig, abort: threading.Event) -> None:
        self._cost = cfg.pack_per_microbatch
        self._abort = abort

    def collate(self, mb: MicroBatch) -> object:
        burn_cpu(self._cost, self._abort)
        return None


class SimTokenizer:
    """Fixed-length prompt tokens derived from the text (a `PromptEncoder`)."""

    def __init__(self, prompt_tokens: int) -> None:
        self._n = prompt_tokens

    def __call__(self, text: str) -> list[int]:
        codes = [ord(c) % 64 for c in text][: self._n]
        return codes + [0] * (self._n - len(codes))


class SimEncodeText:
    """An observation's text as sim token ids, one per character (a `TextEncoder`: the sim has no
    special tokens)."""

    max_token_chars = 1

    def __call__(self, text: str, *, special_tokens: bool = False) -> list[int]:
        return [ord(c) % 64 for c in text]


sim_encode_text = SimEncodeText()


class SimHostWork:
    """CPU burnt (GIL held) inside each bookkeeping span, per step (implements `HostWork`)."""

    def __init__(self, cfg: Config) -> None:
        s = cfg.sim
        self.costs = {
            "reduce_metrics": s.reduce_metrics,
            "log_metrics": s.log_metrics,
            "log_trajectories": s.log_trajectories,
            "on_step_end": s.on_step_end,
            "release_memory": s.release_memory,
        }

    def spend(self, part: str, abort: threading.Event) -> None:
        burn_cpu(self.costs.get(part, 0.0), abort)
