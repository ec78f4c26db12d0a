"""Packed collation + log-probs: packed per-token log-probs (and gradients) equal unpacked ones,
with and without prompt sharing, and the packed tensors line up (positions, segments, the
position that predicts each completion token, advantages and sampler log-probs).

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

from relayrl.backends.local.collate import PackedBatch, TorchCollator, prefix_tree_mask
from relayrl.backends.local.logprobs import token_logprobs, unpacked_token_logprobs
from relayrl.packing import layout_tokens
from relayrl.types import MicroBatch, Prompt, Trajectory
from support.modelutil import PAD, VOCAB, tiny_qwen2
from support.trajectories import make_microbatch, trajectory

torch.set_num_threads(1)

ModelFactory = Callable[[str], torch.nn.Module]


MODEL_FACTORIES: dict[str, ModelFactory] = {"qwen2-random": tiny_qwen2}


def make_trajectory(
    rng: random.Random,
    i: int,
    n_prompt: int,
    n_comp: int,
    vocab: int = VOCAB,
    group_id: int | None = None,
    prompt_tokens: list[int] | None = None,
) -> Trajectory:
    completion = [rng.randrange(1, vocab) for _ in range(n_comp)]
    return trajectory(
        group=i if group_id is None else group_id,
        sample=i,
        prompt=Prompt(prompt_id=f"p{i}", text="", answer=""),
        prompt_tokens=prompt_tokens if prompt_tokens is not None else [rng.randrange(1, vocab) for _ in range(n_prompt)],
        completion_tokens=completion,
        sampler_logprobs=[-rng.random() * 3 for _ in completion],
        text="",
        reward=rng.random(),
        advantage=rng.uniform(-2, 2),
    )


def make_groups(rng: random.Random, groups: list[tuple[int, list[int]]]) -> list[Trajectory]:
    """Trajectories of groups given as (prompt length, completion lengths): the completions of
    a group share one prompt, as a sampler's group does."""
    trajectories: list[Trajectory] = []
    for g, (n_prompt, completions) in enumerate(groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(n_prompt)]
        for n_comp in completions:
            trajectories.append(make_trajectory(rng, len(trajectories), n_prompt, n_comp, group_id=g, prompt_tokens=prompt))
    return trajectories


# groups as (prompt length, completion lengths): one empty completion; groups 0 and 1 are split
# over rows, and rows hold segments of one to three groups.
GROUPS = [(3, [5, 2, 4]), (4, [1, 6, 0, 3]), (2, [2, 7])]
ROWS = [[0, 1, 3, 4], [2, 7, 8, 5], [6]]


@pytest.fixture(params=[False, True], ids=["own-prompt", "shared-prompt"])
def microbatch(request: pytest.FixtureRequest) -> MicroBatch:
    trajectories = make_groups(random.Random(0), GROUPS)
    return make_microbatch(trajectories, ROWS, share_prompt=request.param)


def _max_error(batch: PackedBatch, packed: torch.Tensor, unpacked: list[torch.Tensor]) -> float:
    got = batch.split_by_sequence(packed)
    assert [g.numel() for g in got] == [u.numel() for u in unpacked]
    return max((g - u).abs().max().item() for g, u in zip(got, unpacked) if u.numel())


