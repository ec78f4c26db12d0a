"""The local PyTorch backend on the shipped tiny model: a short real run, the trainer's update
and metrics, sampler↔trainer agreement, weight sync, held-out evaluation."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.precision import LOGPROB_DIFF_MEAN_BOUND
from relayrl.backends.local.trainer import LocalTrainer, TrainerSettings, lr_multiplier
from relayrl.config.schema import load_config
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.orchestrator.build import build_program
from relayrl.recipes import default_recipe
from relayrl.types import TrainBatch
from support.simutil import StopAt, Stopped, run_checked

QUICK = [
    "run.backend=local",
    "task.kind=arithmetic",
    "run.steps=3",
    "rollout.num_generations=4",
    "rollout.groups_per_step=4",
    "task.heldout_size=16",
    "orchestrator.release_memory=false",
]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    tmp = tmp_path_factory.mktemp("local")
    cfg = load_config(None, [*QUICK, "rollout.max_staleness=0", "train.learning_rate=1e-3"])
    program = build_program(cfg, run_dir=tmp / "run")
    return tmp / "run", run_checked(program, timeout=120)


def test_short_local_run_trains_and_reports(short_run: tuple[Path, object]) -> None:
    run_dir, result = short_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/learning_rate",
        "train/clip_frac_low",
        "train/clip_frac_high",
        "train/clip_frac_dual",
        "train/entropy_mean",
        "train/logprob_diff_mean",
        "train/logprob_diff_max",
        "train/ratio_mean",
        "train/tokens",
    ):
        assert key in rows[0], key
    assert any(r["train/grad_norm"] > 0 for r in rows)  # a step whose groups all tie has no gradient
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 3]


def test_on_policy_sampler_and_trainer_agree(short_run: tuple[Path, object]) -> None:
    run_dir, _ = short_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # max_staleness = 0: every step trains on its own version's samples, so the trainer's
    # recomputed log-probs (packed forward) equal the sampler's (KV-cache decoding)
    assert all(r["staleness_max"] == 0 for r in rows)
    assert max(r["train/logprob_diff_max"] for r in rows) < 1e-3
    assert max(r["train/logprob_diff_mean"] for r in rows) < LOGPROB_DIFF_MEAN_BOUND[torch.float32]  # (bfloat16's: see test_precision_run)
    assert all(abs(r["train/ratio_mean"] - 1.0) < 1e-3 for r in rows)


def test_on_policy_ratio_is_one_with_top_p(tmp_path: Path) -> None:
    """top_p < 1 truncates what is sampled, not the log-probs the sampler reports: at staleness 0
    the trainer's ratio to the sampler's log-probs is 1 (a nucleus-renormalised "old" would put
    it near 0.7 on this model at top_p 0.7)."""
    cfg = load_config(None, [*QUICK, "run.steps=2", "rollout.max_staleness=0", "rollout.top_p=0.7", "eval.enabled=false"])
    run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=120)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["train/logprob_diff_max"] for r in rows) < 1e-3
    assert all(abs(r["train/ratio_mean"] - 1.0) < 1e-3 for r in rows)


def test_kl_reference_and_truncated_is_in_a_real_run(tmp_path: Path) -> None:
    """KL to a frozen reference and truncated IS, end to end on the local backend: the first
    step's policy is the reference (KL 0), later steps have moved away from it (KL > 0); the IS
    weights are reported, capped, and 1 where sampler and trainer agree."""
    cfg = load_config(
        None,
        [
            *QUICK,
            "run.steps=4",
            "train.learning_rate=5e-3",
            "rollout.max_staleness=1",
            "algorithm.kl_beta=0.1",
            "algorithm.tis_cap=1.5",
            "eval.enabled=false",
        ],
    )
    run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=120)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["train/completion_tokens"] > 0]
    assert len(trained) == 4
    assert trained[0]["train/kl_mean"] == pytest.approx(0.0, abs=1e-6)  # version 0 is the reference
    assert max(r["train/kl_mean"] for r in trained[1:]) > 0
    for r in trained:
        assert 0 < r["train/tis_weight_mean"] <= 1.5 + 1e-6
        if r["staleness_max"] == 0:  # on-policy: trainer and sampler agree, weight exp(0) = 1
            assert r["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert any(r["staleness_max"] == 1 and abs(r["train/tis_weight_mean"] - 1.0) > 1e-4 for r in trained)
    # decoupled PPO: the clip never binds, so no clip fraction is logged; the cap's share is
    for r in trained:
        assert "train/clip_frac_high" not in r and "train/clip_frac_low" not in r and "train/clip_frac_dual" not in r
        assert 0.0 <= r["train/tis_capped_frac"] <= 1.0


def test_trainer_update_changes_weights_and_fills_the_slot() -> None:
    model, tok = load_model_and_tokenizer(shipped_model_dir())
    settings = TrainerSettings(learning_rate=1e-2, total_steps=4, loss=LossConfig(), warmup_steps=2)
    trainer = LocalTrainer(model, settings)
    batch = _tiny_batch(tok, (1.0, -1.0))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    async def main() -> tuple[int, dict[str, float], int]:
        await trainer.train_step(batch)
        version = await trainer.optim_step()
        metrics = await trainer.get_metrics()
        weights = await trainer.export_weights()
        await trainer.close()
        return version, metrics, weights.version

    version, metrics, exported = asyncio.run(main())
    assert version == 1 and exported == 1 and metrics["step"] == 0.0
    assert metrics["learning_rate"] == pytest.approx(1e-2 * lr_multiplier(0, settings))
    assert metrics["completion_tokens"] == 4.0 and metrics["microbatches"] == 1.0
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "optim_step did not change any weight"


def _tiny_batch(tok: Any, advantages: tuple[float, float]) -> TrainBatch:
    """A collated one-step micro-batch of two completions of "12+7=" with these advantages."""
    from relayrl.backends.local.collate import TorchCollator
    from relayrl.packing import build_microbatch, plan
    from relayrl.types import Prompt
    from support.trajectories import trajectory

    prompt_ids = tok("12+7=", add_special_tokens=False)["input_ids"]
    trajs = [
        trajectory(
            sample=i,
            prompt=Prompt("p", "12+7=", "19"),
            prompt_tokens=prompt_ids,
            completion_tokens=tok(c, add_special_tokens=False)["input_ids"],
            sampler_logprobs=[-1.0] * len(c),
            text=c,
            advantage=a,
        )
        for i, (c, a) in enumerate(zip(("19", "18"), advantages, strict=True))
    ]
    mb = build_microbatch(0, 0, trajs, plan(trajs, 64, 4))
    mb.payload = TorchCollator(pad_token_id=tok.pad_token_id).collate(mb)
    return mb.train_batch()


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_a_non_finite_loss_never_reaches_the_weights(policy: str) -> None:
    from relayrl.backends.local.trainer import NonFiniteStepError, TrainerCompute

    model, tok = load_model_and_tokenizer(shipped_model_dir())
    settings = TrainerSettings(learning_rate=1e-2, total_steps=4, loss=LossConfig(), on_nonfinite=policy)
    trainer = TrainerCompute(model, settings)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train_step(_tiny_batch(tok, (float("nan"), -1.0)))
    if policy == "fail":
        with pytest.raises(NonFiniteStepError, match=r"step 0: the loss \(nan\)"):
            trainer.optim_step()
    else:
        assert trainer.optim_step() == 1  # the step commits (its update skipped) and the run goes on
        slot = trainer.metrics()
        assert slot["skipped_nonfinite"] == 1.0 and slot["nonfinite_steps"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    assert not trainer._optimizer.state  # no NaN reached the optimizer's moments either
    if policy == "skip":  # a finite step afterwards updates as usual
        trainer.train_step(_tiny_batch(tok, (1.0, -1.0)))
        assert trainer.optim_step() == 2
        assert trainer.metrics()["skipped_nonfinite"] == 0.0 and trainer.metrics()["nonfinite_steps"] == 1.0
        assert all(torch.isfinite(v).all() for v in model.state_dict().values())
        assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_lr_schedule() -> None:
    s = TrainerSettings(learning_rate=1.0, total_steps=12, loss=LossConfig(), warmup_steps=2, lr_schedule="linear")
    assert [lr_multiplier(i, s) for i in (0, 1)] == [0.5, 1.0]
    assert lr_multiplier(2, s) == 1.0 and lr_multiplier(7, s) == pytest.approx(0.5) and lr_multiplier(12, s) == 0.0
    c = TrainerSettings(learning_rate=1.0, total_steps=10, loss=LossConfig(), lr_schedule="cosine")
    assert lr_multiplier(0, c) == 1.0 and lr_multiplier(5, c) == pytest.approx(0.5) and lr_multiplier(10, c) == pytest.approx(0.0)


def test_default_recipe_is_the_local_backend_on_the_shipped_model() -> None:
    cfg = load_config(default_recipe())
    assert cfg.run.backend == "local" and cfg.task.kind == "arithmetic" and cfg.model.path == ""


@pytest.mark.parametrize(
    ("overrides", "trainer_threads", "sampler_threads"),
    [([], 2, 2), (["rollout.num_samplers=3"], 1, 1), (["train.torch_threads=3", "rollout.sampler_threads=1"], 3, 1)],
)
def test_threads_are_split_between_trainer_and_samplers(
    overrides: list[str], trainer_threads: int, sampler_threads: int, tmp_path: Path
) -> None:
    """By default the trainer and the samplers, which compute at the same time, share the
    process's intra-op threads (4 here) instead of each taking all of them."""
    from relayrl.backends.registry import build_backend

    cfg = load_config(None, [*QUICK, "eval.enabled=false", *overrides])
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        backend = build_backend(cfg, threading.Event(), evaluate=False)
    finally:
        torch.set_num_threads(before)
    try:
        assert backend.trainer.settings.torch_threads == trainer_threads  # type: ignore[attr-defined]
        assert [s.torch_threads for s in backend.samplers] == [sampler_threads] * cfg.rollout.num_samplers  # type: ignore[attr-defined]
    finally:

        async def close() -> None:
            await backend.trainer.close()
            for s in backend.samplers:
                await s.close()

        asyncio.run(close())


