#!/usr/bin/env python
"""relayrl vs Hugging Face TRL's GRPOTrainer on one identical GRPO workload, on the CPU.

Two modes. By default both trainers start from the shipped tiny model (`--model DIR` for another
Hugging Face model directory) on raw arithmetic prompts (relayrl's `ArithmeticTask` stream:
"23+9=" -> "32") scored by `exact_match`. With `--recipe FILE` (e.g. relayrl's
src/relayrl/recipes/smollm2.toml) the workload is the recipe's, read from the file at run time:
its model (`model.path`, or `model.package` + `model.gguf_file`: a GGUF model is converted once, in
this process, to a Hugging Face directory that both sides load), its chat template, its task
(`task.kind` and its settings, `task.prompt_template`), its reward functions (weights, clip) and its
sampling temperature / top-p and learning rate unless given here; `--steps`, G, prompts per step
and max new tokens stay this script's.

Both sides train on the same prompts in the same order (the first steps x prompts of relayrl's
task stream), score with the same reward functions (relayrl's, called on a minimal trajectory
for TRL) and use the same group size G, prompts per step, max completion tokens, temperature,
top-p, learning rate, optimizer (AdamW, betas 0.9/0.999, no weight decay, constant LR, grad-norm
clip 1.0), loss (token-level clipped policy gradient, clip 0.2/0.28, token-mean over the step =
TRL's loss_type "dapo"), advantages (group mean/std = TRL's scale_rewards "group"), no KL (beta 0)
and number of optimizer steps. They run one after the other in this process.

Printed for each: completions trained per second of training wall time (model loading and
held-out evaluation are outside the timed region), the wall time, the held-out accuracy before
and after (greedy; the task's own correctness check, `relayrl.tasks.build.correctness_check`, on
the same held-out prompts, each trainer's own model object) and the **work bound**: the step's
training time (forward/backward/optimizer of the step's tokens) and generation time, each
measured alone at the threads that side computes with, and the completions/s they allow (TRL runs
them one after the other: 1 / (train + generate); relayrl overlaps them on their own cores:
1 / max(train, generate)). Last line: the completions/s ratio relayrl / TRL.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vs_trl.py --steps 20
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vs_trl.py --recipe src/relayrl/recipes/smollm2.toml \
        --steps 8 --num-generations 8 --prompts-per-step 8 --max-new-tokens 8 --repeats 3

Needs the `bench` extra (`pip install -c scripts/constraints.txt -e '.[local,bench]'`; a recipe's
task may need `tasks`, a GGUF model `gguf`). Differences the two cannot share are listed in
benchmarks/README.md (relayrl samples up to `rollout.max_staleness` versions behind the trainer;
TRL is strictly on-policy).
"""

from __future__ import annotations

import argparse
import gc
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
    from collections.abc import Callable, Sequence

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from relayrl.config.schema import Config
    from relayrl.rewards.registry import ResolvedReward
    from relayrl.types import Prompt, SampleRequest, TrainBatch

# Settings pinned identically on both sides (the rest of relayrl's config is the recipe's).
ADAM_BETAS = (0.9, 0.999)
CLIP_EPS_LOW = 0.2
CLIP_EPS_HIGH = 0.28
MAX_GRAD_NORM = 1.0
DIGITS = 2  # the tiny mode's task
OPERATORS = "+-"
TINY_LR = 2e-4
TINY_TEMPERATURE = 1.0


@dataclass(slots=True, frozen=True)
class Workload:
    model_dir: Path  # a Hugging Face directory (a recipe's GGUF model: its conversion)
    recipe: Path | None  # None: the tiny mode (the default recipe with the arithmetic task pinned)
    steps: int
    num_generations: int
    prompts_per_step: int
    max_new_tokens: int
    learning_rate: float
    temperature: float
    top_p: float
    seed: int
    heldout_size: int | None  # None: the recipe's task.heldout_size
    eval_max_new_tokens: int
    max_staleness: int | None
    trl_micro_batch: int
    threads: int
    relayrl_sets: tuple[str, ...] = ()
    bound: bool = True

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
    # the work bound: one step's training and generation seconds, each alone (None: not measured)
    train_step_s: float | None = None
    generate_step_s: float | None = None
    overlapped: bool = False  # relayrl: training and generation overlap (bound = max), TRL: in turn (sum)

    @property
    def completions_per_s(self) -> float:
        return self.completions / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def accuracy_gain(self) -> float:
        return self.accuracy_after - self.accuracy_before

    def bound_per_s(self, per_step: int) -> float | None:
        """The completions/s its training and generation times allow."""
        if self.train_step_s is None or self.generate_step_s is None:
            return None
        s = max(self.train_step_s, self.generate_step_s) if self.overlapped else self.train_step_s + self.generate_step_s
        return per_step / s if s > 0 else None

    def as_dict(self, per_step: int) -> dict[str, object]:
        out = asdict(self)
        out["completions_per_s"] = self.completions_per_s
        out["accuracy_gain"] = self.accuracy_gain
        out["bound_completions_per_s"] = self.bound_per_s(per_step)
        return out


