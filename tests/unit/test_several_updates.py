"""Several optimizer updates per step (`train.ppo_epochs`, `train.minibatches_per_step`): the
packing never mixes minibatches and carries each one's normalisers; the trainer makes
ppo_epochs × minibatches updates inside one `optim_step`, the ones after the first against the
policy before the step's first update (so the clip binds), each normalised by its own minibatch;
the default (1, 1) keeps nothing and reports nothing new."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.collate import PackedBatch, TorchCollator
from relayrl.backends.local.logprobs import token_logprobs
from relayrl.backends.local.trainer import TrainerCompute, TrainerSettings
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.packing import build_microbatch, minibatch_slices, plan
from relayrl.types import Prompt, TrainBatch, Trajectory
from support.trajectories import trajectory

torch.set_num_threads(1)

# (prompt, completions) per group; group g's completions get advantages +1, -1, ...
GROUPS = [("12+7=", ("19", "18")), ("30-4=", ("26", "2")), ("5+5=", ("10", "11")), ("44-1=", ("43", "4"))]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return load_model_and_tokenizer(shipped_model_dir())


def _trajectories(tok: Any) -> list[Trajectory]:
    out = []
    for g, (prompt, completions) in enumerate(GROUPS):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        for i, c in enumerate(completions):
            comp = tok(c, add_special_tokens=False)["input_ids"]
            out.append(
                trajectory(group=g, sample=i, prompt=Prompt(f"p{g}", prompt, ""), prompt_tokens=ids, completion_tokens=comp,
                           advantage=1.0 if i == 0 else -1.0)
            )  # fmt: skip
    return out


def _batches(model: Any, tok: Any, trajs: list[Trajectory], minibatches: int, rows: int = 1) -> list[TrainBatch]:
    """The step's train batches in plan order, their sampler log-probs the model's own (on-policy)."""
    p = plan(trajs, 64, rows, share_prompt=True, minibatches=minibatches)
    collator = TorchCollator(pad_token_id=tok.pad_token_id)
    out = []
    for k in range(len(p.microbatches)):
        mb = build_microbatch(1, k, trajs, p)
        batch = collator.collate(mb)
        assert isinstance(batch, PackedBatch)
        with torch.no_grad():
            batch.old_logprobs = token_logprobs(model, batch, 1.0)[0].detach().clone()
        mb.payload = batch
        out.append(mb.train_batch())
    return out


def _settings(**kw: Any) -> TrainerSettings:
    loss = kw.pop("loss", LossConfig())
    return TrainerSettings(learning_rate=kw.pop("learning_rate", 1e-2), total_steps=4, loss=loss, **kw)


def _adam_steps(trainer: TrainerCompute) -> int:
    steps = {int(s["step"]) for s in trainer._optimizer.state.values()}
    assert len(steps) == 1
    return steps.pop()


def test_minibatch_packing_keeps_groups_whole_and_carries_each_minibatch_normalisers(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    trajs = _trajectories(tok)
    assert minibatch_slices(trajs, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]  # groups 0, 2 | 1, 3
    p = plan(trajs, 64, 1, share_prompt=True, minibatches=2)
    assert p.minibatch == sorted(p.minibatch) and set(p.minibatch) == {0, 1}
    for k in range(len(p.microbatches)):
        mb = build_microbatch(1, k, trajs, p)
        groups = {t.group_id for t in mb.trajectories}
        assert groups <= ({0, 2} if mb.minibatch == 0 else {1, 3})
        members = [t for t in trajs if t.group_id in ({0, 2} if mb.minibatch == 0 else {1, 3})]
        assert mb.step_completion_tokens == sum(t.policy_tokens for t in members)
        assert mb.step_sequences == len(members)
        assert mb.train_batch().minibatch == mb.minibatch
    assert build_microbatch(1, len(p.microbatches) - 1, trajs, p).final
    one = plan(trajs, 64, 1, share_prompt=True)  # the default: the step's normalisers, as before
    assert not one.minibatch and build_microbatch(1, 0, trajs, one).step_completion_tokens == sum(t.policy_tokens for t in trajs)


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_two_epochs_make_two_updates_and_the_clip_binds_on_the_second(tiny: tuple[Any, Any], tis_cap: float | None) -> None:
    model, tok = tiny
    model = copy.deepcopy(model)
    trajs = _trajectories(tok)
    batches = _batches(model, tok, trajs, minibatches=1)
    trainer = TrainerCompute(model, _settings(learning_rate=0.05, ppo_epochs=2, loss=LossConfig(tis_cap=tis_cap)))
    for tb in batches:
        trainer.train_step(tb)
    assert trainer.optim_step() == 1  # one commit, one version
    slot = trainer.metrics()
    assert slot["updates"] == 2.0 and _adam_steps(trainer) == 2
    assert slot["microbatches"] == len(batches)
    assert slot["ratio_mean_epoch1"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the first update's ratio is 1
    assert abs(slot["ratio_mean_epoch2"] - 1.0) > 1e-3  # the second runs on a moved policy
    clipped = slot["clip_frac_low_epoch2"] + slot["clip_frac_high_epoch2"]
    assert clipped > 0.0  # against the policy before the step: the clip binds
    if tis_cap is None:
        assert slot["clip_frac_low_epoch1"] + slot["clip_frac_high_epoch1"] == 0.0
    else:  # decoupled PPO: r = 1 on the first update, no clip fraction to report there
        assert "clip_frac_low_epoch1" not in slot and "tis_weight_mean" in slot
    assert slot["ppo_kl"] > 0.0 and slot["ppo_kl"] == slot["ppo_kl_epoch2"]
    assert not trainer._kept  # nothing kept past the step


def test_two_minibatches_are_two_updates_each_normalised_by_its_slice(tiny: tuple[Any, Any]) -> None:
    """One step with minibatches_per_step = 2 ends where two default steps end, one per minibatch
    (each planned alone: normalised by itself), with the same optimizer."""
    base, tok = tiny
    trajs = _trajectories(tok)
    model_a, model_b = copy.deepcopy(base), copy.deepcopy(base)
    a = TrainerCompute(model_a, _settings(minibatches_per_step=2))
    for tb in _batches(model_a, tok, trajs, minibatches=2):
        a.train_step(tb)
    assert a.optim_step() == 1
    assert a.metrics()["updates"] == 2.0 and _adam_steps(a) == 2

    b = TrainerCompute(model_b, _settings())
    for members in minibatch_slices(trajs, 2):
        sub = [trajs[i] for i in members]
        for tb in _batches(base, tok, sub, minibatches=1):  # the sampler's log-probs: the step's start, as for a
            b.train_step(tb)
        b.optim_step()
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6), name
    assert any(not torch.equal(pa, pb) for pa, pb in zip(model_a.parameters(), base.parameters(), strict=True))


def test_the_default_is_one_update_and_keeps_nothing(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    model = copy.deepcopy(model)
    trainer = TrainerCompute(model, _settings())
    for tb in _batches(model, tok, _trajectories(tok), minibatches=1):
        trainer.train_step(tb)
        assert not trainer._kept
    trainer.optim_step()
    slot = trainer.metrics()
    assert _adam_steps(trainer) == 1
    assert not any(k == "updates" or k.startswith("ppo_kl") or k.endswith(("_epoch1", "_epoch2")) for k in slot)


def test_a_statistic_reported_by_some_updates_is_averaged_over_theirs(tiny: tuple[Any, Any]) -> None:
    """Decoupled PPO reports clip fractions only once π_prox is not the current policy: with two
    minibatches, on the second update alone. They are that update's, not diluted by the first
    update's tokens (which report none)."""
    base, tok = tiny
    trajs = _trajectories(tok)
    loss = LossConfig(tis_cap=2.0)
    model_a = copy.deepcopy(base)
    a = TrainerCompute(model_a, _settings(learning_rate=0.05, minibatches_per_step=2, loss=loss))
    batches = _batches(model_a, tok, trajs, minibatches=2)
    for tb in batches:
        a.train_step(tb)
    a.optim_step()
    slot = a.metrics()

    # the second update by hand: the policy after the first (one default step on minibatch 0) against π_prox = base
    model_b = copy.deepcopy(base)
    b = TrainerCompute(model_b, _settings(learning_rate=0.05, loss=loss))
    first, second = (sorted(minibatch_slices(trajs, 2)[k]) for k in (0, 1))
    for tb in _batches(base, tok, [trajs[i] for i in first], minibatches=1):
        b.train_step(tb)
    b.optim_step()
    low = high = tokens = 0.0
    for tb in (t for t in batches if t.minibatch == 1):
        batch = tb.payload
        assert isinstance(batch, PackedBatch)
        with torch.no_grad():
            prox = token_logprobs(base, batch, 1.0)[0]
            logp = token_logprobs(model_b, batch, 1.0)[0]
        from relayrl.algorithms.losses import policy_loss

        out = policy_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, batch.seq_index, loss, prox_logprobs=prox)
        assert out.clip_frac_low is not None and out.clip_frac_high is not None
        low += out.clip_frac_low * out.num_tokens
        high += out.clip_frac_high * out.num_tokens
        tokens += out.num_tokens
    assert len(second) and tokens > 0 and low + high > 0  # the clip binds on the second update
    assert slot["clip_frac_low"] == pytest.approx(low / tokens, abs=1e-6)
    assert slot["clip_frac_high"] == pytest.approx(high / tokens, abs=1e-6)
