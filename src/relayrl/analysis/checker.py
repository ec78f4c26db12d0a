"""The trace checker: verifies the step-boundary rules 1–6 and the staleness bound from
`trace.json` alone (`relayrl check-trace RUN_DIR`).

Rules checked (N and N+1 consecutive committed steps; "mb0" = train_step microbatch 0):
  structure  train_steps of N lie between optim(N−1) and optim(N), as the orchestrator issued them
             (lane "trainer") and, on Ray, as the trainer actor ran them (lane "actor:trainer",
             give or take its clock error): so an mb0(N+1) queued behind optim(N) ("ahead") ran
             after it; weight-sync rounds don't overlap
  rule 1     get_metrics(N) starts after optim(N) ends; in overlapped mode mb0(N+1) is not held
             by it (not issued the moment a non-trivial fetch landed, with no data wait between)
  rule 2     get_metrics(N) ends before optim(N+1) starts
  rule 3     overlapped mode: bookkeeping spans of N start after mb0(N+1) was issued (after
             optim(N) for the last step) and ran on a thread other than the event loop's
  rule 4     bookkeeping spans of N end before optim(N+1) starts; a completed run has all five
             bookkeeping spans for every committed step
  rule 5     a completed run committed every step it started (no step hung at its boundary)
  rule 6     on_step_end runs in step order, after the step's commit and its metric reduction
  staleness  every train_step's step − 1 − min_version ≤ max_staleness (step N trains from version N − 1;
             min_version is the oldest version that sampled a token of the micro-batch)
  checkpoint checkpoint(N) starts after optim(N) ends and after step N's metrics and trajectories
             were logged, and ends before optim(N+1) starts (it holds the optimizer state of N)
  actors     (Ray) every span timed inside an actor lies within the orchestrator's call of it
             (`call_start`–`call_end`), give or take the error of that actor's clock estimate
             (`relayrl_clock`); a sampler actor ran one call at a time (with rollout.interruptible,
             run info `interruptible`: its load_weights calls one at a time, beside the others);
             the trainer actor ran one training call (train_step, optim_step, load_state) at a time

Invariant: the checker only reads; a violation message names the rule, the step and the spans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relayrl.analysis.timeline import ACTOR_TRAINER, Span, run_info, spans
from relayrl.telemetry.tracer import TraceEvent, load_trace

BOOKKEEPING = ("reduce_metrics", "log_metrics", "log_trajectories", "on_step_end", "release_memory")
EPS = 2e-6  # trace timestamps are rounded to 0.1 µs
HELD_FETCH_MIN = 1e-3  # a fetch shorter than this cannot visibly hold the next micro-batch
HELD_WINDOW = 0.5e-3
ACTOR_LANE = "actor:"  # lanes of spans timed inside Ray actors (backends.ray.spans)
TRAINER_SERIAL = ("train_step", "optim_step", "load_state")  # the trainer actor's "train" concurrency group


@dataclass(slots=True)
class CheckReport:
    violations: list[str] = field(default_factory=list)
    steps: int = 0
    completed: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations


def _fmt(s: Span) -> str:
    return f"{s.name}(step {s.step}) [{s.start * 1e3:.3f}–{s.end * 1e3:.3f} ms]"


def check_events(events: list[TraceEvent]) -> CheckReport:
    info = run_info(events)
    overlap = bool(info.get("overlap_bookkeeping", True))
    max_staleness = int(info.get("max_staleness", 0))  # type: ignore[call-overload]
    loop_thread = str(info.get("loop_thread", "MainThread"))
    completed = any(
        e.get("ph") == "i" and e.get("name") == "run_end" and isinstance(args := e.get("args"), dict) and args.get("status") == "completed"
        for e in events
    )
    all_spans = spans(events)
    report = CheckReport(completed=completed)
    v = report.violations

    trainer = [s for s in all_spans if s.lane == "trainer"]
    optim = {s.step: s for s in trainer if s.name == "optim_step"}
    train = [s for s in trainer if s.name == "train_step"]
    mb0 = {s.step: s for s in train if s.args.get("microbatch") == 0}
    fetch = {s.step: s for s in all_spans if s.lane == "trainer.fetch" and s.name == "get_metrics"}
    books: dict[int, dict[str, Span]] = {}
    for s in all_spans:
        if s.lane == "bookkeeping":
            books.setdefault(s.step, {})[s.name] = s
    report.steps = len(optim)

    # structure
    for s in train:
        if s.step in optim and s.end > optim[s.step].start + EPS:
            v.append(f"structure: {_fmt(s)} ends after {_fmt(optim[s.step])} starts")
        if s.step - 1 in optim and s.start < optim[s.step - 1].end - EPS:
            v.append(f"structure: {_fmt(s)} starts before {_fmt(optim[s.step - 1])} ends")
        version = s.args.get("min_version")
        if isinstance(version, int) and s.step - 1 - version > max_staleness:  # step N trains from version N - 1
            v.append(
                f"staleness: train_step(step {s.step}, microbatch {s.args.get('microbatch')}) trains a trajectory of version "
                f"{version}: staleness {s.step - 1 - version} > max_staleness {max_staleness}"
            )
    _check_actor_structure(events, all_spans, v)
    syncs = [s for s in all_spans if s.name == "weight_sync"]
    for a, b in zip(syncs, syncs[1:]):
        if b.start < a.end - EPS:
            v.append(f"structure: weight_sync rounds overlap (versions {a.args.get('version')} and {b.args.get('version')})")

    for n, opt in sorted(optim.items()):
        f = fetch.get(n)
        nxt_opt = optim.get(n + 1)
        nxt_mb0 = mb0.get(n + 1)
        if f is None:
            if completed:
                v.append(f"rule 2: step {n} committed but its get_metrics never ran")
        else:
            if f.start < opt.end - EPS:
                v.append(f"rule 1: {_fmt(f)} started before {_fmt(opt)} committed")
            if nxt_opt is not None and f.end > nxt_opt.start + EPS:
                v.append(f"rule 2: {_fmt(f)} landed after {_fmt(nxt_opt)} was issued")
            if overlap and nxt_mb0 is not None and f.dur >= HELD_FETCH_MIN and f.end - EPS <= nxt_mb0.start <= f.end + HELD_WINDOW:
                waited = any(
                    s.name in ("wait_data", "pack") and s.step == n + 1 and s.end >= f.end - EPS and s.end <= nxt_mb0.start + EPS
                    for s in all_spans
                )
                if not waited:
                    v.append(f"rule 1: train_step(step {n + 1}, microbatch 0) was issued the moment {_fmt(f)} landed: held by the fetch")
        parts = books.get(n, {})
        if completed:
            missing = [name for name in BOOKKEEPING if name not in parts]
            if missing:
                v.append(f"rule 4: step {n} committed but bookkeeping never ran {', '.join(missing)}")
        for part in parts.values():
            if nxt_opt is not None and part.end > nxt_opt.start + EPS:
                v.append(f"rule 4: {_fmt(part)} finished after {_fmt(nxt_opt)} was issued")
            if not overlap:
                continue
            gate = nxt_mb0.start if nxt_mb0 is not None else opt.end
            if part.start < gate - EPS:
                what = f"train_step(step {n + 1}, microbatch 0) was issued" if nxt_mb0 is not None else f"optim_step({n}) committed"
                v.append(f"rule 3: {_fmt(part)} started before {what}")
            if part.args.get("thread") == loop_thread:
                v.append(f"rule 3: {_fmt(part)} ran on the event loop's thread {loop_thread!r}")
        end = parts.get("on_step_end")
        if end is not None:
            if end.start < opt.end - EPS:
                v.append(f"rule 6: {_fmt(end)} ran before step {n} committed")
            red = parts.get("reduce_metrics")
            if red is None or end.start < red.end - EPS:
                v.append(f"rule 6: {_fmt(end)} ran before step {n}'s result was reduced")

    ends = sorted((s for s in all_spans if s.name == "on_step_end"), key=lambda s: s.start)
    for a, b in zip(ends, ends[1:]):
        if b.step <= a.step:
            v.append(f"rule 6: on_step_end(step {b.step}) ran after on_step_end(step {a.step})")

    for ck in (s for s in all_spans if s.name == "checkpoint"):
        n = ck.step
        if n in optim and ck.start < optim[n].end - EPS:
            v.append(f"checkpoint: {_fmt(ck)} started before {_fmt(optim[n])} committed")
        if n + 1 in optim and ck.end > optim[n + 1].start + EPS:
            v.append(f"checkpoint: {_fmt(ck)} finished after {_fmt(optim[n + 1])} was issued")
        for name in ("log_metrics", "log_trajectories"):
            logged = books.get(n, {}).get(name)
            if logged is None or logged.end > ck.start + EPS:
                v.append(f"checkpoint: {_fmt(ck)} started before step {n}'s {name} finished")

    if completed:
        started = {s.step for s in train}
        hung = sorted(started - set(optim))
        if hung:
            v.append(f"rule 5: the run completed but step {hung[0]} was started and never committed")
    _check_actors(events, all_spans, v, interruptible=bool(info.get("interruptible", False)))
    return report


def _clock_errors(events: list[TraceEvent]) -> dict[str, float]:
    """Per actor lane, the largest error of its clock estimates (`relayrl_clock`)."""
    errors: dict[str, float] = {}
    for e in events:
        args = e.get("args")
        if e.get("ph") == "M" and e.get("name") == "relayrl_clock" and isinstance(args, dict):
            lane, error = str(args.get("lane")), float(args.get("error_s", 0.0))
            errors[lane] = max(errors.get(lane, 0.0), error)
    return errors


def _check_actor_structure(events: list[TraceEvent], all_spans: list[Span], v: list[str]) -> None:
    """structure on the trainer actor's lane: the order in which the actor ran the calls."""
    tolerance = _clock_errors(events).get(ACTOR_TRAINER, 0.0) + EPS
    actor = [s for s in all_spans if s.lane == ACTOR_TRAINER]
    optim = {s.step: s for s in actor if s.name == "optim_step"}
    for s in actor:
        if s.name != "train_step":
            continue
        if s.step in optim and s.end > optim[s.step].start + tolerance:
            v.append(f"structure: {ACTOR_TRAINER} {_fmt(s)} ends after {_fmt(optim[s.step])} starts")
        if s.step - 1 in optim and s.start < optim[s.step - 1].end - tolerance:
            ahead = " (queued ahead)" if s.args.get("ahead") else ""
            v.append(f"structure: {ACTOR_TRAINER} {_fmt(s)}{ahead} starts before {_fmt(optim[s.step - 1])} ends")