@pytest.mark.parametrize("factory_name", sorted(MODEL_FACTORIES))
@pytest.mark.parametrize(
    ("attn", "mask_kind", "pad_rows_to"),
    [("sdpa", "bool", "longest"), ("sdpa", "float", 32), ("eager", "float", "longest")],
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
    batch = TorchCollator(PAD, pad_rows_to=32).collate(microbatch)
    logp, _ = token_logprobs(model, batch)
    (logp * batch.advantages).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    ref, _ = unpacked_token_logprobs(model, microbatch.trajectories)
    sum(r.sum() * t.advantage for r, t in zip(ref, microbatch.trajectories)).backward()  # type: ignore[union-attr]
    for packed, p in zip(packed_grads, model.parameters()):
        assert torch.isfinite(packed).all()
        torch.testing.assert_close(packed, p.grad, atol=1e-5, rtol=1e-4)


def test_microbatch_without_completion_tokens_still_backpropagates() -> None:
    """A micro-batch whose trajectories all have empty completions (e.g. the last row of a step)
    scores nothing, but the loss built on it still supports backward() (zero gradient)."""
    from relayrl.algorithms.losses import LossConfig, policy_loss

    model = tiny_qwen2("sdpa")
    trajs = make_groups(random.Random(3), [(3, [0, 0])])
    batch = TorchCollator(PAD).collate(make_microbatch(trajs, [[0, 1]], share_prompt=True))
    assert batch.num_loss_tokens == 0
    logp, ent = token_logprobs(model, batch)
    assert logp.shape == ent.shape == (0,)
    out = policy_loss(
        logp,
        batch.old_logprobs,
        batch.advantages,
        batch.loss_mask,
        batch.seq_index,
        LossConfig(),
        num_tokens_in_step=1.0,
        num_seqs_in_step=1.0,
    )
    out.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("chunk_tokens", [1, 3, None])
def test_chunked_scoring_equals_one_chunk(microbatch: MicroBatch, chunk_tokens: int | None) -> None:
    model = tiny_qwen2("sdpa")
    batch = TorchCollator(PAD).collate(microbatch)
    grads = []
    for chunk in (chunk_tokens, 10_000):
        model.zero_grad()
        logp, ent = token_logprobs(model, batch, chunk_tokens=chunk)
        (logp * batch.advantages).sum().backward()
        grads.append((logp.detach(), ent, [p.grad.clone() for p in model.parameters()]))  # type: ignore[union-attr]
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = grads
    torch.testing.assert_close(lp_a, lp_b)
    torch.testing.assert_close(ent_a, ent_b)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b)


def test_vocabulary_projection_runs_on_loss_positions_only(microbatch: MicroBatch, monkeypatch: pytest.MonkeyPatch) -> None:
    """For a plain-head model (Qwen2) the output projection sees only the T predicting positions,
    and the result equals the all-logits path's (values and gradients)."""
    from relayrl.backends.local import logprobs as lp_module

    model = tiny_qwen2("sdpa")
    batch = TorchCollator(PAD).collate(microbatch)
    rows: list[int] = []
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    handle = head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    results = []
    for types in (lp_module.PLAIN_HEAD_MODEL_TYPES, frozenset()):
        monkeypatch.setattr(lp_module, "PLAIN_HEAD_MODEL_TYPES", types)
        model.zero_grad()
        logp, ent = token_logprobs(model, batch)
        (logp * batch.advantages).sum().backward()
        results.append((logp.detach(), ent, [p.grad.clone() for p in model.parameters()]))  # type: ignore[union-attr]
    handle.remove()
    assert rows == [batch.num_loss_tokens, batch.shape[0]]  # 2D hidden (T rows) vs (B, L, H)
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    torch.testing.assert_close(lp_a, lp_b)
    torch.testing.assert_close(ent_a, ent_b)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b)


def test_eager_with_bool_mask_is_refused(microbatch: MicroBatch) -> None:
    model = tiny_qwen2("eager")
    batch = TorchCollator(PAD, mask_kind="bool").collate(microbatch)
    with pytest.raises(ValueError, match="mask_kind='float'"):
        token_logprobs(model, batch)


