#!/usr/bin/env python
"""Multi-turn sampling on the local backend: continuing each episode's KV cache vs re-reading its
whole context every turn.

Runs the same episodes (E episodes in groups of G sharing a prompt, T policy turns each, an
"observation" of random tokens appended after every turn) through `SamplerCompute.generate_turns`
twice, one mode after the other, on the same model and seeds:

- sessions: the sampler keeps each episode's KV cache between turns and reads only the new tokens;
- re-read: `max_sessions=0`, every turn prefills its whole context (identical contexts once,
  as in both modes).

Both sample the same tokens (checked and printed). Printed per turn and mode: the context tokens
the prefills computed, those read from caches, and the wall seconds (median over `--repeats`,
modes alternating which goes first); then the totals and the ratios re-read / sessions.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/turn_cache.py
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/turn_cache.py --models random --turns 6

Models: `tiny` is the shipped tiny-arith (4 layers, hidden 128, 128 positions: short contexts);
`random` a randomly initialised Qwen2 built here from a config (no download; hidden 256, 4
layers, vocab 4096), with longer prompts and observations so that prefill cost is visible. Its
random weights rarely sample EOS, so its turns run to `max_new_tokens`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import relayrl  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))

import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from relayrl.backends.local.generation import SamplingParams  # noqa: E402
from relayrl.backends.local.sampler import SamplerCompute  # noqa: E402
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir  # noqa: E402
from relayrl.types import TurnRequest  # noqa: E402


@dataclass(slots=True, frozen=True)
class Workload:
    episodes: int
    group: int
    turns: int
    prompt_tokens: int
    obs_tokens: int  # observation length: obs_tokens +- obs_tokens // 4
    max_new_tokens: int


# Per model: contexts that fit its positions (the tiny model has 128).
WORKLOADS = {
    "tiny": Workload(episodes=32, group=8, turns=4, prompt_tokens=16, obs_tokens=10, max_new_tokens=8),
    "random": Workload(episodes=32, group=8, turns=4, prompt_tokens=128, obs_tokens=64, max_new_tokens=32),
}


def random_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1} | {f"t{i}": i for i in range(2, vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def build_model(name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if name == "tiny":
        return load_model_and_tokenizer(shipped_model_dir())
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).eval(), random_tokenizer(config.vocab_size)


@dataclass(slots=True)
class ModeRun:
    """One mode's pass over all episodes: per turn, the figures and the sampled tokens."""

    computed: list[int] = field(default_factory=list)  # context tokens prefilled
    cached: list[int] = field(default_factory=list)  # context tokens read from caches
    context: list[int] = field(default_factory=list)  # context tokens of the turn's requests
    wall_s: list[float] = field(default_factory=list)
    samples: list[list[list[int]]] = field(default_factory=list)