def _window_mean(values: list[float], first: bool, n: int = 5) -> float | None:
    if not values:
        return None
    part = values[:n] if first else values[-n:]
    return sum(part) / len(part)


# -- the shared setup --------------------------------------------------------------------------------
def relayrl_overrides(w: Workload, output_dir: Path) -> list[str]:
    """The `--set` overrides that make relayrl's recipe (the default one in the tiny mode) run this
    workload."""
    sets = [
        "run.backend=local",
        "run.name=vs_trl",
        f"run.output_dir={json.dumps(str(output_dir))}",
        f"run.steps={w.steps}",
        f"run.seed={w.seed}",
        'model.dtype="float32"',
        f"rollout.num_generations={w.num_generations}",
        f"rollout.groups_per_step={w.prompts_per_step}",
        f"rollout.max_new_tokens={w.max_new_tokens}",
        f"rollout.temperature={w.temperature}",
        f"rollout.top_p={w.top_p}",
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
        # nothing written at the end (TRL: save_strategy "no"): on SmolLM2 the final checkpoint
        # (1.6 GB) and model export take ~15 s of an 8-step run
        "run.save_model=false",
        "orchestrator.checkpoint_every=0",
    ]
    if w.recipe is None:
        sets += [
            "task.kind=arithmetic",
            f"task.digits={DIGITS}",
            f"task.operators={json.dumps(OPERATORS)}",
            'task.reward_functions=["exact_match"]',
            'task.prompt_template="{text}"',  # the raw prompt text, as TRL gets it
            f"model.path={json.dumps(str(w.model_dir))}",
            "model.chat_template=false",
        ]
    if w.heldout_size is not None:
        sets.append(f"task.heldout_size={w.heldout_size}")
    if w.max_staleness is not None:
        sets.append(f"rollout.max_staleness={w.max_staleness}")
    return sets + list(w.relayrl_sets)


def workload_config(w: Workload, output_dir: Path) -> Config:
    """relayrl's config of this workload; with a recipe, its model is `w.model_dir` (for a GGUF
    model: the Hugging Face conversion both sides load)."""
    from relayrl.config.schema import load_config
    from relayrl.recipes import default_recipe

    cfg = load_config(w.recipe or default_recipe(), relayrl_overrides(w, output_dir))
    if w.recipe is not None:
        model = cfg.model.model_copy(update={"path": str(w.model_dir), "package": None, "gguf_file": None})
        cfg = cfg.model_copy(update={"model": model})
    return cfg


def recipe_model_dir(recipe: Path, cache: Path) -> Path:
    """The recipe's model as a Hugging Face directory: its `model.path` as it is, or its GGUF file
    (`model.package` / `model.path` + `model.gguf_file`) converted once into `cache` as the vLLM
    engine's is (relayrl.models.gguf_dir: dequantized to float32, reused when it is there)."""
    from relayrl.backends.local.build import model_dir
    from relayrl.config.schema import load_config
    from relayrl.models.gguf_dir import gguf_directory

    cfg = load_config(recipe)
    source = model_dir(cfg)
    if cfg.model.gguf_file is None:
        return source
    return gguf_directory(source, cfg.model.gguf_file, cache)


@dataclass(slots=True)
class Shared:
    """What both sides get from relayrl's config: the prompts, how they are tokenized, the reward
    functions and the task's correctness check."""

    cfg: Config
    train: list[Prompt]
    heldout: list[Prompt]
    rewards: list[ResolvedReward]

    @property
    def chat(self) -> bool:
        return self.cfg.model.chat_template

    def content(self, p: Prompt) -> str:
        return self.cfg.task.prompt_template.format(text=p.text)


