"""Packed collation + log-probs: packed per-token log-probs (and gradients) equal unpacked ones,
with and without prompt sharing, and the packed tensors line up (positions, segments, the
position that predicts each completion token, advantages and sampler log-probs). The batch carries
segment and branch ids only; the attention mask built from them where the model runs (dense,
additive or a FlexAttention block mask) equals the old collator's dense mask exactly.

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

from relayrl.backends.local import attention
from relayrl.backends.local.attention import prefix_tree_block_mask, prefix_tree_mask, to_additive_mask
from relayrl.backends.local.collate import PackedBatch, TorchCollator
from relayrl.backends.local.logprobs import token_logprobs, unpacked_token_logprobs
from relayrl.bench.collate import _old_prefix_tree_mask
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
@pytest.mark.parametrize(("attn", "pad_rows_to"), [("sdpa", "longest"), ("sdpa", 32), ("eager", "longest")])
def test_packed_logprobs_equal_unpacked(microbatch: MicroBatch, factory_name: str, attn: str, pad_rows_to: str | int) -> None:
    model = MODEL_FACTORIES[factory_name](attn)
    batch = TorchCollator(PAD, pad_rows_to=pad_rows_to).collate(microbatch)  # type: ignore[arg-type]
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


def test_layout(microbatch: MicroBatch) -> None:
    batch = TorchCollator(PAD).collate(microbatch)
    trajs = microbatch.trajectories
    share = microbatch.share_prompt
    lengths = [layout_tokens(trajs, row, share) for row in ROWS]
    assert batch.shape == (len(ROWS), max(lengths))  # padded to the longest row only
    assert batch.branch_ids.shape == batch.segment_ids.shape == batch.shape
    assert not hasattr(batch, "attention_mask")  # built where the model runs, never shipped
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
    mask = prefix_tree_mask(b.segment_ids, b.branch_ids)
    f = to_additive_mask(mask)
    assert f.dtype == torch.float32
    assert torch.equal(f == 0, mask)
    assert (f[~mask] == torch.finfo(torch.float32).min).all()


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
    attended = prefix_tree_mask(batch.segment_ids, batch.branch_ids)[:, 0].sum(-1)
    assert torch.equal(attended[real], batch.position_ids[real] + 1)
    assert (attended[~real] == 1).all()


@pytest.mark.parametrize(("attn", "dtype"), [("eager", torch.float64), ("sdpa", torch.bool)])
def test_mask_follows_the_attention_implementation(microbatch: MicroBatch, attn: str, dtype: torch.dtype) -> None:
    """The mask is built at train time in the form the model takes: additive in the model's dtype
    for eager (which misreads a boolean mask), boolean for sdpa on the CPU."""
    model = tiny_qwen2(attn).double()
    batch = TorchCollator(PAD).collate(microbatch)
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
    assert seen == [dtype]
    with torch.no_grad():
        ref, _ = unpacked_token_logprobs(model, microbatch.trajectories)
    assert _max_error(batch, logp, ref) < 1e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked_on_the_shipped_model(attn: str) -> None:
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
    if attn != "sdpa":
        model.set_attn_implementation(attn)
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
    batch = TorchCollator(tok.pad_token_id).collate(mb)
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


def _dense(block: object, rows: int, length: int) -> torch.Tensor:
    """A block mask's own rule evaluated at every (query, key) pair."""
    from torch.nn.attention.flex_attention import create_mask

    return create_mask(block.mask_mod, rows, 1, length, length, device="cpu")  # type: ignore[attr-defined]