def test_layout(microbatch: MicroBatch) -> None:
    batch = TorchCollator(PAD).collate(microbatch)
    trajs = microbatch.trajectories
    share = microbatch.share_prompt
    lengths = [layout_tokens(trajs, row, share) for row in ROWS]
    assert batch.shape == (len(ROWS), max(lengths))  # padded to the longest row only
    assert batch.attention_mask.shape == (len(ROWS), 1, max(lengths), max(lengths))
    assert batch.attention_mask.dtype == torch.bool
    assert batch.num_real_tokens == sum(lengths)
    assert batch.num_loss_tokens == batch.target_ids.numel() == sum(len(t.completion_tokens) for t in trajs)
    assert batch.num_sequences == len(trajs)
    if share:  # row 0 holds the prompts of groups 0 and 1 once, row 1 that of group 2
        assert sum(lengths) == sum(t.num_tokens for t in trajs) - 3 - 4 - 2

    flat_ids = batch.input_ids.reshape(-1)
    flat_pos = batch.position_ids.reshape(-1)
    for r, row in enumerate(ROWS):
        expected_ids: list[int] = []
        expected_pos: list[int] = []
        if share:  # completions follow their segment's prompt, segments in order of first appearance
            for g in dict.fromkeys(trajs[i].group_id for i in row):
                members = [i for i in row if trajs[i].group_id == g]
                p = trajs[members[0]].prompt_tokens
                expected_ids += p
                expected_pos += list(range(len(p)))
                for i in members:
                    expected_ids += trajs[i].completion_tokens
                    expected_pos += list(range(len(p), len(p) + len(trajs[i].completion_tokens)))
        else:
            for i in row:
                expected_ids += trajs[i].prompt_tokens + trajs[i].completion_tokens
                expected_pos += list(range(trajs[i].num_tokens))
        n = len(expected_ids)
        assert batch.input_ids[r, :n].tolist() == expected_ids
        assert batch.position_ids[r, :n].tolist() == expected_pos
        assert (batch.segment_ids[r, :n] >= 0).all() and (batch.segment_ids[r, n:] == -1).all()
        assert (batch.input_ids[r, n:] == PAD).all()

    for i, t in enumerate(trajs):
        assert batch.split_by_sequence(batch.target_ids)[i].tolist() == t.completion_tokens
        torch.testing.assert_close(batch.split_by_sequence(batch.old_logprobs)[i], torch.tensor(t.sampler_logprobs, dtype=torch.float32))
        adv = batch.split_by_sequence(batch.advantages)[i]
        assert torch.allclose(adv, torch.full_like(adv, t.advantage))
        # token j is predicted by the last prompt position (j = 0) or by completion token j - 1
        src = batch.split_by_sequence(batch.source_index)[i]
        predictors = (t.prompt_tokens[-1:] + t.completion_tokens[:-1])[: len(t.completion_tokens)]
        assert flat_ids[src].tolist() == predictors
        assert flat_pos[src].tolist() == list(range(len(t.prompt_tokens) - 1, t.num_tokens - 1))


def test_prefix_tree_mask_shares_the_prompt_and_isolates_completions() -> None:
    # row: segment 0 = prompt (2 tokens) + completion a (2) + completion b (1); segment 1 = 2 tokens; 1 pad
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -1]])
    branch = torch.tensor([[-1, -1, 7, 7, 9, -1, -1, -1]])
    mask = prefix_tree_mask(seg, branch)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 0],  # b sees the prompt and itself, not a
            [0, 0, 0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0, 0, 1],
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
    microbatch.trajectories[4].sampler_logprobs.pop()
    with pytest.raises(ValueError, match="trajectory 4 .*5 sampler_logprobs for 6 completion tokens"):
        TorchCollator(PAD).collate(microbatch)


