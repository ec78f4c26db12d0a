#!/usr/bin/env python
"""relayrl vs Hugging Face TRL's GRPOTrainer on one identical GRPO workload, on the CPU.

Both trainers start from the same weights (the shipped tiny model by default, `--model DIR` for
another Hugging Face model directory), train on the same arithmetic prompts in the same order
(relayrl's `ArithmeticTask` stream: "23+9=" -> "32"), score with the same reward (relayrl's
`exact_match`, called on a minimal trajectory), and use the same group size G, prompts per step,
max completion tokens, temperature, learning rate, optimizer (AdamW, betas 0.9/0.999, no weight
decay, constant LR, grad-norm clip 1.0), loss (token-level clipped policy gradient, clip
0.2/0.28, token-mean over the step = TRL's loss_type "dapo"), advantages (group mean/std = TRL's
scale_rewards "group"), no KL (beta 0) and number of optimizer steps. They run one after the
other in this process.

Printed for each: completions trained per second of training wall time (model loading and
held-out evaluation are outside the timed region), the wall time, and the greedy exact-match
accuracy on the same held-out prompts before and after, measured by the same function
(`relayrl.models.loading.greedy_accuracy`) on each trainer's own model object. Last line: the
completions/s ratio relayrl / TRL.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vs_trl.py --steps 20

Needs the `bench` extra (`pip install -c scripts/constraints.txt -e '.[local,bench]'`).
Differences the two cannot share are listed in benchmarks/README.md (relayrl samples up to
`rollout.max_staleness` versions behind the trainer; TRL is strictly on-policy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

# Before torch is imported anywhere: no hub traffic, no telemetry, bounded thread pools.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import relayrl  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from relayrl.tasks.arithmetic import ArithmeticTask
    from relayrl.types import Prompt

# Settings pinned identically on both sides (the rest of relayrl's config is the default recipe).
ADAM_BETAS = (0.9, 0.999)
CLIP_EPS_LOW = 0.2
CLIP_EPS_HIGH = 0.28
MAX_GRAD_NORM = 1.0
DIGITS = 2
OPERATORS = "+-"


@dataclass(slots=True, frozen=True)
class Workload:
    model_dir: Path
    steps: int
    num_generations: int
    prompts_per_step: int
    max_new_tokens: int
    learning_rate: float
    temperature: float
    seed: int
    heldout_size: int
    eval_max_new_tokens: int
    max_staleness: int | None
    trl_micro_batch: int
    threads: int
    relayrl_sets: tuple[str, ...] = ()

    @property
    def completions_per_step(self) -> int:
        return self.num_generations * self.prompts_per_step


@dataclass(slots=True)
class Outcome:
    name: str
    completions: int
    wall_s: float
    accuracy_before: float
    accuracy_after: float
    reward_mean_first: float | None
    reward_mean_last: float | None
    details: dict[str, object] = field(default_factory=dict)

    @property
    def completions_per_s(self) -> float:
        return self.completions / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def accuracy_gain(self) -> float:
        return self.accuracy_after - self.accuracy_before

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["completions_per_s"] = self.completions_per_s
        out["accuracy_gain"] = self.accuracy_gain
        return out


def _window_mean(values: list[float], first: bool, n: int = 5) -> float | None:
    if not values:
        return None
    part = values[:n] if first else values[-n:]
    return sum(part) / len(part)


def arithmetic_task(seed: int) -> ArithmeticTask:
    """The task exactly as relayrl's `build_task` makes it for `task.kind = "arithmetic"`."""
    from relayrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

    return ArithmeticTask(ArithmeticConfig(max_digits=DIGITS, operators=tuple(OPERATORS), seed=seed))


def accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, heldout: list[Prompt], w: Workload) -> float:
    from relayrl.models.loading import greedy_accuracy

    return greedy_accuracy(model, tokenizer, heldout, w.eval_max_new_tokens)