def run_mode(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, work: Workload, sessions: bool, seed: int) -> ModeRun:
    vocab = model.config.vocab_size
    compute = SamplerCompute(model, tokenizer, SamplingParams(temperature=1.0), seed=seed, max_sessions=4096 if sessions else 0)
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(work.prompt_tokens + g % 3)] for g in range(work.episodes // work.group)]
    contexts = {f"e{i}": list(prompts[i // work.group]) for i in range(work.episodes)}
    run = ModeRun()
    for turn in range(work.turns):
        asks = [
            TurnRequest(episode=e, context=list(c), rng_key=f"{e}/{turn}", max_new_tokens=work.max_new_tokens) for e, c in contexts.items()
        ]
        before = (compute.turn_stats.computed_tokens, compute.turn_stats.cached_tokens)
        start = time.perf_counter()
        results = compute.generate_turns(asks)
        run.wall_s.append(time.perf_counter() - start)
        run.computed.append(compute.turn_stats.computed_tokens - before[0])
        run.cached.append(compute.turn_stats.cached_tokens - before[1])
        run.context.append(sum(len(a.context) for a in asks))
        run.samples.append([r.completion.tokens for r in results])
        for ask, result in zip(asks, results, strict=True):
            spread = work.obs_tokens // 4
            n = work.obs_tokens + rng.randint(-spread, spread)
            contexts[ask.episode] = ask.context + result.completion.tokens + [rng.randrange(2, vocab) for _ in range(n)]
    return run


def bench_model(name: str, work: Workload, repeats: int, seed: int) -> dict[str, Any]:
    model, tokenizer = build_model(name)
    params = sum(p.numel() for p in model.parameters())
    run_mode(model, tokenizer, replace(work, episodes=work.group, turns=2), True, seed)  # warm-up, not timed
    runs: dict[str, list[ModeRun]] = {"sessions": [], "re-read": []}
    for repeat in range(repeats):
        order = ["sessions", "re-read"] if repeat % 2 == 0 else ["re-read", "sessions"]
        for mode in order:
            runs[mode].append(run_mode(model, tokenizer, work, mode == "sessions", seed))
    same = all(r.samples == runs["sessions"][0].samples for mode in runs for r in runs[mode])
    figures: dict[str, Any] = {"model": name, "parameters": params, "workload": asdict(work), "repeats": repeats, "same_samples": same}
    for mode, mode_runs in runs.items():
        first = mode_runs[0]
        per_turn = [statistics.median(r.wall_s[t] for r in mode_runs) for t in range(work.turns)]
        totals = [sum(r.wall_s) for r in mode_runs]
        figures[mode] = {
            "context_tokens_per_turn": first.context,
            "computed_tokens_per_turn": first.computed,
            "cached_tokens_per_turn": first.cached,
            "wall_s_per_turn": per_turn,
            "wall_s_total": statistics.median(totals),
            "wall_s_total_min_max": [min(totals), max(totals)],
            "computed_tokens_total": sum(first.computed),
        }
    s, r = figures["sessions"], figures["re-read"]
    figures["ratio_wall"] = r["wall_s_total"] / s["wall_s_total"]
    figures["ratio_computed_tokens"] = r["computed_tokens_total"] / max(1, s["computed_tokens_total"])
    figures["ratio_wall_last_turn"] = r["wall_s_per_turn"][-1] / s["wall_s_per_turn"][-1]
    return figures


def print_figures(f: dict[str, Any], threads: int) -> None:
    w = f["workload"]
    print(
        f"\nmodel {f['model']} ({f['parameters'] / 1e6:.2f} M parameters): {w['episodes']} episodes (groups of {w['group']}) x "
        f"{w['turns']} turns, prompt ~{w['prompt_tokens']}, observation ~{w['obs_tokens']}, max_new_tokens {w['max_new_tokens']}; "
        f"torch threads {threads}, median of {f['repeats']}"
    )
    s, r = f["sessions"], f["re-read"]
    print(
        f"{'turn':>4} {'context':>8} | {'computed':>8} {'cached':>7} {'wall s':>7} | {'computed':>8} {'wall s':>7}   (sessions | re-read)"
    )
    for t in range(w["turns"]):
        print(
            f"{t + 1:>4} {s['context_tokens_per_turn'][t]:>8} | {s['computed_tokens_per_turn'][t]:>8} {s['cached_tokens_per_turn'][t]:>7} "
            f"{s['wall_s_per_turn'][t]:>7.3f} | {r['computed_tokens_per_turn'][t]:>8} {r['wall_s_per_turn'][t]:>7.3f}"
        )
    print(
        f"{'all':>4} {sum(s['context_tokens_per_turn']):>8} | {s['computed_tokens_total']:>8} {sum(s['cached_tokens_per_turn']):>7} "
        f"{s['wall_s_total']:>7.3f} | {r['computed_tokens_total']:>8} {r['wall_s_total']:>7.3f}"
    )
    print(
        f"re-read / sessions: context tokens computed {f['ratio_computed_tokens']:.2f}x, wall {f['ratio_wall']:.2f}x "
        f"(last turn {f['ratio_wall_last_turn']:.2f}x); same samples in both modes: {'yes' if f['same_samples'] else 'NO'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--models", default="tiny,random", help="comma-separated: tiny, random")
    parser.add_argument("--episodes", type=int, help="override the workload's episodes")
    parser.add_argument("--group", type=int, help="episodes sharing a prompt")
    parser.add_argument("--turns", type=int)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least sensitive to a busy machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object with every figure instead of text")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    if not args.json and load > 0.75 * (os.cpu_count() or 1):
        print(f"note: 1-minute load average {load:.2f} on {os.cpu_count()} cores: wall times are noisy")
    out = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name not in WORKLOADS:
            parser.error(f"--models: unknown model {name!r} (tiny, random)")
        base = asdict(WORKLOADS[name])
        for key in ("episodes", "group", "turns", "max_new_tokens"):
            if getattr(args, key) is not None:
                base[key] = getattr(args, key)
        figures = bench_model(name, Workload(**base), args.repeats, args.seed)
        out.append(figures)
        if not args.json:
            print_figures(figures, args.threads)
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
