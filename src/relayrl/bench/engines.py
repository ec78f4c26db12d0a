"""`relayrl bench engines`: the same rollout load through the hf engine (relayrl's own decode loop)
and the vLLM engine, on the shipped tiny model and on a random ~40 M-parameter Qwen2 built here
(no download): start-up, tokens/s, and the seconds a weight load takes per version. "hf-before"
is the hf engine with its decode loop as it was before it stopped reading the device per token
(`relayrl.bench.legacy_decode`), measured in the same run as the baseline of "hf". vLLM is
measured where it is installed (the vllm extra), else left out and said so; not under the
"tiny-decode" load (hf only: its EOS is never drawn, which the vLLM sampler has no setting for).

Invariant: both engines get the same prompts, samples, token budget and temperature (1, top_p 1)
and one compute thread each (the hf sampler's torch threads = 1; vLLM's CPU build binds its
worker to one core by default on this kind of machine); the timed calls follow one warm-up call.
Nothing here asserts a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from relayrl.types import GenerateResult, Prompt, SampleRequest, Weights

__all__ = ["ENGINE_MODELS", "run_engines"]

ENGINE_MODELS = ("tiny", "tiny-decode", "qwen2-40m")
# model -> (prompts, samples per prompt, max new tokens). "tiny-decode" is the tiny model under the
# decode loop's own load, the hf engine only: 32 prompts per call and EOS never drawn (an id past
# the vocabulary), so every row decodes its 32 tokens and the loop's per-token costs show.
DECODE_ONLY = ("tiny-decode",)
LOADS: dict[str, tuple[int, int, int]] = {"tiny": (64, 16, 4), "tiny-decode": (32, 16, 32), "qwen2-40m": (8, 8, 32)}


def _random_qwen2_dir(directory: Path) -> None:
    """A random Qwen2 (hidden 512, 8 layers, vocab 32k, tied: ~40 M parameters) saved in `directory`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).eval().save_pretrained(directory)


