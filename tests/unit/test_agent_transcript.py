"""The agents' trajectory rule (agents/transcript.py) and tool-call parsing (agents/chat.py), on a
character tokenizer: a continuation reuses the sampled ids, a rewrite starts a separate sample,
a branch never trains a token twice."""

from __future__ import annotations

import json

from relayrl.agents.chat import parse_tool_calls
from relayrl.agents.transcript import Choice, Transcript

EOS = 0


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def choice(tokens: list[int], text: str, version: int = 0, eos: bool = True) -> Choice:
    ids = tokens + ([EOS] if eos else [])
    return Choice(ids, [-0.5] * len(ids), text, "stop", version, 0, ended_on_stop_token=eos)


def test_a_continuation_reuses_the_sampled_ids_and_tokenizes_only_the_new_text() -> None:
    t = Transcript()
    first = t.context("1+1=", encode)
    assert first.parent is None and first.context == encode("1+1=")
    # the sampler produced ids that re-tokenising "2" would not give (999): they must be kept as such
    t.record(first, choice([999], "2", version=3), first.chain)
    second = t.context("1+1=2\n1+1=", encode)
    assert second.parent is not None
    assert second.context == [*encode("1+1="), 999, EOS, *encode("\n1+1=")]
    assert second.chain == first.chain  # the replica's KV cache of the first call serves the second
    t.record(second, choice([ord("2")], "2", version=4), second.chain)
    [leaf] = t.leaves
    assert leaf.prompt_len == 4
    completion = leaf.tokens[leaf.prompt_len :]
    assert completion == [999, EOS, *encode("\n1+1="), ord("2"), EOS]
    assert leaf.mask == [1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert leaf.logprobs == [-0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5, -0.5]
    assert [(u.start, u.end, u.policy_version) for u in leaf.turns] == [(0, 2, 3), (7, 9, 4)]
    assert leaf.turns[0].observation == "\n1+1=" and leaf.answer == "2"


def test_a_suffix_starting_with_the_stop_token_does_not_repeat_it() -> None:
    """A chat template writes the end-of-turn token after the assistant's content: the sampled one
    stands for it."""
    t = Transcript()
    first = t.context("<u>hi<a>", encode)
    t.record(first, choice(encode("yo"), "yo"), first.chain)
    second = t.context("<u>hi<a>yo\x00<u>ok<a>", encode)
    assert second.context == [*encode("<u>hi<a>yo"), EOS, *encode("<u>ok<a>")]


def test_a_rewritten_history_is_a_separate_sample_with_no_token_trained_twice() -> None:
    t = Transcript()
    a = t.context("1+1=", encode)
    t.record(a, choice([ord("3")], "3"), a.chain)
    b = t.context("try again: 1+1=", encode)  # not an extension of the first call
    assert b.parent is None and b.chain != a.chain
    t.record(b, choice([ord("2")], "2"), b.chain)
    leaves = t.leaves
    assert len(leaves) == 2
    assert [sum(leaf.mask) for leaf in leaves] == [2, 2]
    assert leaves[1].tokens[: leaves[1].prompt_len] == encode("try again: 1+1=")


def test_a_branch_keeps_the_shared_turns_as_context() -> None:
    """Two calls that continue the same node (or choice 2 of n continued later): the first takes
    over its trained tokens, the second sees them as context only."""
    t = Transcript()
    a = t.context("q=", encode)
    node = t.record(a, choice([ord("x")], "x"), a.chain)
    b1 = t.context("q=x;1", encode)
    b2 = t.context("q=x;2", encode)
    t.record(b1, choice([ord("y")], "y"), b1.chain)
    t.record(b2, choice([ord("z")], "z"), b2.chain)
    assert node.continued
    first, second = t.leaves
    assert sum(first.mask) == 4 and first.prompt_len == 2  # x EOS y EOS
    assert sum(second.mask) == 2 and second.prompt_len == len(b2.context)  # z EOS only
    assert second.tokens[: second.prompt_len] == b2.context
    trained = sum(sum(leaf.mask) for leaf in t.leaves)
    assert trained == sum(len(n.tokens) - len(ctx) for n, ctx in zip(t.nodes, [a.context, b1.context, b2.context]))


def test_versions_are_runs_over_the_completion_as_in_multi_turn_episodes() -> None:
    """rollout.interruptible: a choice's per-token segments become runs over its node's completion;
    context tokens fall in the run before them; a continuation keeps its parent's runs, a branch
    starts its own; every turn keeps its oldest version."""
    t = Transcript()
    a = t.context("q=", encode)
    loaded = Choice([1, 2, 3, EOS], [-0.5] * 4, "abc", "stop", 3, 0, ended_on_stop_token=True, versions=[(0, 3), (2, 4)])
    node = t.record(a, loaded, a.chain)
    assert node.versions == [(0, 3), (2, 4)]
    b = t.context("q=abc\x00;", encode)  # one context token, then a call sampled by version 4 then 5
    t.record(b, Choice([7, EOS], [-0.5] * 2, "g", "stop", 4, 0, ended_on_stop_token=True, versions=[(0, 4), (1, 5)]), b.chain)
    [leaf] = t.leaves
    assert leaf.mask == [1, 1, 1, 1, 0, 1, 1]
    assert leaf.versions == [(0, 3), (2, 4), (6, 5)]  # the call's version-4 token joins the run before it
    assert [u.policy_version for u in leaf.turns] == [3, 4]
    branch = t.context("q=abc\x00!", encode)  # continues the first node again: everything before is context
    other = t.record(branch, choice([8], "h", version=5), branch.chain)
    assert other.versions == [(0, 5)] and other.prompt_len == len(branch.context)


def test_qwen2_tool_calls_are_parsed_into_the_openai_format() -> None:
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    [call] = calls
    assert call["type"] == "function" and str(call["id"]).startswith("call_")
    function = call["function"]
    assert isinstance(function, dict)
    assert function["name"] == "add" and json.loads(function["arguments"]) == {"a": 2, "b": 3}
    # only tool calls: no content; a block that is not a call's JSON stays text
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] is None
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
