"""Checkpoints: what a run writes every K steps so that it can resume after a crash or a kill -9.

Steps are numbered from 1 (step N's commit makes policy version N). `checkpoints/step-NNNNNN/`
holds, for the moment step N committed: the trainer's state (`Trainer.save_state`: weights of
version N, optimizer, LR schedule) and `state.json` — its format (`FORMAT`), the step N, how
many prompts the task stream has handed out, the prompts of the groups still in flight
(dispatched, not yet trained or filtered), the settled ledger, the held-out evaluations, the
wall time so far and the metrics.jsonl rows written since the previous checkpoint. A
checkpoint is written into a hidden temporary directory and renamed into place only when
complete, so a kill at any moment leaves either the whole checkpoint or none.

Resuming (`relayrl train --resume RUN_DIR`) rewinds the run directory to the newest complete
checkpoint — metrics, evaluations and trajectory rows of later steps are removed (a metrics
row of an earlier step that was lost is restored from the checkpoint, or the resume is
refused), the old trace is kept as `trace.part-K.json` — and the run goes on from step N + 1: the in-flight prompts are
dispatched again first, then the stream continues where it was. Invariant: every prompt the
stream handed out before the checkpoint is trained, filtered or in flight exactly once in the
resumed run; no step is trained twice in the final record.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

from relayrl.errors import UserError
from relayrl.rundir import trajfiles
from relayrl.rundir.jsonl import JsonlError, read_rows, rewrite_rows
from relayrl.types import Drawn, Prompt

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"
_PREFIX = "step-"
# state.json's format: 2 = steps numbered from 1 (`step`: the last step committed). Format 1 (no
# `format` key: `next_step`, steps numbered from 0) is refused, never read shifted by one.
FORMAT = 2


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed from or restored; names its directory or file."""


@dataclass(slots=True)
class ResumePoint:
    directory: Path
    step: int  # the last step committed (= the policy version it holds); the resumed run trains step + 1 on
    backend: str
    prompts_drawn: int  # prompts the task stream had handed out
    in_flight: list[Drawn]  # dispatched but not settled: dispatched again, first, with their stream indices
    ledger: dict[str, object]  # Ledger.checkpoint()
    evals: list[dict[str, object]]  # evals.jsonl rows so far
    elapsed_s: float  # wall time of the run up to the checkpoint
    reward_mean_first: float | None
    metrics_rows: list[dict[str, object]]  # metrics.jsonl rows of the steps since the previous checkpoint


class PromptSource(Iterator[Drawn]):
    """The prompts a run dispatches, each with its index in the prompt stream: `replay` first
    (in-flight prompts of a checkpoint, with the indices they had), then `stream` after skipping
    `skip` items, numbered from `skip`. `drawn` counts the items taken from the stream, skipped
    ones included."""

    def __init__(self, stream: Iterator[Prompt], replay: Iterable[Drawn] = (), skip: int = 0) -> None:
        self._replay = list(replay)
        self._stream = islice(stream, skip, None)
        self.drawn = skip

    def __next__(self) -> Drawn:
        if self._replay:
            return self._replay.pop(0)
        prompt = next(self._stream)
        self.drawn += 1
        return Drawn(self.drawn - 1, prompt)

    def pending(self) -> list[Drawn]:
        """Replayed prompts not dispatched yet (a checkpoint must carry them on)."""
        return list(self._replay)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"{_PREFIX}{step:06d}"


def staging_dir(final: Path) -> Path:
    """Where a checkpoint is written before it is renamed to `final` (ignored when resuming)."""
    return final.with_name(f".{final.name}.partial")


def checkpoint_state(
    *,
    step: int,
    backend: str,
    prompts_drawn: int,
    in_flight: list[Drawn],
    ledger: dict[str, object],
    evals: list[dict[str, object]],
    elapsed_s: float,
) -> dict[str, object]:
    """The state.json fields known at a commit. `prompts_drawn`: the prompt source's cursor;
    `in_flight`: the ledger's unsettled prompts, then the source's undispatched replays."""
    return {
        "format": FORMAT,
        "step": step,
        "backend": backend,
        "prompts_drawn": prompts_drawn,
        "in_flight": [{"index": d.index, "prompt": asdict(d.prompt)} for d in in_flight],
        "ledger": ledger,
        "evals": evals,
        "elapsed_s": elapsed_s,
    }


