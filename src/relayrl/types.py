"""Data that flows between stages: prompts, trajectories, groups, micro-batches, step results,
and what travels to workers (weights, train batches).

Invariant: these are plain records. Stages exchange them through queues and never share mutable
state beyond what a record carries; every trajectory records the policy version that sampled it.
What a worker receives (`SampleRequest`, `Weights`, `TrainBatch`) holds only what it computes on,
so it can be sent to a worker in another process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class TrajectoryStatus(StrEnum):
    OK = "ok"
    FAILED = "failed"  # a reward function failed (see RewardFailure); reward forced to 0


class RewardFailure(StrEnum):
    """Why a reward function gave a trajectory no reward (counted per function in the ledger)."""

    TIMEOUT = "timeout"  # no result within task.reward_timeout_s
    RAISED = "raised"  # it raised (or returned something that is not a number: the detail names its type)
    CRASHED = "crashed"  # its worker process died: a signal, os._exit, the CPU or memory limit
    # it returned NaN, an infinity or a magnitude beyond MAX_ABS_REWARD (1e6, rewards/registry.py)
    NON_FINITE = "non_finite"


class FilterReason(StrEnum):
    ZERO_VARIANCE = "zero_variance"  # dynamic sampling: all rewards equal
    STALE = "stale"  # sampled by a policy older than the staleness window allows
    ALL_FAILED = "all_failed"  # every trajectory's reward failed
    # a trajectory longer than a packed row (train.row_tokens), or a prompt that leaves no room for
    # rollout.max_new_tokens in the model's context (never sampled)
    TOO_LONG = "too_long"
    ALL_TRUNCATED = "all_truncated"  # algorithm.mask_truncated: every scored trajectory was cut at the token limit


@dataclass(slots=True, frozen=True)
class Prompt:
    """One task instance: the text shown to the policy and the reference the verifier uses.
    `metadata` holds what else the task knows about it, JSON-serialisable (a JSONL row's extra
    fields, a reasoning-gym entry), for reward functions; it is checkpointed with the prompt."""

    prompt_id: str
    text: str
    answer: str
    metadata: dict[str, object] = field(default_factory=dict, hash=False, compare=True)


@dataclass(slots=True, frozen=True)
class Drawn:
    """A prompt as the run's prompt stream handed it out: `index` is its position in the stream
    (0, 1, 2, ...; a dataset's prompt appears again, at a new index, every epoch, and a filtered
    group is replaced by the next index). It keys the randomness of the group dispatched for it,
    so no two dispatches of one prompt sample alike, and it is checkpointed with the prompts in
    flight, so a resumed run samples them as the uninterrupted run would."""

    index: int
    prompt: Prompt

    @property
    def rng_key(self) -> str:
        return f"{self.index}:{self.prompt.prompt_id}"


@dataclass(slots=True)
class SampleRequest:
    """Ask a sampler for `num_samples` completions of one prompt (one group). `rng_key` keys the
    request's random stream together with the run seed and the policy version (a dispatched
    group's `Drawn.rng_key`); "" = the group id."""

    group_id: int
    prompt: Prompt
    prompt_tokens: list[int]
    num_samples: int
    rng_key: str = ""

    @property
    def seed_key(self) -> str:
        """What seeds this request's RNG (with the run seed and the version)."""
        return self.rng_key or f"group {self.group_id}"


