"""Inputs too long for the model or the row budget are filtered and counted, never a crash
mid-run: a prompt that leaves no room in the model's context for the completions is never
sampled, and a trajectory longer than a packed row (train.row_tokens) is not packed."""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.config.schema import load_config
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.ledger import Ledger
from relayrl.orchestrator.stages.advantage import filter_reason
from relayrl.orchestrator.stages.dispatch import PromptTooLongWarning, dispatch_stage
from relayrl.orchestrator.window import DispatchWindow
from relayrl.rundir.checkpoint import PromptSource
from relayrl.types import FilterReason, Group, Prompt, SampleRequest, Trajectory
from support.cli import child_env, relayrl, relayrl_argv
from support.simutil import run_checked
from support.trajectories import trajectory


def _traj(prompt: int, completion: int, sample: int = 0) -> Trajectory:
    return trajectory(
        sample=sample,
        prompt=Prompt("p", "t", "1"),
        prompt_tokens=[1] * prompt,
        completion_tokens=[2] * completion,
        logprob=-1.0,
        text="1",
        reward=float(sample),
    )


def test_a_trajectory_longer_than_a_row_filters_its_group() -> None:
    group = Group(0, [_traj(5, 3, 0), _traj(5, 6, 1)])  # 8 and 11 tokens
    assert filter_reason(group, dynamic_sampling=False, row_tokens=11) is None
    assert filter_reason(group, dynamic_sampling=False, row_tokens=10) is FilterReason.TOO_LONG
    assert filter_reason(group, dynamic_sampling=False) is None  # no bound given


def test_a_prompt_too_long_for_the_context_is_filtered_at_dispatch_not_sampled() -> None:
    async def main() -> tuple[list[SampleRequest], Ledger, DispatchWindow]:
        prompts = PromptSource(iter([Prompt(f"p{i}", "x" * (30 if i == 1 else 3), "1") for i in range(8)]))
        ledger, window = Ledger(), DispatchWindow(groups_per_step=2, max_staleness=0, total_steps=1)
        outbox: asyncio.Queue[list[SampleRequest]] = asyncio.Queue()
        task = asyncio.create_task(
            dispatch_stage(
                prompts,
                lambda text: [7] * len(text),
                window,
                ledger,
                outbox,
                num_generations=4,
                prompts_per_request=2,
                max_prompt_tokens=10,
            )
        )
        await asyncio.sleep(0.05)
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError), outcome  # it was waiting for credit, not failing
        sent: list[SampleRequest] = []
        while not outbox.empty():
            sent.extend(outbox.get_nowait())
        return sent, ledger, window

    with pytest.warns(PromptTooLongWarning, match="'p1' has 30 tokens, more than the 10"):
        sent, ledger, window = asyncio.run(main())
    assert [r.prompt.prompt_id for r in sent] == ["p0", "p2"]  # p1 never reaches a sampler; its credit went to p2
    assert ledger.as_dict()["groups_filtered"] == {"too_long": 1}
    assert [f.reason for f in ledger.drain_filtered()] == [FilterReason.TOO_LONG]


def test_a_dispatch_whose_every_prompt_is_filtered_yields_to_the_loop_and_never_spins() -> None:
    """Every group filtered at once returns its credit at once, so the stage used to loop without
    ever awaiting: the run's other stages and its stop never ran (no summary on SIGTERM). Bounded
    here: the stream ends after 20,000 prompts, which ended the old loop with an error."""
    ticks: list[int] = []

    def endless() -> Iterator[Prompt]:
        for i in range(20_000):
            yield Prompt(f"p{i}", "x" * 30, "1")

    async def ticker() -> None:
        while True:
            ticks.append(len(ticks))
            await asyncio.sleep(0)

    async def main() -> BaseException | None:
        ledger, window = Ledger(), DispatchWindow(groups_per_step=2, max_staleness=0, total_steps=1)
        outbox: asyncio.Queue[list[SampleRequest]] = asyncio.Queue()
        tick = asyncio.create_task(ticker())
        task = asyncio.create_task(
            dispatch_stage(
                PromptSource(endless()),
                lambda text: [7] * len(text),
                window,
                ledger,
                outbox,
                num_generations=4,
                prompts_per_request=2,
                max_prompt_tokens=10,
            )
        )
        await asyncio.sleep(0.01)
        ran = len(ticks)
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        tick.cancel()
        assert ran > 0, "the loop never ran beside the dispatch stage"
        return outcome

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooLongWarning)
        outcome = asyncio.run(main())
    assert isinstance(outcome, asyncio.CancelledError), outcome  # stopped while dispatching, not at the stream's end


