"""Append-only run logs: metrics.jsonl (one line per step) and the trajectory log.

Invariant: each write is a whole line followed by a flush, so a crash loses at most the line being
written, and a reader never sees a half-written record except possibly the last line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from relayrl.types import FilteredGroup, Trajectory


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: IO[str] = open(path, "a", encoding="utf-8")

    def write_many(self, rows: list[dict[str, object]]) -> None:
        if rows:
            self._fh.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def trajectory_rows(step: int, trained_version: int, trajs: list[Trajectory], filtered: list[FilteredGroup]) -> list[dict[str, object]]:
    rows = [_row(step, trained_version, t, t.status.value) for t in trajs]
    for item in filtered:
        rows.extend(_row(step, trained_version, t, f"filtered:{item.reason.value}") for t in item.group.trajectories)
    return rows


def _row(step: int, trained_version: int, t: Trajectory, status: str) -> dict[str, object]:
    return {
        "step": step,
        "prompt_id": t.prompt.prompt_id,
        "group_id": t.group_id,
        "sample_index": t.sample_index,
        "prompt": t.prompt.text,
        "completion": t.completion_text,
        "answer": t.prompt.answer,
        "num_tokens": t.num_tokens,
        "reward": t.reward,
        "advantage": t.advantage,
        "policy_version": t.policy_version,
        "staleness": trained_version - t.policy_version,
        "sampler_logprob_sum": sum(t.sampler_logprobs),
        "status": status,
        "error": t.error,
        "replica": t.replica,
    }
