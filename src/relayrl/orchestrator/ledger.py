"""The trajectory ledger: where every dispatched group ended up.

Invariant: every dispatched group reaches exactly one of trained, filtered (by reason) or unused
(still in flight when the run ended). Settling a group twice, or one never dispatched, raises.
A group is filtered by one call, `filtered(group, reason, window)`, which also returns its
dispatch credit to the window (orchestrator/window.py): the stages that filter (dispatch, the
advantage stage, the train loop's group taker) cannot settle a group and forget its credit.
The prompts of the groups in flight are kept, so a checkpoint can hand them to the resumed run;
a resumed ledger starts from the settled counts of the checkpoint it resumes.

Failed rewards are counted per function (`reward_errors`) and per function and reason
(`reward_failures`: timeout, raised, crashed, non_finite); a checkpoint written before reasons
were counted resumes with its counts as `raised`, the only reason there was then.

Memory: the ledger holds counts and the groups in flight (bounded by the dispatch window), never a
per-group record of settled groups: group ids are allocated in order, so an id below the next one
that is no longer in flight is one that was settled already.

Trajectories: `trajectories_trained` counts those a committed step trained on, which excludes the
failed ones of its groups (not packed: orchestrator/stages/advantage.py); `trajectories_failed` counts every
trajectory whose reward call failed, whatever its group's fate.

A run that filters every group never trains: `FilterWatch` (given to the ledger by the program)
counts the groups filtered in a row — since the last group kept for training —, whatever
filtered them (every filter goes through `filtered`; the advantage stage calls `kept`). It
warns once (`NoGroupKeptWarning`) past half its bound in a row, and fails the run
(`FilterBoundError`) past its bound (`orchestrator.max_filtered_per_step`, 0 = 20 ×
groups_per_step, at least 200). Counting in a row, not per step, keeps a healthy run whose
samplers run ahead of a slow trainer (or whose tie rate is high late in training: a group kept
every so often) from ever failing. O(1) per group.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field

from relayrl.errors import RunFailed
from relayrl.orchestrator.window import DispatchWindow
from relayrl.types import Drawn, FilteredGroup, FilterReason, Group


class LedgerError(RuntimeError):
    pass


class FilterBoundError(RunFailed, RuntimeError):
    """More groups were filtered in a row (none kept between them) than
    `orchestrator.max_filtered_per_step` allows: the run cannot fill a step (resuming would not help)."""

    resumable = False


class NoGroupKeptWarning(RuntimeWarning):
    """Many groups were filtered in a row, none kept (warned once per run)."""


# why groups of each filter reason may never train: the hint of FilterBoundError's message
_CAUSES = {
    "zero_variance": "with dynamic sampling every group of this task ties (algorithm.dynamic_sampling; a constant reward?)",
    "all_failed": "every reward call or environment episode of these groups failed "
    "(summary.json's reward_failures, the error column of trajectories/)",
    "too_long": "their prompts or trajectories are too long (the model's context, train.row_tokens)",
    "stale": "they were sampled by policies older than rollout.max_staleness allows",
    "all_truncated": "every completion of these groups was cut at the token limit and algorithm.mask_truncated leaves them "
    "out (raise rollout.max_new_tokens)",
}


@dataclass(slots=True)
class FilterWatch:
    """Whether filtering leaves the run any group to train (see the module docstring). `bound`:
    the most groups that may be filtered in a row; `warn_after`: more than this many in a row
    warns; `step`: the next step to commit (named in the messages)."""

    bound: int
    warn_after: int
    step: int = 1  # steps are numbered from 1
    streak: Counter[str] = field(default_factory=Counter)  # filtered since the last kept group, by reason
    total: int = 0  # = the streak's total
    warned: bool = False
    # the first failure of each function (reward, environment, agent): "reason: detail", named when
    # failed groups end the run
    first_failures: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, groups_per_step: int, max_filtered_per_step: int, start_step: int = 1) -> FilterWatch:
        """The run's watch: `max_filtered_per_step` 0 = 20 × groups_per_step, at least 200 (a
        small step at a high tie rate is not failed, or warned about, by chance). It warns half
        way to the bound."""
        bound = max_filtered_per_step or max(20 * groups_per_step, 200)
        return cls(bound, bound // 2, start_step)

    def kept(self) -> None:
        self.streak.clear()
        self.total = 0

    def committed(self) -> None:
        self.step += 1

    def filtered(self, reason: str) -> None:
        self.streak[reason] += 1
        self.total = total = self.total + 1
        if total > self.bound:
            raise FilterBoundError(self._failure(total))
        if total > self.warn_after and not self.warned:
            self.warned = True
            warnings.warn(
                f"step {self.step}: {total} groups filtered in a row ({self._reasons()}), none kept; the run fails when more than "
                f"{self.bound} are filtered in a row (orchestrator.max_filtered_per_step)",
                NoGroupKeptWarning,
                stacklevel=3,
            )

    def _reasons(self) -> str:
        return ", ".join(f"{reason} {n}" for reason, n in self.streak.most_common())

    def _failure(self, total: int) -> str:
        reasons = [r for r, _ in self.streak.most_common()]
        causes = "; ".join(_CAUSES[r] for r in reasons if r in _CAUSES)
        check = "check the reward" if {"zero_variance", "all_failed"} & set(reasons) else "check the config"
        first = ""
        if "all_failed" in reasons and self.first_failures:
            first = " (first failures: " + "; ".join(f"{fn!r} {what}" for fn, what in self.first_failures.items()) + ")"
        return (
            f"step {self.step}: {total} groups filtered in a row ({self._reasons()}) and none kept to train: {causes}{first}; "
            f"raise orchestrator.max_filtered_per_step (now {self.bound}) or {check}"
        )


@dataclass(slots=True)
class Ledger:
    groups_dispatched: int = 0
    trajectories_dispatched: int = 0
    trajectories_trained: int = 0
    trajectories_failed: int = 0
    reward_errors: Counter[str] = field(default_factory=Counter)  # failed calls by function
    reward_failures: Counter[tuple[str, str]] = field(default_factory=Counter)  # ... by (function, reason)
    _outcomes: Counter[str] = field(default_factory=Counter)  # settled in this run, by outcome
    _pending_filtered: list[FilteredGroup] = field(default_factory=list)
    _in_flight: dict[int, tuple[Drawn, int]] = field(default_factory=dict)  # id -> (prompt as drawn, group size)
    _settled_before: Counter[str] = field(default_factory=Counter)  # outcomes restored from a checkpoint
    _next_id: int = 0  # group ids are never reused, across resumes too
    _base_ids: int = 0  # ids below this belong to the run before the resume
    _first_failures: dict[str, str] = field(default_factory=dict)  # function -> its first failure in this run
    watch: FilterWatch | None = None  # the run's bound on filtering (None: no bound)

    def dispatch(self, prompts: list[Drawn], group_size: int) -> range:
        """Allocate ids for newly dispatched groups, one per prompt."""
        ids = range(self._next_id, self._next_id + len(prompts))
        self._next_id += len(prompts)
        self.groups_dispatched += len(prompts)
        self.trajectories_dispatched += len(prompts) * group_size
        for gid, prompt in zip(ids, prompts):
            self._in_flight[gid] = (prompt, group_size)
        return ids

    def count_reward_failures(self, calls: list[tuple[str, str]], trajectories: int) -> None:
        """Count failed reward calls, each `(function, reason)`, on `trajectories` trajectories."""
        for function, reason in calls:
            self.reward_errors[function] += 1
            self.reward_failures[function, reason] += 1
        self.trajectories_failed += trajectories

    def first_failure(self, function: str, what: str) -> bool:
        """Note a failed call's `what` ("reason: detail") if it is `function`'s first in this run
        (the filter bound's message names it); True when it was the first."""
        if function in self._first_failures:
            return False
        self._first_failures[function] = what[:300]
        if self.watch is not None:
            self.watch.first_failures[function] = self._first_failures[function]
        return True

    def failures_by_function(self) -> dict[str, dict[str, int]]:
        """`reward_failures` as {function: {reason: count}}, sorted."""
        out: dict[str, dict[str, int]] = {}
        for (function, reason), n in sorted(self.reward_failures.items()):
            out.setdefault(function, {})[reason] = n
        return out

    def in_flight(self) -> list[Drawn]:
        """Prompts (with their stream indices) of the dispatched groups not settled yet, in dispatch order."""
        return [prompt for prompt, _ in self._in_flight.values()]

    def checkpoint(self) -> dict[str, object]:
        """The settled part of the ledger: a resumed run re-dispatches the groups in flight."""
        unsettled = sum(size for _, size in self._in_flight.values())
        return {
            "next_group_id": self._next_id,
            "outcomes": dict(self._settled_before + self._outcomes),
            "trajectories_dispatched": self.trajectories_dispatched - unsettled,
            "trajectories_trained": self.trajectories_trained,
            "trajectories_failed": self.trajectories_failed,
            "reward_errors": dict(self.reward_errors),
            "reward_failures": self.failures_by_function(),
        }

    @classmethod
    def resumed(cls, state: dict[str, object]) -> Ledger:
        """A ledger that continues from `checkpoint()`'s output."""
        outcomes = Counter({str(k): int(v) for k, v in dict(state["outcomes"]).items()})  # type: ignore[call-overload]
        ledger = cls(
            groups_dispatched=sum(outcomes.values()),
            trajectories_dispatched=int(state["trajectories_dispatched"]),  # type: ignore[call-overload]
            trajectories_trained=int(state["trajectories_trained"]),  # type: ignore[call-overload]
            trajectories_failed=int(state["trajectories_failed"]),  # type: ignore[call-overload]
            reward_errors=Counter({str(k): int(v) for k, v in dict(state["reward_errors"]).items()}),  # type: ignore[call-overload]
        )
        raw_failures = state.get("reward_failures")
        if isinstance(raw_failures, dict):
            for function, reasons in raw_failures.items():
                for reason, n in dict(reasons).items():
                    ledger.reward_failures[str(function), str(reason)] = int(n)
        else:  # a checkpoint from before failures had reasons: every failure then was a raise
            for function, n in ledger.reward_errors.items():
                ledger.reward_failures[function, "raised"] = n
        ledger._settled_before = outcomes
        ledger._next_id = ledger._base_ids = int(state["next_group_id"])  # type: ignore[call-overload]
        return ledger

    def _settle(self, group_id: int, outcome: str) -> None:
        if group_id >= self._next_id or group_id < self._base_ids:
            raise LedgerError(f"group {group_id} settled as {outcome} but was never dispatched")
        if self._in_flight.pop(group_id, None) is None:
            raise LedgerError(f"group {group_id} settled twice: it was settled before, then {outcome}")
        self._outcomes[outcome] += 1

    def kept(self) -> None:
        """A group passed every filter before the train queue (the advantage stage)."""
        if self.watch is not None:
            self.watch.kept()

    def trained(self, group_id: int, num_trajectories: int) -> None:
        """A committed step trained group `group_id` on `num_trajectories` of its trajectories."""
        self._settle(group_id, "trained")
        self.trajectories_trained += num_trajectories

    def filtered(self, group: Group, reason: FilterReason, window: DispatchWindow) -> None:
        """Filter `group` (it must not train, for `reason`): settle it and return its dispatch
        credit to `window`, so a replacement is dispatched. The one way to filter a group: a
        group settled without its credit returned would shrink the window for good and, after
        enough of them, stall the run; the window's half is private to this call. Raises
        FilterBoundError (after both halves) when the watch's bound is passed."""
        self._settle(group.group_id, "filtered:" + reason.value)
        self._pending_filtered.append(FilteredGroup(group, reason))
        window._return_credit()  # the window's half of this call, never called on its own
        if self.watch is not None:
            self.watch.filtered(reason.value)

    def drain_filtered(self) -> list[FilteredGroup]:
        """The groups filtered since the last drain (each step drains once, at its commit)."""
        items, self._pending_filtered = self._pending_filtered, []
        if self.watch is not None:
            self.watch.committed()
        return items

    def as_dict(self) -> dict[str, object]:
        counts = self._settled_before + self._outcomes
        filtered = {k.removeprefix("filtered:"): v for k, v in counts.items() if k.startswith("filtered:")}
        return {
            "groups_dispatched": self.groups_dispatched,
            "groups_trained": counts.get("trained", 0),
            "groups_filtered": filtered,
            "groups_unused": self.groups_dispatched - sum(counts.values()),
            "trajectories_dispatched": self.trajectories_dispatched,
            "trajectories_trained": self.trajectories_trained,
            "trajectories_failed": self.trajectories_failed,
            "reward_errors": dict(self.reward_errors),
            "reward_failures": self.failures_by_function(),
        }
