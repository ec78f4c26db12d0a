#!/usr/bin/env python
"""Build the shipped tiny model `tiny-arith`: a character tokenizer and a ~0.8M-parameter Qwen2
warm-started on integer arithmetic until its greedy accuracy is modest, leaving room for RL.

Reproducible: fixed seeds, a fixed torch thread count and a deterministic data stream, so the same
torch version and thread count give the same weights. Runs in a few minutes on 2 CPU cores:

    HF_HUB_OFFLINE=1 PYTHONPATH=src .venv/bin/python scripts/make_tiny_model.py

Training is supervised (prompt → answer + EOS, loss on the answer and EOS only). Every
`--eval-every` steps (`--eval-every-near` once close) it measures greedy exact-match accuracy on a *dev* slice of the held-out
problem space (held-out prompts 400..1399, never used for reporting) and stops once that lies in
[--target-low, --target-high]. If a check overshoots, it rolls back to the previous check's weights
and continues with half the learning rate and half the interval. The reported accuracy is measured
afterwards on held-out prompts 0..199 and 0..399 — the ones RL runs evaluate on.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import relayrl  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models  # noqa: E402
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from relayrl.models.loading import greedy_accuracy, load_model_and_tokenizer  # noqa: E402
from relayrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask  # noqa: E402
from relayrl.types import Prompt  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "src" / "relayrl" / "models" / "assets" / "tiny-arith"
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>")
CHARS: str = (
    "0123456789+-*/=()<>.,;:?!'\" \n"
    + "abcdefghijklmnopqrstuvwxyz"
    + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
MAX_POSITIONS = 128
DEV_SLICE = (400, 1400)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, specials <pad> <eos> <bos> <unk>."""
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARS))}
    assert len(vocab) == len(SPECIAL_TOKENS) + len(CHARS), "duplicate characters in CHARS"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: chars
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model


def encode_batch(
    tokenizer: PreTrainedTokenizerFast, prompts: list[Prompt]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + answer + EOS` rows; labels are -100 except on answer and EOS."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    assert eos is not None and pad is not None
    rows: list[tuple[list[int], list[int]]] = []
    for p in prompts:
        prompt_ids = tokenizer.encode(p.text, add_special_tokens=False)
        answer_ids = tokenizer.encode(p.answer, add_special_tokens=False) + [eos]
        rows.append((prompt_ids, answer_ids))
    width = max(len(a) + len(b) for a, b in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (a, b) in enumerate(rows):
        seq = a + b
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(a) : len(seq)] = torch.tensor(b)
        mask[i, : len(seq)] = 1
    return input_ids, mask, labels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-every-near", type=int, default=10)
    ap.add_argument("--target-low", type=float, default=0.25)
    ap.add_argument("--target-high", type=float, default=0.30)
    ap.add_argument("--max-steps", type=int, default=20_000)
    ap.add_argument("--max-minutes", type=float, default=30.0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.monotonic()

    task_config = ArithmeticConfig()  # the default task: the one recipes train on
    task = ArithmeticTask(task_config)
    max_new_tokens = task.max_answer_chars() + 1
    dev = task.heldout(DEV_SLICE[1])[DEV_SLICE[0] :]
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2, {n_params:,} parameters; vocab {len(tokenizer)}; task {task_config}", flush=True)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    lr = args.lr
    eval_every = args.eval_every
    stream = task.stream()
    cursor = 0
    snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict()), 0, cursor)
    step = 0
    dev_acc = 0.0
    history: list[tuple[int, float]] = []
    reached = False
    model.train()
    while step < args.max_steps:
        if time.monotonic() - t_start > args.max_minutes * 60:
            break
        batch = [next(stream) for _ in range(args.batch_size)]
        cursor += args.batch_size
        input_ids, mask, labels = encode_batch(tokenizer, batch)
        for group in optim.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / args.warmup)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        step += 1
        if step % eval_every:
            continue
        dev_acc = greedy_accuracy(model, tokenizer, dev, max_new_tokens, batch_size=250)
        history.append((step, dev_acc))
        print(
            f"step {step:5d}  loss {loss.item():.4f}  dev greedy acc {dev_acc:.3f}  lr {lr:.2e}  "
            f"{time.monotonic() - t_start:6.1f}s",
            flush=True,
        )
        if args.target_low <= dev_acc <= args.target_high:
            reached = True
            break
        if dev_acc >= args.target_low - 0.1 and eval_every > args.eval_every_near:
            eval_every = args.eval_every_near  # accuracy moves fast here: look more often
            print(f"  near the target: eval every {eval_every} steps", flush=True)
        if dev_acc > args.target_high:
            model_state, optim_state, step, cursor = snapshot
            model.load_state_dict(model_state)
            optim.load_state_dict(optim_state)
            stream = task.stream(cursor)
            lr /= 2
            eval_every = max(2, eval_every // 2)
            print(f"  overshot: back to step {step}, lr {lr:.2e}, eval every {eval_every}", flush=True)
            continue
        snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict()), step, cursor)

    if not reached:
        print(
            f"error: dev accuracy did not reach [{args.target_low}, {args.target_high}] "
            f"(last {dev_acc:.3f} at step {step}); nothing saved",
            file=sys.stderr,
        )
        return 1

    model.eval()
    report = {n: greedy_accuracy(model, tokenizer, task.heldout(n), max_new_tokens) for n in (200, 400)}
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    meta = {
        "name": "tiny-arith",
        "built_by": "scripts/make_tiny_model.py",
        "task": {"kind": "arithmetic", **asdict(task_config), "operators": list(task_config.operators)},
        "prompt_format": "'<a><op><b>=' -> '<answer>' + EOS, e.g. '23+9=' -> '32'",
        "max_new_tokens": max_new_tokens,
        "seed": args.seed,
        "torch_threads": args.threads,
        "torch_version": torch.__version__,
        "parameters": n_params,
        "sft": {
            "steps": step,
            "batch_size": args.batch_size,
            "final_lr": lr,
            "prompts_consumed": cursor,
            "dev_slice": list(DEV_SLICE),
            "dev_greedy_accuracy": dev_acc,
            "target": [args.target_low, args.target_high],
            "history": history,
        },
        "heldout_greedy_accuracy": {str(n): acc for n, acc in report.items()},
    }
    (out / "relayrl_meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    # Check the saved directory the way users load it.
    reloaded, reloaded_tok = load_model_and_tokenizer(out)
    check = greedy_accuracy(reloaded, reloaded_tok, task.heldout(200), max_new_tokens)
    if abs(check - report[200]) > 1e-9:
        print(f"error: reloaded model scores {check:.3f}, before saving {report[200]:.3f}", file=sys.stderr)
        return 1
    for f in out.iterdir():
        f.chmod(0o644)  # save_pretrained may write 0600 files; the asset ships in the package
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"saved {out} ({size / 1e6:.2f} MB, {n_params:,} params) after {step} steps in "
        f"{time.monotonic() - t_start:.0f}s; held-out greedy accuracy: 200 → {report[200]:.3f}, "
        f"400 → {report[400]:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