@settings(max_examples=30, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 6), st.lists(st.integers(0, 6), min_size=1, max_size=4)), min_size=1, max_size=5),
    share=st.booleans(),
    pad=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_device_masks_equal_the_old_dense_mask(groups: list[tuple[int, list[int]]], share: bool, pad: int, seed: int) -> None:
    """On random packings (prompts shared or not, rows padded), the boolean, additive and block
    masks built from the batch's segment and branch ids are exactly the old collator's dense mask."""
    rng = random.Random(seed)
    trajs = make_groups(rng, groups)
    order = list(range(len(trajs)))
    rng.shuffle(order)
    rows: list[list[int]] = []
    while order:
        k = rng.randint(1, 4)
        rows.append(order[:k])
        order = order[k:]
    longest = max(layout_tokens(trajs, row, share) for row in rows)
    batch = TorchCollator(PAD, pad_rows_to=longest + pad).collate(make_microbatch(trajs, rows, share))
    old = _old_prefix_tree_mask(batch.segment_ids, batch.branch_ids)
    assert torch.equal(prefix_tree_mask(batch.segment_ids, batch.branch_ids), old)
    assert torch.equal(to_additive_mask(old, torch.float64) == 0, old)
    assert torch.equal(_dense(prefix_tree_block_mask(batch.segment_ids, batch.branch_ids), *batch.shape), old)


def test_batch_bytes_grow_linearly_with_tokens() -> None:
    """Doubling a micro-batch's tokens (rows twice as long) at most doubles its bytes: nothing in
    the batch is (L × L)."""
    from relayrl.bench.collate import _tensors, batch_bytes, microbatch

    small, large = (TorchCollator(PAD).collate(microbatch(p, c, 4, 2)) for p, c in ((64, 96), (128, 192)))
    assert large.num_real_tokens == 2 * small.num_real_tokens
    assert batch_bytes(_tensors(large)) <= 2 * batch_bytes(_tensors(small))
    for name, t in _tensors(large).items():
        assert t.dim() <= 2 and t.numel() <= 2 * large.num_real_tokens, name


def test_a_batch_crosses_the_ray_transport_whole(microbatch: MicroBatch) -> None:
    """What the Ray host ships (numpy arrays, `backends/ray/transport`) comes back as the same
    batch, ids included, and scores the same: nothing there expects a mask field."""
    from relayrl.backends.ray.transport import decode, encode

    batch = TorchCollator(PAD).collate(microbatch)
    back = decode(encode(batch), writable=True)
    assert isinstance(back, PackedBatch)
    for name in PackedBatch.__slots__:
        a, b = getattr(batch, name), getattr(back, name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    model = tiny_qwen2("sdpa")
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, back)[0], token_logprobs(model, batch)[0])


def test_mask_form_is_chosen_per_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert attention.mask_form("sdpa", cpu) == "bool"
    assert attention.mask_form("sdpa", cuda) == "block"
    assert attention.mask_form("flex_attention", cpu) == "block"
    assert attention.mask_form("eager", cuda) == "float"
    # checkpointed layers recompute with sdpa in the backward, and deterministic runs avoid flex: a boolean mask
    assert attention.mask_form("sdpa", cuda, switch_allowed=False) == "bool"
    assert attention.mask_form("flex_attention", cuda, switch_allowed=False) == "block"


@pytest.mark.slow
def test_block_mask_logprobs_equal_unpacked(microbatch: MicroBatch, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path on the CPU: an sdpa model handed the block mask runs transformers'
    flex_attention for the packed forward only (compiled on first use: slow here), and its
    log-probs equal the unpacked ones; the model's attention setting is restored. (Flex attention
    has no backward on the CPU: the gradients are checked on CUDA only.)"""
    monkeypatch.setattr(attention, "mask_form", lambda implementation, device: "block")
    model = tiny_qwen2("sdpa")
    seen: list[str] = []
    base = model.base_model
    assert isinstance(base, torch.nn.Module)
    base.register_forward_pre_hook(lambda m, args: seen.append(model.config._attn_implementation))
    batch = TorchCollator(PAD, pad_rows_to=32).collate(microbatch)
    with torch.no_grad():
        logp, ent = token_logprobs(model, batch)
        assert seen == ["flex_attention"] and model.config._attn_implementation == "sdpa"
        ref, ref_ent = unpacked_token_logprobs(model, microbatch.trajectories)
    assert _max_error(batch, logp, ref) < 1e-5
    assert _max_error(batch, ent, ref_ent) < 1e-5