def shared_setup(w: Workload, workdir: Path) -> Shared:
    from relayrl.rewards.registry import resolve_rewards
    from relayrl.tasks.build import build_task

    cfg = workload_config(w, workdir / "relayrl")
    task = build_task(cfg)
    train = [next(task.stream) for _ in range(w.steps * w.prompts_per_step)]  # relayrl's order
    rewards = resolve_rewards(cfg.task.reward_functions, cfg.task.reward_weights)
    return Shared(cfg=cfg, train=train, heldout=task.heldout, rewards=rewards)


def reward_total(rewards: Sequence[ResolvedReward], clip: float, traj: object) -> float:
    """The trajectory's reward as relayrl's scorer makes it: each function's value clipped to
    ±clip (when > 0), weighted, summed; a function that raises gives 0 (a failed call)."""
    from relayrl.rewards.registry import as_reward

    total = 0.0
    for r in rewards:
        try:
            x = as_reward(r.fn(traj))  # type: ignore[operator]
        except Exception:
            continue
        if clip:
            x = max(-clip, min(clip, x))
        total += r.weight * x
    return total


def minimal_trajectory(prompt: Prompt, text: str) -> object:
    from relayrl.types import Trajectory

    return Trajectory(
        group_id=0,
        sample_index=0,
        prompt=prompt,
        prompt_tokens=[],
        completion_tokens=[],
        sampler_logprobs=[],
        completion_text=text,
        policy_version=0,
        replica=0,
    )


def heldout_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, shared: Shared, max_new_tokens: int, batch: int = 64
) -> float:
    """Share of the held-out prompts whose greedy completion the task's own correctness check
    counts correct; prompts tokenized as relayrl's sampler gets them (its template, its chat
    template), completions decoded up to the first EOS."""
    import torch

    from relayrl.backends.local.build import Decode, make_tokenize
    from relayrl.tasks.build import correctness_check

    encode = make_tokenize(shared.cfg, tokenizer)
    decode = Decode(tokenizer)
    check = correctness_check(shared.cfg.task.kind).fn
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.inference_mode():
            for start in range(0, len(shared.heldout), batch):
                chunk = shared.heldout[start : start + batch]
                ids = [encode(p.text) for p in chunk]
                width = max(map(len, ids))
                input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], dtype=torch.long)
                mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=torch.long)
                out = model.generate(  # type: ignore[operator]
                    input_ids=input_ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=pad,
                )
                for p, row in zip(chunk, out[:, width:].tolist(), strict=True):
                    try:
                        correct += check(minimal_trajectory(p, decode(row))) == 1.0  # type: ignore[arg-type]
                    except Exception:
                        pass  # a check that fails: not correct
    finally:
        model.train(was_training)
    return correct / len(shared.heldout)


# -- relayrl ---------------------------------------------------------------------------------------
class Recorder:
    """Records, during a relayrl run, the micro-batches of each step the trainer trains and the
    request lists its samplers get, so that one step of each can be timed alone after the run."""

    def __init__(self) -> None:
        self.steps: dict[int, list[TrainBatch]] = {}
        self.requests: list[list[SampleRequest]] = []
        self.uninstall: Callable[[], None] = lambda: None

    def install(self, program: object) -> None:
        backend = program.backend  # type: ignore[attr-defined]
        compute = backend.trainer.compute
        train_step = compute.train_step

        def recording_train_step(tb: TrainBatch, abort: object = None) -> None:
            self.steps.setdefault(tb.step, []).append(tb)
            for old in [s for s in self.steps if s < tb.step - 1]:
                del self.steps[old]
            train_step(tb, abort)

        compute.train_step = recording_train_step
        self.uninstall = lambda: delattr(compute, "train_step")  # back to the class's method
        for sampler in backend.samplers:
            sc = sampler.compute
            generate = sc.generate

            def recording_generate(requests: Sequence[SampleRequest], abort: object = None, _g: Callable[..., object] = generate) -> object:
                if len(self.requests) < 64:
                    self.requests.append(list(requests))
                return _g(requests, abort)

            sc.generate = recording_generate
        trainer_uninstall = self.uninstall

        def uninstall() -> None:
            trainer_uninstall()
            for sampler in backend.samplers:
                del sampler.compute.generate

        self.uninstall = uninstall