# -- relayrl ---------------------------------------------------------------------------------------
def relayrl_overrides(w: Workload, output_dir: Path) -> list[str]:
    """The `--set` overrides that make relayrl's default recipe run this workload."""
    sets = [
        "run.backend=local",
        "run.name=vs_trl",
        f"run.output_dir={json.dumps(str(output_dir))}",
        f"run.steps={w.steps}",
        f"run.seed={w.seed}",
        "task.kind=arithmetic",
        f"task.digits={DIGITS}",
        f"task.operators={json.dumps(OPERATORS)}",
        'task.reward_functions=["exact_match"]',
        'task.prompt_template="{text}"',  # the raw prompt text, as TRL gets it
        f"model.path={json.dumps(str(w.model_dir))}",
        'model.dtype="float32"',
        "model.chat_template=false",
        f"rollout.num_generations={w.num_generations}",
        f"rollout.groups_per_step={w.prompts_per_step}",
        f"rollout.max_new_tokens={w.max_new_tokens}",
        f"rollout.temperature={w.temperature}",
        "rollout.top_p=1.0",
        'algorithm.advantage="grpo"',
        "algorithm.dynamic_sampling=false",
        'algorithm.loss_aggregation="token_mean"',
        "algorithm.kl_beta=0.0",
        f"algorithm.clip_eps_low={CLIP_EPS_LOW}",
        f"algorithm.clip_eps_high={CLIP_EPS_HIGH}",
        f"train.learning_rate={w.learning_rate}",
        'train.lr_schedule="constant"',
        "train.warmup_steps=0",
        "train.weight_decay=0.0",
        f"train.adam_beta1={ADAM_BETAS[0]}",
        f"train.adam_beta2={ADAM_BETAS[1]}",
        f"train.max_grad_norm={MAX_GRAD_NORM}",
        "eval.enabled=false",  # held-out accuracy is measured outside the timed region, below
        "telemetry.sinks=[]",  # metrics.jsonl only, whatever the recipe adds
    ]
    if w.max_staleness is not None:
        sets.append(f"rollout.max_staleness={w.max_staleness}")
    return sets + list(w.relayrl_sets)


def run_relayrl(w: Workload, heldout: list[Prompt], workdir: Path) -> Outcome:
    import asyncio

    from transformers import PreTrainedModel

    from relayrl.recipes import default_recipe
    from relayrl.config.schema import load_config
    from relayrl.orchestrator.build import build_program

    cfg = load_config(default_recipe(), relayrl_overrides(w, workdir / "relayrl"))
    program = build_program(cfg, run_dir=workdir / "relayrl" / cfg.run.name)
    model = getattr(program.backend.trainer, "model", None)
    if not isinstance(model, PreTrainedModel):
        raise RuntimeError("relayrl's local trainer does not expose its model as `.model`")
    from relayrl.models.loading import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer(w.model_dir)  # same files the backend loaded
    before = accuracy(model, tokenizer, heldout, w)

    start = time.perf_counter()
    result = asyncio.run(program.run())
    wall = time.perf_counter() - start

    if result.summary["status"] != "completed" or len(result.results) != w.steps:
        raise RuntimeError(f"relayrl run did not complete {w.steps} steps: {result.summary['status']} {result.summary['error']}")
    after = accuracy(model, tokenizer, heldout, w)
    rewards = [float(r.metrics["reward_mean"]) for r in result.results if r.metrics.get("reward_mean") is not None]
    stale = [float(r.metrics["staleness_mean"]) for r in result.results if r.metrics.get("staleness_mean") is not None]
    s = result.summary
    return Outcome(
        name="relayrl",
        completions=result.ledger.trajectories_trained,
        wall_s=wall,
        accuracy_before=before,
        accuracy_after=after,
        reward_mean_first=_window_mean(rewards, first=True),
        reward_mean_last=_window_mean(rewards, first=False),
        details={
            "status": s["status"],
            "steps_completed": s["steps_completed"],
            "summary_wall_time_s": s["wall_time_s"],
            "trainer_busy_fraction": s["trainer_busy_fraction"],
            "staleness_mean": sum(stale) / len(stale) if stale else None,
            "max_staleness": cfg.rollout.max_staleness,
            "ledger": result.ledger.as_dict(),
        },
    )