def test_split_threads() -> None:
    from relayrl.backends.local.build import split_threads

    assert split_threads(2, 0, 0, 1) == (1, 1)
    assert split_threads(16, 0, 0, 1) == (8, 8)
    assert split_threads(16, 0, 0, 3) == (4, 4)
    assert split_threads(16, 10, 0, 2) == (10, 3)  # the samplers share what the trainer leaves
    assert split_threads(16, 0, 4, 2) == (8, 4)
    assert split_threads(2, 4, 0, 1) == (4, 1)  # never below one thread
    assert split_threads(16, 3, 5, 1) == (3, 5)


def test_missing_model_directory_is_named(tmp_path: Path) -> None:
    cfg = load_config(None, [*QUICK, f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(FileNotFoundError, match="nope"):
        build_program(cfg, run_dir=tmp_path / "run")


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_torch_run_killed_and_resumed_matches_the_uninterrupted_run(tmp_path: Path, world_size: int) -> None:
    """max_staleness 0, one torch thread: a run that crashes after step k and is resumed from its
    checkpoint trains exactly what the uninterrupted run trains — identical rewards and token
    counts per step, losses within 1e-6 — because each request samples from an RNG of its own
    (run seed, the prompt's index in the prompt stream, version), which a resume reproduces, rather
    than a replica's stream. The same with a sharded trainer of 2 ranks (sharded checkpoints)."""
    sets = [*QUICK, "run.steps=5", "rollout.max_staleness=0", "train.torch_threads=1", "rollout.sampler_threads=1"]
    sets += [f"train.world_size={world_size}"]
    sets += ["orchestrator.checkpoint_every=1", "eval.enabled=false", "train.learning_rate=1e-3"]

    def rows(run_dir: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    run_checked(build_program(load_config(None, sets), run_dir=tmp_path / "whole"), timeout=120)
    whole = rows(tmp_path / "whole")
    for crash in (2, 4):
        run_dir = tmp_path / f"crash{crash}"
        with pytest.raises(Stopped, match=f"stopped at step {crash}"):
            asyncio.run(build_program(load_config(None, sets), [StopAt(crash)], run_dir=run_dir).run())
        run_checked(build_program(load_config(None, sets), run_dir=run_dir, resume=True), timeout=120)
        resumed = rows(run_dir)
        assert [r["step"] for r in resumed] == [r["step"] for r in whole] == list(range(1, 6))
        for a, b in zip(whole, resumed, strict=True):
            for key in ("reward_mean", "reward_std", "tokens", "train/completion_tokens", "num_trajectories"):
                assert a[key] == b[key], (crash, a["step"], key, a[key], b[key])
            assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6), (crash, a["step"])