def test_a_jsonl_task_none_of_whose_prompts_fits_is_refused_before_the_run(tmp_path: Path) -> None:
    """It used to say one PromptTooLongWarning and then filter every group until the filter bound."""
    rows = [{"prompt": "9+" * 100 + "9=", "answer": "909"} for _ in range(30)]  # ~200 tokens each
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = ["run.backend=local", "task.kind=jsonl", f"task.path={json.dumps(str(data))}", "run.steps=2", "eval.enabled=false"]
    sets += [f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}"]
    done = relayrl("train", *[a for s in sets for a in ("--set", s)], timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: no training prompt of task.path = {data} fits: each of its 30 rows has more than the 124 tokens")
    assert "the model's context less rollout.max_new_tokens" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_sigterm_while_nearly_every_prompt_is_filtered_winds_down_and_writes_the_summary(tmp_path: Path) -> None:
    """One prompt in 3,001 fits: the dispatch stage filtered the rest without ever awaiting, so a
    SIGTERM was not answered within orchestrator.stop_grace_s and no summary.json was written."""
    import signal
    import subprocess
    import time

    rows = [{"prompt": "1+1=", "answer": "2"}] + [{"prompt": "1+1=" * 100, "answer": "2"}] * 3000
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = ["run.backend=local", "task.kind=jsonl", f"task.path={json.dumps(str(data))}", "run.steps=50", "eval.enabled=false"]
    sets += ["orchestrator.max_filtered_per_step=100000000", "orchestrator.stop_grace_s=10", f"run.output_dir={json.dumps(str(tmp_path))}"]
    child = subprocess.Popen(
        relayrl_argv("train", *[a for s in sets for a in ("--set", s)]),
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        begun = time.monotonic()
        while not (tmp_path / "default" / "trace.json").exists() and time.monotonic() - begun < 180:
            time.sleep(0.1)
        time.sleep(3)  # dispatching, filtering nearly every prompt
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        child.kill()
    assert child.returncode == 143, err[-2000:]
    assert took < 10 and "did not wind down" not in err, err[-2000:]
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["status"] == "cancelled"


def test_a_local_run_with_a_prompt_longer_than_the_context_completes_counting_it(tmp_path: Path) -> None:
    # the shipped model's context is 128 tokens: with 8 new tokens, a prompt may have 120
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    rows[3] = {"prompt": "9+" * 100 + "9=", "answer": "909"}  # ~200 tokens
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = ["run.backend=local", "task.kind=jsonl", f"task.path={tmp_path / 'data.jsonl'}", "run.steps=2", "eval.enabled=false"]
    sets += ["rollout.num_generations=2", "rollout.groups_per_step=4", "rollout.max_new_tokens=8", "orchestrator.release_memory=false"]
    sets += ["train.row_tokens=256"]
    with pytest.warns(PromptTooLongWarning):
        result = run_checked(build_program(load_config(None, sets), run_dir=tmp_path / "run"), timeout=120)
    ledger = result.ledger.as_dict()
    assert ledger["groups_filtered"] == {"too_long": 1}
    assert ledger["groups_trained"] == 8


def test_a_huge_jsonl_line_loads_exactly_and_a_torn_one_is_one_short_error(tmp_path: Path) -> None:
    from relayrl.tasks.jsonl import JsonlTask, JsonlTaskConfig, TaskDataError

    big = "7+" * 1_500_000 + "7="  # a 3 MB prompt
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": big, "answer": "1"}) + "\n")
    assert JsonlTask(JsonlTaskConfig(path=path)).train_prompts[1].text == big
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + '{"prompt": "' + big + '", "answer": "1"\n')
    with pytest.raises(TaskDataError) as info:
        JsonlTask(JsonlTaskConfig(path=path))
    message = str(info.value)
    assert message.startswith(f"{path}, row 2: invalid JSON") and len(message) < 300  # names the row, never echoes it