def time_relayrl_alone(program: object, rec: Recorder, w: Workload) -> tuple[float | None, float | None]:
    """(one step's training seconds, one step's generation seconds), each run alone in this
    thread at the threads relayrl gives that worker in the run: the last complete recorded step's
    micro-batches through `train_step` + `optim_step` (the model is updated: run after the
    held-out accuracy), and the first recorded sampler calls covering prompts-per-step groups."""
    import torch

    backend = program.backend  # type: ignore[attr-defined]
    compute = backend.trainer.compute
    sampler = backend.samplers[0]
    before = torch.get_num_threads()
    train_s = gen_s = None
    rec.uninstall()  # replay through the workers' own methods, recording nothing more
    try:
        done = sorted(rec.steps)
        if done:
            batches = rec.steps[done[-2] if len(done) > 1 else done[-1]]
            torch.set_num_threads(compute.settings.torch_threads or before)
            start = time.perf_counter()
            for tb in batches:
                compute.train_step(tb)
            compute.optim_step()
            train_s = time.perf_counter() - start
        calls, groups = [], 0
        for requests in rec.requests:
            if groups >= w.prompts_per_step:
                break
            calls.append(requests)
            groups += len(requests)
        if calls:
            torch.set_num_threads(sampler.torch_threads or before)
            start = time.perf_counter()
            for requests in calls:
                sampler.compute.generate(requests)
            gen_s = (time.perf_counter() - start) * w.prompts_per_step / groups
    finally:
        torch.set_num_threads(before)
    return train_s, gen_s


def run_relayrl(w: Workload, shared: Shared, workdir: Path) -> Outcome:
    import asyncio

    from transformers import PreTrainedModel

    from relayrl.orchestrator.build import build_program

    cfg = shared.cfg
    program = build_program(cfg, run_dir=workdir / "relayrl" / cfg.run.name)
    model = getattr(program.backend.trainer, "model", None)
    if not isinstance(model, PreTrainedModel):
        raise RuntimeError("relayrl's local trainer does not expose its model as `.model`")
    from relayrl.models.loading import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer(w.model_dir)  # same files the backend loaded
    before = heldout_accuracy(model, tokenizer, shared, w.eval_max_new_tokens)
    rec = Recorder()
    if w.bound:
        rec.install(program)

    start = time.perf_counter()
    result = asyncio.run(program.run())
    wall = time.perf_counter() - start

    if result.summary["status"] != "completed" or len(result.results) != w.steps:
        raise RuntimeError(f"relayrl run did not complete {w.steps} steps: {result.summary['status']} {result.summary['error']}")
    after = heldout_accuracy(model, tokenizer, shared, w.eval_max_new_tokens)
    train_s, gen_s = time_relayrl_alone(program, rec, w) if w.bound else (None, None)
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
            "trainer_threads": program.backend.trainer.compute.settings.torch_threads,
            "sampler_threads": program.backend.samplers[0].torch_threads,
            "ledger": result.ledger.as_dict(),
        },
        train_step_s=train_s,
        generate_step_s=gen_s,
        overlapped=True,
    )


# -- TRL -------------------------------------------------------------------------------------------
class RelayrlReward:
    """TRL reward function: relayrl's reward functions (weighted, clipped, as its scorer sums them)
    on each completion text (TRL decodes up to and including the first EOS with
    skip_special_tokens, as relayrl's sampler does); records each generation batch's mean."""

    __name__ = "relayrl_reward"

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.batch_means: list[float] = []

    def __call__(self, prompts: list[object], completions: list[object], index: list[int], **_: object) -> list[float]:
        out = []
        for c, i in zip(completions, index, strict=True):
            text = c if isinstance(c, str) else c[-1]["content"]  # type: ignore[index]  # conversational: [message]
            traj = minimal_trajectory(self.shared.train[i], text)
            out.append(reward_total(self.shared.rewards, self.shared.cfg.task.reward_clip, traj))
        self.batch_means.append(sum(out) / len(out))
        return out