def _prompts(name: str, model_dir: Path, count: int) -> list[list[int]]:
    if name.startswith("tiny"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        return [[int(i) for i in tok(f"{10 + i}+{(7 * i) % 90}=", add_special_tokens=False)["input_ids"]] for i in range(count)]
    return [[3 + (37 * i + 11 * j) % 31000 for j in range(16)] for i in range(count)]


def _perturbed(state: dict[str, Any], version: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(version)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


async def _rate(sampler: Any, requests: list[SampleRequest]) -> float:
    """Tokens per second of one timed `generate` of every request."""
    start = time.perf_counter()
    results: list[GenerateResult] = await sampler.generate(requests)
    seconds = time.perf_counter() - start
    return sum(len(c.tokens) for r in results for c in r.completions) / seconds


async def _load_seconds(sampler: Any, state: dict[str, Any], versions: int) -> float:
    """The median seconds of `versions` weight loads."""
    loads: list[float] = []
    for v in range(1, versions + 1):
        weights = Weights(version=v, payload=_perturbed(state, v))
        start = time.perf_counter()
        await sampler.load_weights(weights)
        loads.append(time.perf_counter() - start)
    return statistics.median(loads)


async def _measure(sampler: Any, requests: list[SampleRequest], state: dict[str, Any], repeats: int, versions: int) -> dict[str, float]:
    await sampler.generate(requests[:1])  # warm-up
    rates = [await _rate(sampler, requests) for _ in range(repeats)]
    return {"tokens_per_s": statistics.median(rates), "weight_load_s": await _load_seconds(sampler, state, versions)}


async def _measure_hf(
    samplers: dict[str, tuple[Any, bool]], requests: list[SampleRequest], state: dict[str, Any], repeats: int, versions: int
) -> dict[str, dict[str, float]]:
    """`_measure` for the hf samplers {engine: (sampler, old decode loop)}, their timed calls
    alternating (so the machine's load drifting during the run weighs on both alike)."""
    rates: dict[str, list[float]] = {engine: [] for engine in samplers}
    for _, (sampler, before) in samplers.items():
        with _decode_loop(before):
            await sampler.generate(requests[:1])  # warm-up
    for _ in range(repeats):
        for engine, (sampler, before) in samplers.items():
            with _decode_loop(before):
                rates[engine].append(await _rate(sampler, requests))
    return {
        engine: {"tokens_per_s": statistics.median(rates[engine]), "weight_load_s": await _load_seconds(sampler, state, versions)}
        for engine, (sampler, _) in samplers.items()
    }


@contextlib.contextmanager
def _decode_loop(before: bool) -> Iterator[None]:
    """Inside: the hf sampler samples with the old decode loop when `before` (else unchanged)."""
    import relayrl.backends.local.sampler as sampler_module
    from relayrl.bench.legacy_decode import legacy_sample

    current = sampler_module.sample
    if before:
        sampler_module.sample = legacy_sample
    try:
        yield
    finally:
        sampler_module.sample = current


def _one_model(name: str, model_dir: Path, repeats: int, versions: int) -> dict[str, dict[str, float]]:
    import torch

    from relayrl.backends.local.generation import SamplingParams
    from relayrl.backends.local.sampler import LocalSampler
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir

    prompts_n, samples, max_new = LOADS[name]
    prompts = _prompts(name, model_dir, prompts_n)
    requests = [
        SampleRequest(group_id=i, prompt=Prompt(prompt_id=str(i), text="", answer=""), prompt_tokens=p, num_samples=samples)
        for i, p in enumerate(prompts)
    ]
    figures: dict[str, dict[str, float]] = {}

    def timed(build: Callable[[], Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        sampler = build()
        return sampler, time.perf_counter() - start

    # hf: the model loaded as the local backend loads it, one torch thread
    tiny = name.startswith("tiny")
    tokenizer_dir = model_dir if tiny else shipped_model_dir()
    model, _ = load_model_and_tokenizer(model_dir) if tiny else (None, None)
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    never = (int(model.config.vocab_size),) if name in DECODE_ONLY else ()  # () : the tokenizer's EOS
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new, eos_token_ids=never)
    hf: dict[str, tuple[Any, bool]] = {}
    startup: dict[str, float] = {}
    for engine, before in (("hf-before", True), ("hf", False)):
        sampler, startup[engine] = timed(lambda: LocalSampler(copy.deepcopy(model), tokenizer, params, torch_threads=1))
        hf[engine] = (sampler, before)
    try:
        measured = asyncio.run(_measure_hf(hf, requests, state, repeats, versions))
        figures.update({engine: {"startup_s": startup[engine], **measured[engine]} for engine in hf})
    finally:
        for sampler, _ in hf.values():
            asyncio.run(sampler.close())
    if name in DECODE_ONLY or importlib.util.find_spec("vllm") is None:
        return figures

    from relayrl.backends.vllm.engine import EngineSettings, context_length
    from relayrl.backends.vllm.sampler import VllmSampler

    settings = EngineSettings(model=str(model_dir), max_model_len=context_length(model_dir), skip_tokenizer_init=not tiny)

    async def vllm_run() -> dict[str, float]:
        start = time.perf_counter()
        sampler = VllmSampler(settings, temperature=1.0, max_new_tokens=max_new)
        startup = time.perf_counter() - start
        try:
            return {"startup_s": startup, **(await _measure(sampler, requests, state, repeats, versions))}
        finally:
            await sampler.close()

    figures["vllm"] = asyncio.run(vllm_run())
    return figures


def run_engines(models: tuple[str, ...] = ENGINE_MODELS, repeats: int = 2, versions: int = 3) -> dict[str, object]:
    """{model: {"hf-before": figures, "hf": figures, "vllm": figures (where vllm is installed),
    "load": [prompts, samples, max_new_tokens]}}."""
    from relayrl.models.loading import shipped_model_dir

    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "relayrl-vllm-cache"))
    out: dict[str, object] = {}
    for name in models:
        scratch = Path(tempfile.mkdtemp(prefix=f"relayrl-bench-{name}-"))
        try:
            if name.startswith("tiny"):
                model_dir = shipped_model_dir()
            else:
                _random_qwen2_dir(scratch)
                model_dir = scratch
            out[name] = {**_one_model(name, model_dir, repeats, versions), "load": list(LOADS[name])}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return out