def _check_actors(events: list[TraceEvent], all_spans: list[Span], v: list[str], *, interruptible: bool = False) -> None:
    errors = _clock_errors(events)  # per actor lane, the largest clock-estimate error
    lanes: dict[str, list[Span]] = {}
    for s in all_spans:
        if s.lane.startswith(ACTOR_LANE):
            lanes.setdefault(s.lane, []).append(s)
    for lane, actor_spans in lanes.items():
        tolerance = errors.get(lane, 0.0) + EPS
        for s in actor_spans:
            call_start, call_end = s.args.get("call_start"), s.args.get("call_end")
            if not isinstance(call_start, int | float) or not isinstance(call_end, int | float):
                v.append(f"actors: {lane} {_fmt(s)} has no call window")
            elif s.start < call_start - tolerance or s.end > call_end + tolerance:
                v.append(
                    f"actors: {lane} {_fmt(s)} lies outside its call [{call_start * 1e3:.3f}–{call_end * 1e3:.3f} ms] "
                    f"by more than the clock error {tolerance * 1e3:.3f} ms"
                )
        if lane == ACTOR_TRAINER:
            serial = [[s for s in actor_spans if s.name in TRAINER_SERIAL]]
        elif interruptible:  # loads run in their own concurrency group, beside the other calls
            serial = [[s for s in actor_spans if s.name == "load_weights"], [s for s in actor_spans if s.name != "load_weights"]]
        else:
            serial = [actor_spans]
        for exclusive in serial:
            for a, b in zip(exclusive, exclusive[1:]):
                if b.start < a.end - tolerance:
                    v.append(f"actors: {lane} ran {_fmt(a)} and {_fmt(b)} at once")


def check_run_dir(run_dir: Path) -> CheckReport:
    """Check `run_dir/trace.json` (or the trace file `run_dir`). A crashed run's cut-off trace is
    checked as far as it goes; FileNotFoundError without a trace, and `load_trace`'s ValueError
    naming the file and event when it is not a trace."""
    path = run_dir / "trace.json" if run_dir.is_dir() else run_dir
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    return check_events(load_trace(path))
