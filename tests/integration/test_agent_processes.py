"""Agents in processes of their own (`rollout.agent_processes`, agents/processes.py): the same
outcomes as on the run's event loop, from another process; a process that dies or holds its loop
fails only the samples it ran and is started again; a cancelled rollout cancels its agents there;
an agent the processes cannot import fails the start in one line; a whole run trains with them."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
from pathlib import Path

import pytest

from relayrl.agents import processes as procs
from relayrl.agents.context import load_agent
from relayrl.agents.processes import AgentProcesses
from relayrl.errors import UserError
from relayrl.orchestrator.replicas import SamplerSlot
from relayrl.orchestrator.stages.agents import AgentError, AgentFailedWarning, agent_failure_reason
from relayrl.types import Prompt, TrajectoryStatus
from support.agentutil import ScriptedSampler, make_rollout, requests_for, run_rollout, tiny_tokenizer

PROMPTS = [Prompt("p0", "23+9=", "32")]

# an agent file: one call through the endpoint with httpx, then what `ctx.sample_index` asks for;
# it writes the pid of the process it ran in to `<dir>/pid-<sample>`
AGENTS = """
import asyncio, os, time
from pathlib import Path
import httpx

HERE = Path(__file__).parent

async def _call(ctx):
    async with httpx.AsyncClient() as client:
        r = await client.post(ctx.base_url + "/completions", json={"model": ctx.model, "prompt": ctx.prompt.text},
                              headers={"Authorization": f"Bearer {ctx.api_key}"})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

async def agent(ctx):
    (HERE / f"pid-{ctx.sample_index}").write_text(str(os.getpid()))
    text = await _call(ctx)
    behaviour = ctx.prompt.metadata.get("do", ["ok"] * 8)[ctx.sample_index]
    if behaviour == "raise":
        raise KeyError("boom " + ctx.api_key)
    if behaviour == "hang":
        try:
            await asyncio.Event().wait()
        finally:
            (HERE / f"cancelled-{ctx.sample_index}").write_text("yes")
    if behaviour == "garbage":
        return "1.0"
    if behaviour == "exit":
        os._exit(3)
    if behaviour == "block":
        time.sleep(30)
    if behaviour == "interrupt":
        raise KeyboardInterrupt
    return float(text.strip() == ctx.prompt.answer)