def trl_prompts(shared: Shared, tokenizer: PreTrainedTokenizerBase) -> list[object]:
    """TRL's `prompt` column: the recipe's text as a user message after the recipe's worked
    examples (`task.few_shot`; TRL applies the chat template as relayrl does), or the raw text.
    Stops if TRL would tokenize any prompt differently."""
    from relayrl.backends.local.build import make_tokenize

    encode = make_tokenize(shared.cfg, tokenizer)
    template = shared.cfg.task.prompt_template
    examples: list[dict[str, str]] = []  # task.few_shot: earlier turns of every chat, as relayrl's prompt encoder puts them
    for question, answer in shared.cfg.task.few_shot:
        examples += [{"role": "user", "content": template.format(text=question)}, {"role": "assistant", "content": answer}]
    out: list[object] = []
    for p in shared.train:
        content = shared.content(p)
        if shared.chat:
            messages = [*examples, {"role": "user", "content": content}]
            enc = tokenizer.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True, return_dict=True)
            theirs = list(enc["input_ids"][0])
            out.append(messages)
        else:
            theirs = tokenizer(content)["input_ids"]  # TRL tokenizes plain text with special tokens
            out.append(content)
        if theirs != encode(p.text):
            raise SystemExit(
                f"error: TRL would tokenize prompt {p.prompt_id!r} differently from relayrl ({theirs[:8]}... vs {encode(p.text)[:8]}...)"
            )
    return out


def run_trl(w: Workload, shared: Shared, workdir: Path) -> Outcome:
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
    prompts = trl_prompts(shared, tokenizer)
    before = heldout_accuracy(model, tokenizer, shared, w.eval_max_new_tokens)
    model.train()

    dataset = Dataset.from_dict({"prompt": prompts, "index": list(range(len(prompts)))})
    reward = RelayrlReward(shared)
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
        top_p=w.top_p,
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
        gradient_checkpointing=False,  # deprecated alias of the above; TRL defaults it on
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
    generating = [0.0]  # TRL generates (and scores) inside its training step, in turn with training
    generate = trainer._generate_and_score_completions

    def timed_generate(inputs: object) -> object:
        start = time.perf_counter()
        try:
            return generate(inputs)
        finally:
            generating[0] += time.perf_counter() - start

    trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign]

    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start

    if trainer.state.global_step != w.steps or len(reward.batch_means) != w.steps:
        raise RuntimeError(
            f"TRL ran {trainer.state.global_step} optimizer steps and {len(reward.batch_means)} generation batches, "
            f"expected {w.steps} of each"
        )
    trained = trainer.model
    after = heldout_accuracy(trained, tokenizer, shared, w.eval_max_new_tokens)
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
        # TRL does one thing at a time: its in-run split is its alone split (training = the rest)
        train_step_s=(wall - generating[0]) / w.steps,
        generate_step_s=generating[0] / w.steps,
        overlapped=False,
    )


# -- driver ----------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _line(o: Outcome, per_step: int) -> str:
    extra = ""
    if o.name == "relayrl":
        extra = (
            f"  staleness mean {_fmt(o.details.get('staleness_mean'), '.2f')} (max {o.details['max_staleness']})"  # type: ignore[arg-type]
            f"  trainer busy {o.details['trainer_busy_fraction']:.0%}"
        )
    bound = o.bound_per_s(per_step)
    work = ""
    if bound is not None:
        how = "max" if o.overlapped else "sum"
        work = (
            f"\n{'':8s} bound: train {o.train_step_s:.2f}s + generate {o.generate_step_s:.2f}s a step alone ({how}) "
            f"-> {bound:.1f} completions/s; measured {o.completions_per_s / bound:.0%} of it"
        )
    return (
        f"{o.name:8s} {o.completions_per_s:8.2f} completions/s  ({o.completions} in {o.wall_s:6.1f}s)   "
        f"held-out acc {o.accuracy_before:.3f} -> {o.accuracy_after:.3f} ({o.accuracy_gain:+.3f})   "
        f"train reward first5 {_fmt(o.reward_mean_first, '.3f')} last5 {_fmt(o.reward_mean_last, '.3f')}   "
        f"load {o.details['loadavg_1min_before']:.1f}{extra}{work}"
    )