# -- TRL -------------------------------------------------------------------------------------------
class ExactMatchReward:
    """TRL reward function that calls relayrl's `exact_match` on each completion text (TRL decodes
    up to and including the first EOS with skip_special_tokens, as relayrl's sampler does) and
    records each generation batch's mean reward."""

    __name__ = "exact_match"

    def __init__(self) -> None:
        self.batch_means: list[float] = []

    def __call__(self, prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
        from relayrl.rewards.registry import exact_match
        from relayrl.types import Prompt, Trajectory

        out = []
        for text, ans in zip(completions, answer, strict=True):
            traj = Trajectory(
                group_id=0, sample_index=0, prompt=Prompt("", "", ans), prompt_tokens=[], completion_tokens=[],
                sampler_logprobs=[], completion_text=text, policy_version=0, replica=0,
            )
            out.append(exact_match(traj))
        self.batch_means.append(sum(out) / len(out))
        return out


def run_trl(w: Workload, heldout: list[Prompt], workdir: Path) -> Outcome:
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.models.loading import load_model_and_tokenizer

    per_step = w.completions_per_step
    micro = w.trl_micro_batch or per_step
    if per_step % micro:
        raise SystemExit(f"error: --trl-micro-batch {micro} must divide G x prompts-per-step = {per_step}")

    model, tokenizer = load_model_and_tokenizer(w.model_dir)
    probe = "23+9="
    if tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
        # TRL tokenizes plain-text prompts with special tokens, relayrl without: prompts would differ.
        raise SystemExit(f"error: the tokenizer in {w.model_dir} adds special tokens to prompts; TRL and relayrl would see different prompts")
    before = accuracy(model, tokenizer, heldout, w)
    model.train()

    stream = arithmetic_task(w.seed).stream()
    train = [next(stream) for _ in range(w.steps * w.prompts_per_step)]  # relayrl's order
    dataset = Dataset.from_dict({"prompt": [p.text for p in train], "answer": [p.answer for p in train]})
    reward = ExactMatchReward()
    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        # batch: one generation batch of G x prompts-per-step completions per optimizer step
        num_generations=w.num_generations,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,  # steps_per_generation defaults to this
        max_steps=w.steps,
        num_iterations=1,
        shuffle_dataset=False,
        # sampling
        max_completion_length=w.max_new_tokens,
        temperature=w.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        # loss and optimizer
        loss_type="dapo",
        scale_rewards="group",
        beta=0.0,
        epsilon=CLIP_EPS_LOW,
        epsilon_high=CLIP_EPS_HIGH,
        mask_truncated_completions=False,
        learning_rate=w.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1],
        max_grad_norm=MAX_GRAD_NORM,
        # plain CPU float32, nothing on the side
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        gradient_checkpointing=False,  # deprecated alias of the above; TRL defaults it to True
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        seed=w.seed,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict despite logging_strategy="no"
    if getattr(trainer.model, "is_activation_checkpointing", False) or args.bf16:
        raise RuntimeError("TRL run is not plain float32 without activation checkpointing")

    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start

    if trainer.state.global_step != w.steps or len(reward.batch_means) != w.steps:
        raise RuntimeError(
            f"TRL ran {trainer.state.global_step} optimizer steps and {len(reward.batch_means)} generation batches, "
            f"expected {w.steps} of each"
        )
    trained = trainer.model
    after = accuracy(trained, tokenizer, heldout, w)
    return Outcome(
        name="TRL",
        completions=trainer.state.global_step * per_step,
        wall_s=wall,
        accuracy_before=before,
        accuracy_after=after,
        reward_mean_first=_window_mean(reward.batch_means, first=True),
        reward_mean_last=_window_mean(reward.batch_means, first=False),
        details={
            "trl_version": trl.__version__,
            "steps_completed": trainer.state.global_step,
            "generation_batches": len(reward.batch_means),
            "per_device_train_batch_size": micro,
            "gradient_accumulation_steps": per_step // micro,
        },
    )