"""


def agent_file(tmp_path: Path) -> str:
    path = tmp_path / "agents.py"
    path.write_text(textwrap.dedent(AGENTS))
    return f"{path}:agent"


def arithmetic(context: str) -> str:
    return "32"


def prompts(*behaviours: str) -> list[Prompt]:
    return [Prompt("p0", "23+9=", "32", metadata={"do": list(behaviours)})]


def test_agents_run_in_their_processes_with_the_outcomes_of_the_event_loop(tmp_path: Path) -> None:
    spec = agent_file(tmp_path)
    tok = tiny_tokenizer()
    sampler = ScriptedSampler(tok, arithmetic)
    rollout = make_rollout(tok, load_agent(spec), timeout_s=2.0, processes=AgentProcesses(spec, 2))
    with pytest.warns(AgentFailedWarning):
        groups = asyncio.run(run_rollout(rollout, sampler, requests_for(tok, prompts("ok", "raise", "hang", "garbage", "ok", "ok"), 6)))
    ts = sorted(groups[0].trajectories, key=lambda t: t.sample_index)
    assert [agent_failure_reason(t) for t in ts] == [None, "raised", "timeout", "raised", None, None]
    assert ts[0].status is TrajectoryStatus.OK and ts[0].agent_reward == 1.0 and len(ts[0].turns) == 1
    assert "KeyError: 'boom <redacted>'" in (ts[1].error or "")  # the episode's key redacted in its process
    assert "returned a str" in (ts[3].error or "")
    assert (tmp_path / "cancelled-2").read_text() == "yes"  # timed out: cancelled in its process
    pids = {int((tmp_path / f"pid-{i}").read_text()) for i in range(6)}
    assert os.getpid() not in pids and len(pids) == 2  # both processes took calls


def test_a_process_that_dies_or_holds_its_loop_fails_its_samples_and_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(procs, "REPLY_SLACK_S", 0.5)
    monkeypatch.setattr(procs, "CANCEL_GRACE_S", 0.2)
    spec = agent_file(tmp_path)
    tok = tiny_tokenizer()
    pool = AgentProcesses(spec, 1)
    rollout = make_rollout(tok, load_agent(spec), timeout_s=1.0, processes=pool)

    async def main() -> list[list[str | None]]:
        await rollout.start()
        try:
            reasons = []
            for behaviours in (["exit"], ["block"], ["ok"]):
                pid = pool._slots[0].proc.pid if pool._slots[0] is not None else None
                groups = await rollout(SamplerSlot(0, ScriptedSampler(tok, arithmetic)), requests_for(tok, prompts(*behaviours), 1))
                t = groups[0].trajectories[0]
                reasons.append([agent_failure_reason(t), t.error])
                assert pid is None or int((tmp_path / "pid-0").read_text()) == pid
            return reasons
        finally:
            await rollout.stop()

    started = time.monotonic()
    with pytest.warns(AgentFailedWarning):
        (exited, e1), (blocked, e2), (ok, _) = asyncio.run(main())
    assert exited == "raised" and "exited with code 3" in (e1 or "")
    assert blocked == "timeout" and "held that process's event loop" in (e2 or "")
    assert ok is None  # a fresh process took the next call
    assert time.monotonic() - started < 25  # the blocked process was killed, not waited for (30 s)


def test_a_cancelled_rollout_cancels_its_agents_in_their_processes(tmp_path: Path) -> None:
    spec = agent_file(tmp_path)
    tok = tiny_tokenizer()
    rollout = make_rollout(tok, load_agent(spec), processes=AgentProcesses(spec, 1))

    async def main() -> None:
        await rollout.start()
        try:
            task = asyncio.create_task(rollout(SamplerSlot(0, ScriptedSampler(tok, arithmetic)), requests_for(tok, prompts("hang"), 1)))
            while not (tmp_path / "pid-0").exists():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if (tmp_path / "cancelled-0").exists():
                    return
                await asyncio.sleep(0.05)
        finally:
            await rollout.stop()

    asyncio.run(main())
    assert (tmp_path / "cancelled-0").read_text() == "yes"


def test_an_agent_raising_keyboardinterrupt_in_its_process_stops_the_run(tmp_path: Path) -> None:
    spec = agent_file(tmp_path)
    tok = tiny_tokenizer()
    rollout = make_rollout(tok, load_agent(spec), processes=AgentProcesses(spec, 1))
    with pytest.raises(AgentError, match="KeyboardInterrupt"):
        asyncio.run(run_rollout(rollout, ScriptedSampler(tok, arithmetic), requests_for(tok, prompts("interrupt"), 1)))


def test_an_agent_the_processes_cannot_import_fails_the_start_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "only_here.py"
    path.write_text(
        "import os\n"
        "if os.environ.get('RELAYRL_TEST_PARENT') != str(os.getpid()):\n"
        "    raise ImportError('not here')\n"
        "async def agent(ctx):\n"
        "    return 1.0\n"
    )
    os.environ["RELAYRL_TEST_PARENT"] = str(os.getpid())
    try:
        load_agent(f"{path}:agent")  # imports in this process
        pool = AgentProcesses(f"{path}:agent", 2)
        with pytest.raises(UserError) as info:
            asyncio.run(pool.start())
    finally:
        del os.environ["RELAYRL_TEST_PARENT"]
        asyncio.run(pool.stop())
    message = str(info.value)
    assert "\n" not in message and "rollout.agent_processes" in message and "not here" in message and str(path) in message