def report(w: Workload, shared: Shared, runs: list[dict[str, Outcome]], env: dict[str, str | None]) -> str:
    t = shared.cfg.task
    what = (
        f"recipe {w.recipe} (task {t.kind}{' ' + t.dataset if t.dataset else ''}, chat template {shared.chat})" if w.recipe else "tiny mode"
    )
    lines = [
        f"workload: {what}  model {w.model_dir}  steps {w.steps}  G {w.num_generations}  prompts/step {w.prompts_per_step}  "
        f"max new tokens {w.max_new_tokens}  lr {w.learning_rate:g}  temperature {w.temperature:g}  top-p {w.top_p:g}  "
        f"held-out {len(shared.heldout)} (greedy, {w.eval_max_new_tokens} tokens)",
        f"cpu: {os.cpu_count()} cores, torch threads {w.threads}, OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY') or 'unset'}",
    ]
    per_step = w.completions_per_step
    for i, run in enumerate(runs):
        prefix = f"[{i + 1}] " if len(runs) > 1 else ""
        lines.extend(prefix + _line(o, per_step) for o in run.values())
    names = [n for n in ("TRL", "relayrl") if any(n in run for run in runs)]
    if len(runs) > 1:
        for n in names:
            cps = [run[n].completions_per_s for run in runs if n in run]
            gains = [run[n].accuracy_gain for run in runs if n in run]
            bounds = [b for run in runs if n in run and (b := run[n].bound_per_s(per_step)) is not None]
            bound = f"   bound median {_median(bounds):.1f} (measured {_median(cps) / _median(bounds):.0%} of it)" if bounds else ""
            lines.append(
                f"median {n:8s} {_median(cps):8.2f} completions/s  (min {min(cps):.2f}, max {max(cps):.2f})   "
                f"accuracy gain median {_median(gains):+.3f}{bound}"
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
        bound = ""
        rb = [b for run in runs if "relayrl" in run and (b := run["relayrl"].bound_per_s(per_step)) is not None]
        tb = [b for run in runs if "TRL" in run and (b := run["TRL"].bound_per_s(per_step)) is not None]
        if rb and tb:
            bound = f"   bound ratio {_median(rb) / _median(tb):.2f}"
        lines.append(f"completions/s ratio relayrl/TRL{what}: {ratio:.2f}{bound}   accuracy gain relayrl {gr:+.3f} vs TRL {gt:+.3f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--recipe",
        type=Path,
        default=None,
        help="a relayrl recipe whose model, chat template, task, rewards and sampling to use (e.g. src/relayrl/recipes/smollm2.toml)",
    )
    ap.add_argument("--model", type=Path, default=None, help="Hugging Face model directory (default: the shipped tiny model; the recipe's)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps for each trainer")
    ap.add_argument("--num-generations", type=int, default=16, help="G: completions per prompt")
    ap.add_argument("--prompts-per-step", type=int, default=32, help="prompts (groups) per optimizer step")
    ap.add_argument("--max-new-tokens", type=int, default=4, help="max completion tokens while training")
    ap.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate (constant; default {TINY_LR:g}, the recipe's)")
    ap.add_argument("--temperature", type=float, default=None, help=f"sampling temperature (default {TINY_TEMPERATURE:g}, the recipe's)")
    ap.add_argument("--top-p", type=float, default=None, help="sampling top-p (default 1.0, the recipe's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=None, help="held-out prompts for accuracy (default 200, the recipe's task.heldout_size)")
    ap.add_argument(
        "--eval-max-new-tokens",
        type=int,
        default=0,
        help="greedy tokens per held-out prompt (0: longest answer + EOS; the recipe's eval.max_new_tokens)",
    )
    ap.add_argument("--max-staleness", type=int, default=None, help="relayrl's rollout.max_staleness (default: the recipe's)")
    ap.add_argument(
        "--relayrl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra relayrl config override, applied last (repeatable; e.g. train.row_tokens=64)",
    )
    ap.add_argument("--trl-micro-batch", type=int, default=0, help="TRL per_device_train_batch_size (0: the whole step in one)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (OMP_NUM_THREADS)")
    ap.add_argument("--no-bound", action="store_true", help="skip measuring relayrl's training and generation steps alone after its run")
    ap.add_argument("--only", choices=("both", "relayrl", "trl"), default="both")
    ap.add_argument(
        "--order", choices=("trl-first", "relayrl-first"), default="trl-first", help="order of the first repeat (later repeats alternate)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="run the pair this many times (alternating order); medians are reported")
    ap.add_argument("--workdir", type=Path, default=None, help="keep run directories here (default: a temporary directory)")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(tempfile.gettempdir()) / "relayrl-vs-trl-models",
        help="where a recipe's GGUF model is converted to a Hugging Face directory (reused)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    for name in ("steps", "num_generations", "prompts_per_step", "max_new_tokens", "threads", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heldout is not None and args.heldout < 1:
        ap.error("--heldout must be >= 1")
    if args.num_generations < 2:
        ap.error("--num-generations must be >= 2 (group-relative advantages)")
    if args.recipe is not None and not args.recipe.is_file():
        ap.error(f"--recipe: no such file {args.recipe}")
    return args


def make_workload(args: argparse.Namespace) -> Workload:
    from relayrl.models.loading import shipped_model_dir

    recipe_cfg = None
    if args.recipe is not None:
        from relayrl.config.schema import load_config

        recipe_cfg = load_config(args.recipe)
        model_dir = (args.model or recipe_model_dir(args.recipe, args.cache)).resolve()
    else:
        model_dir = (args.model or shipped_model_dir()).resolve()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {model_dir}")

    def pick(given: object, recipe_value: object, tiny: object) -> object:
        return given if given is not None else recipe_value if recipe_cfg is not None else tiny

    heldout = args.heldout if args.heldout is not None else (None if recipe_cfg is not None else 200)
    return Workload(
        model_dir=model_dir,
        recipe=args.recipe.resolve() if args.recipe else None,
        steps=args.steps,
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        max_new_tokens=args.max_new_tokens,
        learning_rate=float(pick(args.lr, recipe_cfg and recipe_cfg.train.learning_rate, TINY_LR)),  # type: ignore[arg-type]
        temperature=float(pick(args.temperature, recipe_cfg and recipe_cfg.rollout.temperature, TINY_TEMPERATURE)),  # type: ignore[arg-type]
        top_p=float(pick(args.top_p, recipe_cfg and recipe_cfg.rollout.top_p, 1.0)),  # type: ignore[arg-type]
        seed=args.seed,
        heldout_size=heldout,
        eval_max_new_tokens=args.eval_max_new_tokens or (recipe_cfg.eval.max_new_tokens if recipe_cfg else DIGITS + 2),
        max_staleness=args.max_staleness,
        trl_micro_batch=args.trl_micro_batch,
        threads=args.threads,
        relayrl_sets=tuple(args.relayrl_set),
        bound=not args.no_bound,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    from relayrl.errors import UserError

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices inside TRL/transformers
    try:
        w = make_workload(args)
    except (FileNotFoundError, UserError) as exc:
        print(f"error: {exc}; or pass --model DIR", file=sys.stderr)
        return 2
    runners = {"trl": run_trl, "relayrl": run_relayrl}
    order = ["trl", "relayrl"] if args.order == "trl-first" else ["relayrl", "trl"]
    if args.only != "both":
        order = [args.only]
    runs: list[dict[str, Outcome]] = []
    with tempfile.TemporaryDirectory(prefix="relayrl-vs-trl-") as tmp:
        workdir = args.workdir or Path(tmp)
        try:
            shared = shared_setup(w, workdir)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for rep in range(args.repeats):
            outcomes: dict[str, Outcome] = {}
            for name in order if rep % 2 == 0 else order[::-1]:  # alternate to cancel order effects
                if not args.json:
                    print(f"[{rep + 1}/{args.repeats}] running {name} ... (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
                load_before = os.getloadavg()[0]
                o = runners[name](w, shared, workdir)
                gc.collect()  # the run's models and optimizer states (cycles through TRL's callbacks, relayrl's workers)
                o.details["loadavg_1min_before"] = load_before
                o.details["loadavg_1min_after"] = os.getloadavg()[0]
                outcomes[o.name] = o
                if not args.json:  # each run's figures as they come (the report follows at the end)
                    print(f"[{rep + 1}/{args.repeats}] " + _line(o, w.completions_per_step), file=sys.stderr, flush=True)
            runs.append({k: outcomes[k] for k in ("TRL", "relayrl") if k in outcomes})
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if args.json:
        payload: dict[str, object] = {
            "workload": {**asdict(w), "model_dir": str(w.model_dir), "recipe": str(w.recipe) if w.recipe else None},
            "env": env,
            "cpu_count": os.cpu_count(),
            "runs": [{k: o.as_dict(w.completions_per_step) for k, o in run.items()} for run in runs],
        }
        ratio = median_ratio(runs)
        if ratio is not None:
            payload["completions_per_s_ratio"] = ratio
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(report(w, shared, runs, env))
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