# -- driver ----------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _line(o: Outcome) -> str:
    extra = ""
    if o.name == "relayrl":
        extra = (
            f"  staleness mean {_fmt(o.details.get('staleness_mean'), '.2f')} (max {o.details['max_staleness']})"  # type: ignore[arg-type]
            f"  trainer busy {o.details['trainer_busy_fraction']:.0%}"
        )
    return (
        f"{o.name:8s} {o.completions_per_s:8.1f} completions/s  ({o.completions} in {o.wall_s:6.1f}s)   "
        f"held-out acc {o.accuracy_before:.3f} -> {o.accuracy_after:.3f} ({o.accuracy_gain:+.3f})   "
        f"train reward first5 {_fmt(o.reward_mean_first, '.3f')} last5 {_fmt(o.reward_mean_last, '.3f')}   "
        f"load {o.details['loadavg_1min_before']:.1f}{extra}"
    )


def report(w: Workload, runs: list[dict[str, Outcome]], env: dict[str, str | None]) -> str:
    lines = [
        f"workload: {w.model_dir}  steps {w.steps}  G {w.num_generations}  prompts/step {w.prompts_per_step}  "
        f"max new tokens {w.max_new_tokens}  lr {w.learning_rate:g}  temperature {w.temperature:g}  "
        f"held-out {w.heldout_size} (greedy, {w.eval_max_new_tokens} tokens)",
        f"cpu: {os.cpu_count()} cores, torch threads {w.threads}, OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY') or 'unset'}",
    ]
    for i, run in enumerate(runs):
        prefix = f"[{i + 1}] " if len(runs) > 1 else ""
        lines.extend(prefix + _line(o) for o in run.values())
    names = [n for n in ("TRL", "relayrl") if any(n in run for run in runs)]
    if len(runs) > 1:
        for n in names:
            cps = [run[n].completions_per_s for run in runs if n in run]
            gains = [run[n].accuracy_gain for run in runs if n in run]
            lines.append(
                f"median {n:8s} {_median(cps):8.1f} completions/s  (min {min(cps):.1f}, max {max(cps):.1f})   "
                f"accuracy gain median {_median(gains):+.3f}"
            )
    cores = os.cpu_count() or 1
    peak = max(float(o.details["loadavg_1min_before"]) for run in runs for o in run.values())  # type: ignore[arg-type]
    if peak > 0.75 * cores:
        lines.append(
            f"note: 1-min load average reached {peak:.1f} on {cores} cores before a run: other processes compete "
            "for the CPU, so completions/s are noisy (see benchmarks/README.md)"
        )
    ratio = median_ratio(runs)
    if ratio is not None:
        gr = _median([run["relayrl"].accuracy_gain for run in runs if "relayrl" in run])
        gt = _median([run["TRL"].accuracy_gain for run in runs if "TRL" in run])
        what = " (medians)" if len(runs) > 1 else ""
        lines.append(f"completions/s ratio relayrl/TRL{what}: {ratio:.2f}   accuracy gain relayrl {gr:+.3f} vs TRL {gt:+.3f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="Hugging Face model directory (default: the shipped tiny model)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps for each trainer")
    ap.add_argument("--num-generations", type=int, default=16, help="G: completions per prompt")
    ap.add_argument("--prompts-per-step", type=int, default=32, help="prompts (groups) per optimizer step")
    ap.add_argument("--max-new-tokens", type=int, default=4, help="max completion tokens while training")
    ap.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (constant)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=200, help="held-out prompts for greedy accuracy")
    ap.add_argument("--eval-max-new-tokens", type=int, default=0, help="greedy tokens per held-out prompt (0: longest answer + EOS)")
    ap.add_argument("--max-staleness", type=int, default=None, help="relayrl's rollout.max_staleness (default: the recipe's)")
    ap.add_argument("--relayrl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra relayrl config override, applied last (repeatable; e.g. train.row_tokens=64)")
    ap.add_argument("--trl-micro-batch", type=int, default=0, help="TRL per_device_train_batch_size (0: the whole step in one)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (OMP_NUM_THREADS)")
    ap.add_argument("--only", choices=("both", "relayrl", "trl"), default="both")
    ap.add_argument("--order", choices=("trl-first", "relayrl-first"), default="trl-first", help="order of the first repeat (later repeats alternate)")
    ap.add_argument("--repeats", type=int, default=1, help="run the pair this many times (alternating order); medians are reported")
    ap.add_argument("--workdir", type=Path, default=None, help="keep run directories here (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    for name in ("steps", "num_generations", "prompts_per_step", "max_new_tokens", "heldout", "threads", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_generations < 2:
        ap.error("--num-generations must be >= 2 (group-relative advantages)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices inside TRL/transformers
    from relayrl.models.loading import shipped_model_dir

    try:
        model_dir = (args.model or shipped_model_dir()).resolve()
    except FileNotFoundError as exc:
        print(f"error: {exc}; or pass --model DIR", file=sys.stderr)
        return 2
    if not (model_dir / "config.json").is_file():
        print(f"error: not a Hugging Face model directory (no config.json): {model_dir}", file=sys.stderr)
        return 2
    task = arithmetic_task(args.seed)
    w = Workload(
        model_dir=model_dir, steps=args.steps, num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens, learning_rate=args.lr,
        temperature=args.temperature, seed=args.seed, heldout_size=args.heldout,
        eval_max_new_tokens=args.eval_max_new_tokens or task.max_answer_chars() + 1,
        max_staleness=args.max_staleness, trl_micro_batch=args.trl_micro_batch, threads=args.threads,
        relayrl_sets=tuple(args.relayrl_set),
    )
    heldout = task.heldout(w.heldout_size)
    runners = {"trl": run_trl, "relayrl": run_relayrl}
    order = ["trl", "relayrl"] if args.order == "trl-first" else ["relayrl", "trl"]
    if args.only != "both":
        order = [args.only]
    runs: list[dict[str, Outcome]] = []
    with tempfile.TemporaryDirectory(prefix="relayrl-vs-trl-") as tmp:
        workdir = args.workdir or Path(tmp)
        for rep in range(args.repeats):
            outcomes: dict[str, Outcome] = {}
            for name in order if rep % 2 == 0 else order[::-1]:  # alternate to cancel order effects
                if not args.json:
                    print(f"[{rep + 1}/{args.repeats}] running {name} ...", file=sys.stderr, flush=True)
                load_before = os.getloadavg()[0]
                o = runners[name](w, heldout, workdir)
                o.details["loadavg_1min_before"] = load_before
                o.details["loadavg_1min_after"] = os.getloadavg()[0]
                outcomes[o.name] = o
            runs.append({k: outcomes[k] for k in ("TRL", "relayrl") if k in outcomes})
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if args.json:
        payload: dict[str, object] = {
            "workload": {**asdict(w), "model_dir": str(w.model_dir)},
            "env": env,
            "cpu_count": os.cpu_count(),
            "runs": [{k: o.as_dict() for k, o in run.items()} for run in runs],
        }
        ratio = median_ratio(runs)
        if ratio is not None:
            payload["completions_per_s_ratio"] = ratio
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(report(w, runs, env))
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_ratio(runs: list[dict[str, Outcome]]) -> float | None:
    """median relayrl completions/s over median TRL completions/s (None unless both ran)."""
    r = [run["relayrl"].completions_per_s for run in runs if "relayrl" in run]
    t = [run["TRL"].completions_per_s for run in runs if "TRL" in run]
    if not r or not t:
        return None
    return _median(r) / _median(t) if _median(t) else float("inf")


if __name__ == "__main__":
    raise SystemExit(main())