@dataclass(slots=True)
class Completion:
    """One sampled completion with the log-probs of its tokens under the sampling distribution."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"
    # rollout.interruptible: the versions that sampled its tokens, as (first token index, version)
    # segments in order, when a weight load landed during its generation; None: every token was
    # sampled by its result's `policy_version`
    versions: list[tuple[int, int]] | None = None


def token_versions(segments: Sequence[tuple[int, int]], length: int) -> list[int]:
    """Per-token versions of `length` tokens from (first token index, version) segments."""
    out: list[int] = []
    for i, (start, version) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else length
        out.extend([version] * (min(end, length) - start))
    return out


@dataclass(slots=True)
class GenerateResult:
    """What a sampler returns for one request: the version that sampled it and its completions.
    With rollout.interruptible a completion's later tokens may come from newer versions (its
    `versions`); `policy_version` is then the oldest, the one its first token was sampled by."""

    request: SampleRequest
    completions: list[Completion]
    policy_version: int
    replica: int


def generate_sizes(results: Sequence[GenerateResult]) -> dict[str, int]:
    """A generate call's sizes, as its trace span records them (relayrl.plan fits the decode cost
    from them): `sequences`, the completions sampled (the decode batch's rows), and `steps`, the
    longest completion's tokens (the decode passes the call took)."""
    return {
        "sequences": sum(len(r.completions) for r in results),
        "steps": max((len(c.tokens) for r in results for c in r.completions), default=0),
    }


@dataclass(slots=True)
class TurnRequest:
    """Ask a sampler for the next policy turn of one multi-turn episode.

    `context` is every token of the episode so far (prompt, earlier turns, observations), so a
    sampler that holds no cache for the episode (a new episode, weights changed since, a restart)
    can re-read it; one that holds the episode's KV cache from its previous turn reads only the
    tokens after what that cache covers. Identical contexts in one call (a group's first turns)
    are prefilled once. `rng_key` seeds this turn's RNG together with the run seed and the policy
    version, so what a turn samples depends on those and the weights only."""

    episode: str  # unique in the run, e.g. "<group id>/<sample index>"
    context: list[int]
    rng_key: str
    max_new_tokens: int
    prompt: Prompt | None = None  # the episode's prompt, as a SampleRequest carries it (the sim reads its answer)


@dataclass(slots=True)
class TurnResult:
    """One sampled policy turn: the version that sampled it (with rollout.interruptible the oldest,
    its first token's; its completion's `versions` then lists the others) and how many of its
    context tokens came from the episode's KV cache instead of being computed again."""

    episode: str
    completion: Completion
    policy_version: int
    replica: int
    cached_tokens: int = 0


def extend_version_runs(runs: list[tuple[int, int]], segments: Sequence[tuple[int, int]] | None, version: int, begin: int) -> None:
    """Append to `runs` ((first completion token index, version), in order) a turn's tokens that
    start at completion index `begin`: its (first token index, version) `segments`, or all
    `version` when None; a run goes on while the version does not change."""
    for first, v in segments or [(0, version)]:
        if not runs or runs[-1][1] != v:
            runs.append((begin + first, v))


def versions_used(results: Sequence[TurnResult]) -> list[int]:
    """The versions that sampled a token of `results`, ascending (more than one when a load landed
    during the call: rollout.interruptible)."""
    return sorted({v for r in results for _, v in (r.completion.versions or [(0, r.policy_version)])})


@dataclass(slots=True)
class Turn:
    """One policy turn of a multi-turn trajectory. Its action tokens are
    `completion_tokens[start:end]` (trained on, with the sampler's log-probs); the observation the
    environment answered with follows them as context-only tokens (no loss, no log-probs)."""

    start: int
    end: int
    policy_version: int
    replica: int
    action: str
    observation: str = ""  # "" when the episode ended after this turn
    reward: float = 0.0  # the environment's reward part for this action
    tool_call: bool = False
    solved: bool = False


@dataclass(slots=True)
class Trajectory:
    """One sampled completion of a prompt: what a reward function receives (docs/rewards.md).
    Picklable, so it can be sent to a reward worker process."""

    group_id: int
    sample_index: int
    prompt: Prompt
    prompt_tokens: list[int]
    completion_tokens: list[int]
    sampler_logprobs: list[float]
    completion_text: str
    policy_version: int
    replica: int
    reward: float = 0.0
    advantage: float = 0.0
    status: TrajectoryStatus = TrajectoryStatus.OK
    error: str | None = None
    finish_reason: str = "stop"
    # multi-turn episodes: the policy turns (empty for a single completion: the shared empty
    # tuple, so a single completion allocates no list the garbage collector must then track);
    # `loss_mask[i]` is 1 where completion token i is the policy's (trained) and 0 where it is an
    # observation (context only; its `sampler_logprobs` entry is 0.0); None: every token is the policy's
    turns: Sequence[Turn] = ()
    loss_mask: list[int] | None = None
    env_reward: float | None = None  # the environment's reward parts summed (None: no environment)
    env_time: float = 0.0  # seconds its environment steps took
    # (first completion token index, version) segments when its tokens come from several versions
    # (rollout.interruptible: a weight load landed during its generation; multi-turn: its turns'
    # runs, observation tokens in the run before them); `policy_version` is then the oldest, the
    # first segment's; None: every token was sampled by `policy_version`
    versions: list[tuple[int, int]] | None = None
    overlong_penalty: float = 0.0  # DAPO's soft overlong penalty (≤ 0), already in `reward` (algorithms/shaping.py)
    # with algorithm.turn_discount: each policy turn's advantage (`advantage` is the first's);
    # None: every token of the trajectory has `advantage`
    turn_advantages: list[float] | None = None
    # agents (task.agent): the reward the agent returned for its episode (None: it returned None,
    # or no agent); a trajectory carrying one is not scored by the reward functions
    agent_reward: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.completion_tokens)

    @property
    def policy_tokens(self) -> int:
        """Completion tokens the policy sampled (the ones trained on)."""
        return len(self.completion_tokens) if self.loss_mask is None else sum(self.loss_mask)


