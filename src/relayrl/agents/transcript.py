"""An agent episode's calls, assembled into token-exact training samples.

Job: each call the agent makes through the endpoint (agents/endpoint.py) gives the text it sent
(a completion's prompt, or the chat template's rendering of its messages) and, per choice, the
token ids and log-probs the sampler produced and the text the agent was answered with. A
`Transcript` keeps every answered choice as a `Node`: its tokens (context and sampled), its loss
mask, its log-probs, its `Turn`s and its text (the text sent plus the text answered).

The rule (`Transcript.context`): a call whose text starts with a node's text continues that node
(the longest such node): its context is the node's tokens, unchanged, followed by the tokens of
the new text only (a suffix whose first token is the stop token that ended the node's last
completion drops it: the sampled one stands for it). A call that continues no node (the agent
rewrote or dropped earlier history, or its first call) starts afresh from the tokens of its whole
text. A completion prompt given as token ids is the context as sent (`Transcript.context_ids`):
it continues the node whose tokens it starts with. Sampling is done on that context, so what is
trained is exactly what was sampled.

Invariants:
- a node's sampled tokens are never re-tokenised: they are the sampler's ids, with its log-probs,
  versions and replica in a `Turn` each; every other token (the agent's text, the template's) is
  context (`mask` 0, log-prob 0.0);
- versions as multi-turn episodes record them (orchestrator/stages/episodes.py): a `Turn`'s
  `policy_version` is the oldest that sampled a token of it (with rollout.interruptible a load
  can land inside a call), and a node's `versions` lists (first completion token index, version)
  runs over its completion, built from each choice's per-token segments (context tokens fall in
  the run before them); a trajectory's `policy_version` is its oldest token's;
- every sampled token is trained exactly once: the first call that continues a node takes over
  its trainable tokens; a second continuation of the same node (a branch, or choice 2..n of a call
  with `n` > 1 continued later) keeps them as context. The leaves (nodes nobody continued) are
  the episode's training samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.types import Turn, extend_version_runs

__all__ = ["Choice", "Node", "Start", "Transcript"]


@dataclass(slots=True, frozen=True)
class Choice:
    """One sampled completion of a call, as the endpoint answered it."""

    tokens: list[int]  # the sampler's ids (cut after a stop string when one matched)
    logprobs: list[float]
    text: str  # what the agent was answered with (without the stop token or string)
    finish_reason: str
    policy_version: int
    replica: int
    ended_on_stop_token: bool  # its last token is the model's stop token (not a stop string's)
    # rollout.interruptible: (first token index, version) segments of `tokens` when a load landed
    # during its generation (`policy_version` is then the first's, the oldest); None: all `policy_version`
    versions: list[tuple[int, int]] | None = None


@dataclass(slots=True, eq=False)
class Node:
    """An answered choice and everything before it: one candidate training sample."""

    text: str  # the text sent + the text answered: what a later call must start with to continue it
    tokens: list[int]  # prompt_len context tokens, then the completion (context and sampled)
    logprobs: list[float]  # one per token after prompt_len (0.0 on context)
    mask: list[int]  # one per token after prompt_len (1: sampled, trained)
    turns: list[Turn]
    prompt_len: int
    chain: int  # which KV-cache chain it belongs to (the sampler's episode key)
    ended_on_stop_token: bool
    finish_reason: str
    answer: str  # its last completion's text (what reward functions see)
    # (first index after prompt_len, version) runs over the completion, in order (see the module)
    versions: list[tuple[int, int]] = field(default_factory=list)
    continued: bool = False  # a later call took over its trainable tokens


@dataclass(slots=True, frozen=True)
class Start:
    """Where a call starts: the node it continues (None: afresh) and the context it samples from."""

    parent: Node | None
    context: list[int]
    suffix: str  # the text after the parent's (the whole text when afresh)
    chain: int


@dataclass(slots=True)
class Transcript:
    """Every node of one episode, in the order they were answered."""

    nodes: list[Node] = field(default_factory=list)
    _chains: int = 0

    def context(self, text: str, encode: Callable[[str], list[int]]) -> Start:
        """Where a call with `text` starts (see the module's rule); `encode` tokenizes new text."""
        parent = self.parent_of(text)
        new = self.new_text(text, parent)
        return self.start(parent, text, encode(new) if new else [])

    def parent_of(self, text: str) -> Node | None:
        """The node a call with `text` continues (the longest whose text it starts with), if any."""
        parent = None
        for node in self.nodes:
            if text.startswith(node.text) and (parent is None or len(node.text) > len(parent.text)):
                parent = node
        return parent

    @staticmethod
    def new_text(text: str, parent: Node | None) -> str:
        """The text of a call continuing `parent` that must be tokenized (all of it afresh)."""
        return text if parent is None else text[len(parent.text) :]

    def start(self, parent: Node | None, text: str, ids: list[int]) -> Start:
        """`context`, given `parent_of(text)` and the tokens `ids` of its `new_text` (so that the
        tokenizing can run elsewhere: the endpoint runs it off the event loop)."""
        if parent is None:
            return Start(None, ids, text, self._new_chain())
        suffix = text[len(parent.text) :]
        if parent.ended_on_stop_token and ids and ids[0] == parent.tokens[-1]:
            ids = ids[1:]
        chain = parent.chain if not parent.continued else self._new_chain()
        return Start(parent, parent.tokens + ids, suffix, chain)

    def context_ids(self, ids: list[int], decode: Callable[[list[int]], str]) -> Start:
        """Where a call whose prompt is token ids starts: the ids are the context, unchanged; it
        continues the node (the longest) whose tokens they start with."""
        parent = None
        for node in self.nodes:
            n = len(node.tokens)
            if n < len(ids) and ids[:n] == node.tokens and (parent is None or n > len(parent.tokens)):
                parent = node
        if parent is None:
            return Start(None, list(ids), decode(ids), self._new_chain())
        chain = parent.chain if not parent.continued else self._new_chain()
        return Start(parent, list(ids), decode(ids[len(parent.tokens) :]), chain)

    def _new_chain(self) -> int:
        self._chains += 1
        return self._chains

    def new_chain(self) -> int:
        """A fresh KV-cache chain (choice 2..n of a call)."""
        return self._new_chain()

    def record(self, start: Start, choice: Choice, chain: int) -> Node:
        """The node of `choice`, sampled from `start`'s context; it takes over its parent's
        trainable tokens unless another node already did."""
        parent = start.parent
        context = start.context
        if parent is not None and not parent.continued:
            parent.continued = True
            prompt_len = parent.prompt_len
            added = len(context) - len(parent.tokens)
            logprobs = parent.logprobs + [0.0] * added
            mask = parent.mask + [0] * added
            versions = list(parent.versions)
            turns = list(parent.turns)
            if turns:
                last = turns[-1]
                turns[-1] = Turn(last.start, last.end, last.policy_version, last.replica, last.action, observation=start.suffix)
        else:  # afresh, or a branch: everything before is context
            prompt_len = len(context)
            logprobs, mask, turns, versions = [], [], [], []
        begin = len(context) - prompt_len
        extend_version_runs(versions, choice.versions, choice.policy_version, begin)
        tokens = context + choice.tokens
        node = Node(
            text=(parent.text if parent is not None else "") + start.suffix + choice.text,
            tokens=tokens,
            logprobs=logprobs + list(choice.logprobs),
            mask=mask + [1] * len(choice.tokens),
            turns=[*turns, Turn(begin, begin + len(choice.tokens), choice.policy_version, choice.replica, choice.text)],
            prompt_len=prompt_len,
            chain=chain,
            ended_on_stop_token=choice.ended_on_stop_token,
            finish_reason=choice.finish_reason,
            answer=choice.text,
            versions=versions,
        )
        self.nodes.append(node)
        return node

    @property
    def leaves(self) -> list[Node]:
        """The training samples: nodes no later call continued, in the order they were answered."""
        return [n for n in self.nodes if not n.continued]

    @property
    def chains(self) -> list[int]:
        """Every KV-cache chain used (to forget their caches when the episode ends)."""
        return list(range(1, self._chains + 1))