@settings(max_examples=40, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 6), st.lists(st.integers(0, 6), min_size=1, max_size=4)), min_size=1, max_size=4),
    share=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layout_invariants_hold_for_any_packing(groups: list[tuple[int, list[int]]], share: bool, seed: int) -> None:
    rng = random.Random(seed)
    trajs = make_groups(rng, groups)
    order = list(range(len(trajs)))
    rng.shuffle(order)
    rows: list[list[int]] = []
    while order:
        k = rng.randint(1, 3)
        rows.append(order[:k])
        order = order[k:]
    batch = TorchCollator(PAD).collate(make_microbatch(trajs, rows, share))
    flat_ids = batch.input_ids.reshape(-1)
    for i, t in enumerate(trajs):
        assert batch.split_by_sequence(batch.target_ids)[i].tolist() == t.completion_tokens
        assert batch.split_by_sequence(batch.old_logprobs)[i].tolist() == pytest.approx(t.sampler_logprobs)
        src = batch.split_by_sequence(batch.source_index)[i]
        assert flat_ids[src].tolist() == (t.prompt_tokens[-1:] + t.completion_tokens[:-1])[: len(t.completion_tokens)]
    # a segment starts exactly where a real position has position id 0: one per prompt copy
    real = batch.segment_ids >= 0
    starts = (batch.position_ids == 0) & real
    copies = sum(len({trajs[i].group_id for i in row}) if share else len(row) for row in rows)
    assert int(starts.sum()) == copies == int(batch.segment_ids.max()) + 1
    # every real position attends to exactly its sequence's prefix (prompt + own earlier tokens):
    # position + 1 keys; padding attends to itself only
    attended = batch.attention_mask[:, 0].sum(-1)
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

    base = model.base_model
    assert isinstance(base, torch.nn.Module)
    handle = base.register_forward_pre_hook(spy, with_kwargs=True)  # both paths call it
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    handle.remove()
    assert seen == [torch.float64]
    with torch.no_grad():
        ref, _ = unpacked_token_logprobs(model, microbatch.trajectories)
    assert _max_error(batch, logp, ref) < 1e-5


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_packed_logprobs_equal_unpacked_on_the_shipped_model(mask_kind: str) -> None:
    """The production path (sdpa, packer + collator, prompts shared) on the shipped model, with
    real arithmetic groups packed several to a row: per-token log-probs equal the
    one-sequence-at-a-time ones to float32 precision.

    The model runs in float64: float32 forward passes of the packed and unpacked layouts sum in
    different orders, and their difference (6.7e-6 to 1.1e-5 seen) depends on the CPU's kernels.
    In float64 the two layouts' logits agree to ~1e-12, and the only float32 step left is the
    final log-softmax, whose inputs then differ by at most one float32 ulp: the bound is a few
    ulps of the largest logit, far below what a token seeing a wrong position or another
    sequence changes (typically 1e-2 to 10)."""
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
    from relayrl.packing import build_microbatch, plan
    from relayrl.tasks.arithmetic import ArithmeticTask

    model, tok = load_model_and_tokenizer(shipped_model_dir(), dtype=torch.float64)
    rng = random.Random(1)
    trajectories = []
    for g, prompt in zip(range(6), ArithmeticTask().stream()):
        ids = tok(prompt.text, add_special_tokens=False)["input_ids"]
        for s in range(4):
            answer = prompt.answer if s % 2 else str(rng.randrange(200))
            completion = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            trajectories.append(
                trajectory(group=g, sample=s, prompt=prompt, prompt_tokens=ids, completion_tokens=completion, logprob=0.0, text="")
            )
    mb = build_microbatch(0, 0, trajectories, plan(trajectories, 40, 8, share_prompt=True))
    assert max(len({mb.trajectories[i].group_id for i in row}) for row in mb.rows) >= 2  # really packed
    assert mb.num_tokens < sum(t.num_tokens for t in trajectories)  # really shared
    batch = TorchCollator(tok.pad_token_id, mask_kind=mask_kind).collate(mb)  # type: ignore[arg-type]
    largest: list[float] = []  # the largest |logit| either path hands to the float32 log-softmax
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, args, out: largest.append(float(out.abs().max())))
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
        ref_logp, _ = unpacked_token_logprobs(model, mb.trajectories)
    hook.remove()
    # one float32 ulp of x is at most eps·|x|: one ulp per rounded logit on each side, and the
    # round-off of logsumexp and of the subtraction
    bound = 8 * torch.finfo(torch.float32).eps * max(largest)
    assert _max_error(batch, logp, ref_logp) <= bound