@dataclass(slots=True)
class Group:
    """The G trajectories sampled for one prompt; advantages are relative within it."""

    group_id: int
    trajectories: list[Trajectory]

    @property
    def min_version(self) -> int:
        return min(t.policy_version for t in self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


@dataclass(slots=True)
class FilteredGroup:
    group: Group
    reason: FilterReason


@dataclass(slots=True)
class PaddingStats:
    """How well a micro-batch's rows are filled: real tokens over the tokens the trainer computes."""

    rows: int
    row_tokens: int  # length every row is padded to
    real_tokens: int  # tokens laid out in the rows (a shared prompt counts once)
    sequences: int
    sequence_tokens: int = 0  # prompt + completion tokens of every sequence (without prompt sharing)

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.row_tokens

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0


@dataclass(slots=True)
class PackPlan:
    """Which trajectories go in which row; rows are chunked into micro-batches."""

    rows: list[list[int]]  # indices into the step's trajectory list, per packed row
    microbatches: list[list[int]]  # indices into `rows`, per micro-batch
    row_budget: int
    share_prompt: bool = False  # a group's completions share one copy of its prompt in a row
    # train.minibatches_per_step > 1 (packing.py): per micro-batch its minibatch, and per minibatch
    # its policy tokens and sequences with a policy token (its loss normalisers); empty: one minibatch
    minibatch: list[int] = field(default_factory=list)
    minibatch_tokens: list[int] = field(default_factory=list)
    minibatch_sequences: list[int] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class Weights:
    """A policy version's weights as they travel to samplers; `payload` is backend-specific.
    `ready`: in one process on CUDA, the event the exporting thread recorded after queueing the
    payload's copies (`relayrl.backends.local.streams`); a reader on another stream waits for it."""

    version: int
    payload: object
    ready: object | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class TrainBatch:
    """What `Trainer.train_step` receives: the collated micro-batch and the counts the trainer
    computes and reports with, never trajectories or texts (see `MicroBatch.train_batch`).

    `payload` is what the backend's collator made (e.g. tensors of token ids, positions, masks,
    sampler log-probs, advantages, loss-token indices); `advantages` holds one per sequence.
    With `train.minibatches_per_step` > 1 the normalisers are its minibatch's (`minibatch`: which
    of the step's optimizer updates per pass it belongs to), not the whole step's."""

    step: int
    index: int
    payload: object
    num_tokens: int  # laid-out tokens (a shared prompt once), no padding
    num_sequences: int
    advantages: list[float]
    step_completion_tokens: int  # the policy's completion tokens over the whole step (its minibatch): the loss normaliser for accumulation
    step_sequences: int  # trajectories of the step (its minibatch) with at least one policy token
    minibatch: int = 0
    padded_tokens: int = 0  # the positions the trainer computes: rows × the length they are padded to


@dataclass(slots=True)
class MicroBatch:
    """A packed chunk of one step's trajectories. `payload` is backend-specific (e.g. tensors)."""

    step: int
    index: int
    final: bool
    trajectories: list[Trajectory]
    rows: list[list[int]]  # indices into `trajectories`, per packed row
    padding: PaddingStats
    num_tokens: int
    step_completion_tokens: int = 0  # the policy's completion tokens over the whole step (its minibatch): the loss normaliser
    step_sequences: int = 0  # trajectories of the step (its minibatch) with at least one policy token
    share_prompt: bool = False  # rows are laid out as segments sharing a prompt (packing.segments)
    payload: object = None
    minibatch: int = 0  # which of the step's minibatches it belongs to (train.minibatches_per_step)

    @property
    def min_version(self) -> int:
        return min(t.policy_version for t in self.trajectories)

    def train_batch(self) -> TrainBatch:
        """What the trainer receives for this micro-batch (collated `payload` and counts only);
        the orchestrator keeps the micro-batch, trajectories included, for its bookkeeping."""
        return TrainBatch(
            step=self.step,
            index=self.index,
            payload=self.payload,
            num_tokens=self.num_tokens,
            num_sequences=len(self.trajectories),
            advantages=[t.advantage for t in self.trajectories],
            step_completion_tokens=self.step_completion_tokens,
            step_sequences=self.step_sequences,
            minibatch=self.minibatch,
            padded_tokens=self.padding.padded_tokens,
        )


@dataclass(slots=True)
class StepResult:
    """Everything known about step N once its bookkeeping ran: the policy version its commit produced
    and its reduced metrics (its metrics.jsonl row). Ledger counts are not per step: the run's
    `Ledger` holds them (RunResult.ledger, summary.json's "ledger")."""

    step: int
    policy_version: int
    metrics: dict[str, float | int | None] = field(default_factory=dict)


@dataclass(slots=True)
class StepRecord:
    """What the train loop knows about step N at its commit; bookkeeping reduces it later. The
    train loop is its one writer until then (orchestrator/stages/train_loop.py: the run's
    commit-time figures reach it through `StepHooks.commit_figures`); bookkeeping only empties
    `groups` and `filtered` once they are logged."""

    step: int  # numbered from 1 (the train loop's counter, which every file and message shows)
    groups: list[Group]
    policy_version: int = 0  # version after this step's commit (= step)
    filtered: list[FilteredGroup] = field(default_factory=list)
    padding: list[PaddingStats] = field(default_factory=list)
    step_time_sec: float = 0.0
    boundary_gap_sec: float | None = None
    exposed_generation_time: float = 0.0
    packing_time: float = 0.0
    weight_sync_time: float = 0.0
    train_time: float = 0.0
    optim_time: float = 0.0  # the step's optim_step call (all its optimizer updates)
    loop_lag_max_ms: float = 0.0
    sampler_gpu_mem_peak_gb: float | None = None  # the samplers' largest peak GPU memory this step (where measured)
    metrics_fetch_time: float = 0.0
    trainer_metrics: dict[str, float] = field(default_factory=dict)
    commit_time: float = 0.0  # run clock, seconds
    truncated_masked: int | None = None  # algorithm.mask_truncated: truncated trajectories left out of the loss

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


@dataclass(slots=True, frozen=True)
class EvalResult:
    """A held-out evaluation of one policy version (`relayrl.eval.heldout`). `accuracy`: the share
    of held-out prompts answered correctly by the task's own check (tasks/correctness.py; multi-turn:
    solved within `rollout.max_turns`), whatever the reward functions; `reward_mean`: the mean
    reward of the greedy completions under the run's reward functions (a failed call counts 0;
    None in evaluations recorded before it existed); multi-turn only: `first_turn_accuracy` (solved
    by the first action) and `mean_turns` (policy turns per episode)."""

    version: int
    accuracy: float
    num_prompts: int
    seconds: float
    first_turn_accuracy: float | None = None
    mean_turns: float | None = None
    reward_mean: float | None = None
