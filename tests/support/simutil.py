"""Helpers for pipeline tests: a quick sim config and a runner that always checks the trace."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

from relayrl.analysis.checker import check_run_dir
from relayrl.analysis.timeline import Span, spans
from relayrl.config.schema import Config, load_config
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.program import Program, RunResult
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.tracer import TraceEvent


def sim_config(*overrides: str) -> Config:
    base = [
        "run.steps=4",
        "rollout.num_generations=4",
        "rollout.groups_per_step=4",
        "rollout.prompts_per_request=2",
        "train.row_tokens=64",
        "train.rows_per_microbatch=2",
        "train.share_prompt=false",  # the sim's timings assume one prompt copy per trajectory
        "orchestrator.release_memory=false",  # no gc.freeze inside the test process
    ]
    return load_config(None, base + list(overrides))


class Stopped(Exception):
    """Raised by `StopAt`: the run failed, as if its process had been killed after a step."""


class StopAt(Callback):
    """Fails the run at the end of step `step` (after its logs and any checkpoint of it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, step: int, result: object) -> None:
        if step == self.step:
            raise Stopped(f"stopped at step {step}")


def make_program(cfg: Config, tmp_path: Path, callbacks: Sequence[Callback] = ()) -> Program:
    return build_program(cfg, callbacks, run_dir=tmp_path / "run")


def run_checked(program: Program, timeout: float = 60.0) -> RunResult:
    """Run a program (bounded by a timeout) and verify its trace with the checker."""
    result = asyncio.run(asyncio.wait_for(program.run(), timeout))
    assert program.run_dir is not None
    report = check_run_dir(program.run_dir)
    assert report.ok, report.violations
    assert report.completed
    return result


def trace_spans(result: RunResult) -> list[Span]:
    return spans(result.tracer.events)


def find(all_spans: list[Span], name: str, step: int, **args: object) -> Span:
    for s in all_spans:
        if s.name == name and s.step == step and all(s.args.get(k) == v for k, v in args.items()):
            return s
    raise AssertionError(f"no span {name} step {step} {args}")


def settled_groups(ledger: Mapping[str, object]) -> int:
    """The groups a ledger (`Ledger.as_dict()`) has settled: trained, filtered (every reason) and
    unused; a balanced ledger's equal `groups_dispatched`."""
    trained, filtered, unused = ledger["groups_trained"], ledger["groups_filtered"], ledger["groups_unused"]
    assert isinstance(trained, int) and isinstance(unused, int) and isinstance(filtered, dict), ledger
    return trained + sum(filtered.values()) + unused


def event_args(event: TraceEvent) -> dict[str, object]:
    """A trace event's `args` ({} when it has none)."""
    args = event.get("args")
    return args if isinstance(args, dict) else {}