def commit_checkpoint(staging: Path, final: Path, state: dict[str, object], keep: int) -> None:
    """Write `state.json` (naming the trainer's files) into the staged checkpoint, move it into
    place, keep the newest `keep`."""
    state = {**state, "trainer_files": sorted(p.name for p in staging.iterdir())}
    tmp = staging / (STATE_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, staging / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    for old in complete_checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old)


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints under `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def load_resume_point(run_dir: Path) -> ResumePoint:
    """The newest complete checkpoint of `run_dir`; a CheckpointError names what is missing."""
    found = complete_checkpoints(run_dir / CHECKPOINTS)
    if not found:
        raise CheckpointError(
            f"nothing to resume: {run_dir} has no complete checkpoint under {run_dir / CHECKPOINTS}: the run stopped before its first "
            "(one is written after every orchestrator.checkpoint_every-th step and after the last; none when it is 0)"
        )
    directory = found[-1]
    path = directory / STATE_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != FORMAT:
            raise CheckpointError(
                f"{path}: checkpoint format {raw.get('format', 1)!r}, this relayrl reads format {FORMAT} (steps numbered from 1); "
                "resume it with the relayrl version that wrote it, or start the run afresh"
            )
        missing = [name for name in raw["trainer_files"] if not (directory / name).is_file()]
        if missing:
            raise CheckpointError(f"{directory}: trainer state file(s) missing: {', '.join(missing)}")
        return ResumePoint(
            directory=directory,
            step=int(raw["step"]),
            backend=str(raw["backend"]),
            prompts_drawn=int(raw["prompts_drawn"]),
            in_flight=[_drawn(item, k) for k, item in enumerate(raw["in_flight"])],
            ledger=dict(raw["ledger"]),
            evals=list(raw["evals"]),
            elapsed_s=float(raw["elapsed_s"]),
            reward_mean_first=raw.get("reward_mean_first"),
            metrics_rows=list(raw.get("metrics_rows", [])),
        )
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint state ({type(exc).__name__}: {exc})") from None


def _drawn(item: dict[str, object], k: int) -> Drawn:
    """An in-flight entry of state.json; one written before prompts carried their stream index
    (a bare prompt) gets index -1 - k, an index no stream item has."""
    if "prompt" in item:
        return Drawn(int(item["index"]), Prompt(**item["prompt"]))  # type: ignore[arg-type, call-overload]
    return Drawn(-1 - k, Prompt(**item))  # type: ignore[arg-type]


def rewind_run_dir(run_dir: Path, point: ResumePoint) -> None:
    """Drop what the run wrote after the checkpoint: metrics rows and trajectory rows of steps
    after `point.step` (a torn last line is dropped; a trajectory file holding steps on both sides is
    rewritten without the later ones: rundir/trajfiles.py), evaluations of later versions, the
    old summary; keep the old trace as `trace.part-K.json`. Each file is replaced atomically. `point.evals`
    becomes every evaluation of a version ≤ point.step (those that landed after the checkpoint
    was taken included). A checkpoint left half-written (its staging directory: a run stopped or
    killed while writing one) is removed. Idempotent: a kill during the rewind leaves it to be done again."""
    for staging in (run_dir / CHECKPOINTS).glob(".step-*.partial"):
        shutil.rmtree(staging, ignore_errors=True)
    _rewind_metrics(run_dir / "metrics.jsonl", point)
    evals = run_dir / "evals.jsonl"
    by_version = {int(e["version"]): e for e in point.evals}  # type: ignore[call-overload]
    if evals.exists():
        for row in _read_rows(evals):
            if int(row["version"]) <= point.step:  # type: ignore[call-overload]
                by_version.setdefault(int(row["version"]), row)  # type: ignore[call-overload]
    point.evals = [by_version[v] for v in sorted(by_version)]
    rewrite_rows(evals, point.evals)
    (run_dir / "summary.json").unlink(missing_ok=True)
    trajfiles.truncate(run_dir, point.step + 1)
    trace = run_dir / "trace.json"
    if trace.exists():
        part = 0
        while (run_dir / f"trace.part-{part}.json").exists():
            part += 1
        os.replace(trace, run_dir / f"trace.part-{part}.json")


def _rewind_metrics(path: Path, point: ResumePoint) -> None:
    """metrics.jsonl keeps one row for each step 1 … `point.step`, in step order. A row
    that was lost or torn after it was written (a truncated file) is restored from the rows the
    checkpoint carries; a loss the checkpoint cannot repair is refused, never dropped silently."""
    rows = {int(row["step"]): row for row in (_read_rows(path) if path.exists() else [])}  # type: ignore[call-overload]
    rows = {step: row for step, row in rows.items() if 1 <= step <= point.step}
    missing = [step for step in range(1, point.step + 1) if step not in rows]
    saved = {int(row["step"]): row for row in point.metrics_rows}  # type: ignore[call-overload]
    lost = [step for step in missing if step not in saved]
    if lost:
        shown = ", ".join(str(s) for s in lost[:5]) + (" ..." if len(lost) > 5 else "")
        raise CheckpointError(
            f"{path}: the rows of step(s) {shown} are missing or torn and {point.directory.name} cannot restore them; "
            "the file was damaged after it was written: restore it from a backup before resuming"
        )
    for step in missing:
        rows[step] = saved[step]
    rewrite_rows(path, [rows[step] for step in sorted(rows)])


def _read_rows(path: Path) -> list[dict[str, object]]:
    """The rows of a run-directory log; a torn last line is dropped (jsonl.read_rows), any other
    damage refuses the rewind."""
    try:
        return read_rows(path, strict=True)[0]
    except JsonlError as exc:
        raise CheckpointError(f"{exc}; cannot rewind the run directory") from None
