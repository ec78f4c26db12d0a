"""Packed collation + log-probs: packed per-token log-probs equal unpacked ones, and the packed
tensors line up (loss mask on exactly the completion tokens, restarting positions, advantages and
sampler log-probs on the positions that predict their token).

The model comes from a factory `(attn_implementation) -> model`, so the shipped tiny model can be
swapped in for the random Qwen2 below.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.backends.local.collate import PackedBatch, TorchCollator, block_causal_mask
from relayrl.backends.local.logprobs import token_logprobs, unpacked_token_logprobs
from relayrl.types import MicroBatch, PaddingStats, Prompt, Trajectory

from modelutil import random_qwen2

torch.set_num_threads(1)

VOCAB = 32
PAD = 0
ModelFactory = Callable[[str], torch.nn.Module]


def tiny_qwen2(attn_implementation: str) -> torch.nn.Module:
    return random_qwen2(VOCAB, attn_implementation=attn_implementation)


MODEL_FACTORIES: dict[str, ModelFactory] = {"qwen2-random": tiny_qwen2}


def make_trajectory(
    rng: random.Random, i: int, n_prompt: int, n_comp: int, vocab: int = VOCAB
) -> Trajectory:
    completion = [rng.randrange(1, vocab) for _ in range(n_comp)]
    return Trajectory(
        group_id=i // 4,
        sample_index=i % 4,
        prompt=Prompt(prompt_id=f"p{i}", text="", answer=""),
        prompt_tokens=[rng.randrange(1, vocab) for _ in range(n_prompt)],
        completion_tokens=completion,
        sampler_logprobs=[-rng.random() * 3 for _ in completion],
        completion_text="",
        policy_version=0,
        replica=0,
        reward=rng.random(),
        advantage=rng.uniform(-2, 2),
    )


def make_microbatch(trajectories: list[Trajectory], rows: list[list[int]]) -> MicroBatch:
    row_tokens = max(sum(trajectories[i].num_tokens for i in row) for row in rows)
    real = sum(t.num_tokens for t in trajectories)
    return MicroBatch(
        step=0,
        index=0,
        final=True,
        trajectories=trajectories,
        rows=rows,
        padding=PaddingStats(rows=len(rows), row_tokens=row_tokens, real_tokens=real, sequences=len(trajectories)),
        num_tokens=real,
    )


# (prompt, completion) lengths; one trajectory with an empty completion; rows hold 2-3 sequences.
LENGTHS = [(3, 5), (1, 2), (4, 6), (2, 1), (5, 3), (2, 4), (3, 0), (1, 7)]
ROWS = [[0, 1], [2, 3, 4], [5, 6, 7]]


@pytest.fixture
def microbatch() -> MicroBatch:
    rng = random.Random(0)
    trajectories = [make_trajectory(rng, i, p, c) for i, (p, c) in enumerate(LENGTHS)]
    return make_microbatch(trajectories, ROWS)


def _max_error(batch: PackedBatch, packed: torch.Tensor, unpacked: list[torch.Tensor]) -> float:
    got = batch.split_by_sequence(packed)
    assert [g.numel() for g in got] == [u.numel() for u in unpacked]
    return max((g - u).abs().max().item() for g, u in zip(got, unpacked) if u.numel())


@pytest.mark.parametrize("factory_name", sorted(MODEL_FACTORIES))
@pytest.mark.parametrize(
    ("attn", "mask_kind", "pad_rows_to"),
    [("sdpa", "bool", "longest"), ("sdpa", "float", 24), ("eager", "float", "longest")],
)
def test_packed_logprobs_equal_unpacked(
    microbatch: MicroBatch, factory_name: str, attn: str, mask_kind: str, pad_rows_to: str | int
) -> None:
    model = MODEL_FACTORIES[factory_name](attn)
    batch = TorchCollator(PAD, mask_kind=mask_kind, pad_rows_to=pad_rows_to).collate(microbatch)  # type: ignore[arg-type]
    with torch.no_grad():
        logp, ent = token_logprobs(model, batch)
        ref_logp, ref_ent = unpacked_token_logprobs(model, microbatch.trajectories)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert _max_error(batch, logp, ref_logp) < 1e-5
    assert _max_error(batch, ent, ref_ent) < 1e-5


def test_packed_gradients_equal_unpacked(microbatch: MicroBatch) -> None:
    """Backward through the packed batch (padding included) is finite and equals the unpacked sum."""
    model = tiny_qwen2("sdpa")
    batch = TorchCollator(PAD, pad_rows_to=24).collate(microbatch)
    logp, _ = token_logprobs(model, batch)
    (logp * batch.loss_mask * batch.advantages).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    ref, _ = unpacked_token_logprobs(model, microbatch.trajectories)
    sum(r.sum() * t.advantage for r, t in zip(ref, microbatch.trajectories)).backward()  # type: ignore[union-attr]
    for packed, p in zip(packed_grads, model.parameters()):
        assert torch.isfinite(packed).all()
        torch.testing.assert_close(packed, p.grad, atol=1e-5, rtol=1e-4)


def test_eager_with_bool_mask_is_refused(microbatch: MicroBatch) -> None:
    model = tiny_qwen2("eager")
    batch = TorchCollator(PAD, mask_kind="bool").collate(microbatch)
    with pytest.raises(ValueError, match="mask_kind='float'"):
        token_logprobs(model, batch)


def test_layout(microbatch: MicroBatch) -> None:
    batch = TorchCollator(PAD).collate(microbatch)
    trajs = microbatch.trajectories
    longest = max(sum(trajs[i].num_tokens for i in row) for row in ROWS)
    assert batch.shape == (len(ROWS), longest)  # padded to the longest row only
    assert batch.attention_mask.shape == (len(ROWS), 1, longest, longest)
    assert batch.attention_mask.dtype == torch.bool
    assert batch.num_real_tokens == sum(t.num_tokens for t in trajs)
    assert batch.num_loss_tokens == int(batch.loss_mask.sum().item()) == sum(len(t.completion_tokens) for t in trajs)
    assert batch.num_sequences == len(trajs)

    for r, row in enumerate(ROWS):
        start = 0
        for i in row:
            t = trajs[i]
            n, p = t.num_tokens, len(t.prompt_tokens)
            assert batch.input_ids[r, start : start + n].tolist() == t.prompt_tokens + t.completion_tokens
            assert batch.position_ids[r, start : start + n].tolist() == list(range(n))  # restarts
            assert (batch.seq_index[r, start : start + n] == i).all()
            # the loss mask is 1 exactly on the positions predicting completion tokens
            expected = [0.0] * (p - 1) + [1.0] * len(t.completion_tokens) + [0.0]
            assert batch.loss_mask[r, start : start + n].tolist() == expected
            start += n
        assert (batch.seq_index[r, start:] == -1).all()
        assert (batch.loss_mask[r, start:] == 0).all()
        assert (batch.input_ids[r, start:] == PAD).all()

    for i, t in enumerate(trajs):
        assert batch.split_by_sequence(batch.target_ids)[i].tolist() == t.completion_tokens
        torch.testing.assert_close(
            batch.split_by_sequence(batch.old_logprobs)[i], torch.tensor(t.sampler_logprobs, dtype=torch.float32)
        )
        adv = batch.split_by_sequence(batch.advantages)[i]
        assert torch.allclose(adv, torch.full_like(adv, t.advantage))
    assert (batch.advantages[batch.loss_mask == 0] == 0).all()


def test_mask_blocks_across_sequences_and_pads_attend_to_themselves() -> None:
    seq = torch.tensor([[0, 0, 1, 1, 1, -1, -1]])
    mask = block_causal_mask(seq)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_float_mask_is_additive(microbatch: MicroBatch) -> None:
    b = TorchCollator(PAD).collate(microbatch)
    f = TorchCollator(PAD, mask_kind="float").collate(microbatch)
    assert f.attention_mask.dtype == torch.float32
    assert torch.equal(f.attention_mask == 0, b.attention_mask)
    assert (f.attention_mask[~b.attention_mask] == torch.finfo(torch.float32).min).all()


def test_bad_microbatches_are_named(microbatch: MicroBatch) -> None:
    with pytest.raises(ValueError, match="over pad_rows_to=8"):
        TorchCollator(PAD, pad_rows_to=8).collate(microbatch)
    microbatch.trajectories[2].sampler_logprobs.pop()
    with pytest.raises(ValueError, match="trajectory 2 .*5 sampler_logprobs for 6 completion tokens"):
        TorchCollator(PAD).collate(microbatch)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_layout_invariants_hold_for_any_packing(lengths: list[tuple[int, int]], seed: int) -> None:
    rng = random.Random(seed)
    trajs = [make_trajectory(rng, i, p, c) for i, (p, c) in enumerate(lengths)]
    order = list(range(len(trajs)))
    rng.shuffle(order)
    rows: list[list[int]] = []
    while order:
        k = rng.randint(1, 3)
        rows.append(order[:k])
        order = order[k:]
    batch = TorchCollator(PAD).collate(make_microbatch(trajs, rows))
    for i, t in enumerate(trajs):
        assert batch.split_by_sequence(batch.target_ids)[i].tolist() == t.completion_tokens
        assert batch.split_by_sequence(batch.old_logprobs)[i].tolist() == pytest.approx(t.sampler_logprobs)
    # a position starts a sequence exactly where its position id is 0 (and it is real)
    starts = (batch.position_ids == 0) & (batch.seq_index >= 0)
    assert int(starts.sum()) == len(trajs)
    # every real position attends to its own sequence's prefix only: row sums equal position + 1
    attended = batch.attention_mask[:, 0].sum(-1)
    real = batch.seq_index >= 0
    assert torch.equal(attended[real], batch.position_ids[real] + 1)
    assert (attended[~real] == 1).all()


def test_float_mask_follows_model_dtype(microbatch: MicroBatch) -> None:
    """A float32 mask on a float64 model is rebuilt in the model's dtype (sdpa needs it)."""
    model = tiny_qwen2("sdpa").double()
    batch = TorchCollator(PAD, mask_kind="float").collate(microbatch)
    seen: list[torch.dtype] = []

    def spy(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        mask = kwargs.get("attention_mask")
        assert isinstance(mask, torch.Tensor)
        seen.append(mask.dtype)

    handle = model.register_forward_pre_hook(spy, with_kwargs=True)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    handle.remove()
    assert seen == [torch.float64]
    with torch.no_grad():
        ref, _ = unpacked_token_logprobs(model, microbatch.trajectories)
    assert _max_error(batch, logp, ref) < 1e-5


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_packed_logprobs_equal_unpacked_on_the_shipped_model(mask_kind: str) -> None:
    """The production path (sdpa) on the shipped model, with real arithmetic prompts packed
    several to a row: per-token log-probs equal the one-sequence-at-a-time ones (atol 1e-5)."""
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
    from relayrl.packing import build_microbatch, plan
    from relayrl.tasks.arithmetic import ArithmeticTask

    model, tok = load_model_and_tokenizer(shipped_model_dir())
    rng = random.Random(1)
    trajectories = []
    for i, prompt in zip(range(12), ArithmeticTask().stream()):
        ids = tok(prompt.text, add_special_tokens=False)["input_ids"]
        completion = tok(prompt.answer if i % 3 else str(rng.randrange(200)), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        trajectories.append(Trajectory(group_id=i, sample_index=0, prompt=prompt, prompt_tokens=ids, completion_tokens=completion,
                                       sampler_logprobs=[0.0] * len(completion), completion_text="", policy_version=0, replica=0))
    mb = build_microbatch(0, 0, trajectories, plan(trajectories, 40, 8))
    assert max(len(row) for row in mb.rows) >= 3  # really packed
    batch = TorchCollator(tok.pad_token_id, mask_kind=mask_kind).collate(mb)  # type: ignore[arg-type]
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
        ref_logp, _ = unpacked_token_logprobs(model, mb.trajectories)
    assert _max_error(batch, logp, ref_logp) < 1e-5
