"""Agents in whole runs on the shipped tiny model (task.agent): the completions example trains
through the endpoint on exactly the tokens its replica sampled, failing agents are counted while
the run goes on (or fail it under task.strict_agents), and the configurations agents cannot run
with are refused in one line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from relayrl.backends.local.collate import TorchCollator
from relayrl.backends.local.sampler import LocalSampler
from relayrl.config.schema import ConfigError, load_config
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.stages.agents import AgentError, AgentFailedWarning
from relayrl.recipes import shipped_recipe
from relayrl.types import MicroBatch, Trajectory, TurnRequest, TurnResult
from support.agentutil import Sampled, assert_trained_as_sampled, sampled_of
from support.cli import relayrl
from support.simutil import run_checked

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents" / "completions_agent.py"
QUICK = [
    "run.steps=2",
    "rollout.num_generations=4",
    "rollout.groups_per_step=4",
    "rollout.prompts_per_request=4",
    "task.heldout_size=16",
    "orchestrator.release_memory=false",
    "orchestrator.checkpoint_every=0",
    "run.save_model=false",
]


def agent_config(agent: str, *extra: str) -> list[str]:
    return [*QUICK, f"task.agent={json.dumps(agent)}", *extra]


@pytest.mark.parametrize("processes", [0, 2], ids=["on-the-loop", "agent-processes"])
def test_the_recipe_trains_the_completions_example_on_exactly_the_sampled_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int
) -> None:
    sampled: list[Sampled] = []
    trained: list[Trajectory] = []
    generate_turns, collate = LocalSampler.generate_turns, TorchCollator.collate

    async def recording_turns(self: LocalSampler, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        results = await generate_turns(self, requests)
        sampled.extend(sampled_of(requests, results))
        return results

    def recording_collate(self: TorchCollator, mb: MicroBatch) -> object:
        trained.extend(mb.trajectories)
        return collate(self, mb)

    monkeypatch.setattr(LocalSampler, "generate_turns", recording_turns)
    monkeypatch.setattr(TorchCollator, "collate", recording_collate)
    cfg = load_config(shipped_recipe("agent"), [*QUICK, f"rollout.agent_processes={processes}"])
    assert cfg.task.agent == f"{EXAMPLE}:agent"  # anchored to the recipe's directory
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=240)
    assert result is not None
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["accuracy_before"] is not None and summary["accuracy_after"] is not None
    assert summary["ledger"]["trajectories_failed"] == 0
    assert all(t.agent_reward is not None for t in trained)
    two_calls = assert_trained_as_sampled(sampled, trained)
    assert two_calls > len(trained) // 2  # the answer call continues the draft's sequence


def test_agents_that_fail_are_counted_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sample 0 of every group raises, sample 1 makes two unrelated calls (two training samples of
    its episode): the run completes, its trace and ledger check out."""
    trained: list[Trajectory] = []
    collate = TorchCollator.collate

    def recording_collate(self: TorchCollator, mb: MicroBatch) -> object:
        trained.extend(mb.trajectories)
        return collate(self, mb)

    monkeypatch.setattr(TorchCollator, "collate", recording_collate)
    agent = tmp_path / "flaky.py"
    agent.write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('example', {str(EXAMPLE)!r})\n"
        "example = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(example)\n"
        "import openai\n"
        "async def agent(ctx):\n"
        "    if ctx.sample_index == 0:\n"
        "        raise RuntimeError('flaky')\n"
        "    if ctx.sample_index == 1:  # two calls, the second not extending the first: two samples\n"
        "        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:\n"
        "            for prompt in (ctx.prompt.text, '1+' + ctx.prompt.text):\n"
        "                await client.completions.create(model=ctx.model, prompt=prompt, max_tokens=4)\n"
        "        return 0.25\n"
        "    return await example.agent(ctx)\n"
    )
    cfg = load_config(None, agent_config(f"{agent}:agent", "run.backend=local", "task.kind=arithmetic", "rollout.max_new_tokens=4"))
    with pytest.warns(AgentFailedWarning, match="flaky"):
        run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=240)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    failures = summary["ledger"]["reward_failures"]
    assert set(failures) == {"agent"} and failures["agent"]["raised"] >= 2  # one per group of each step
    assert summary["ledger"]["trajectories_failed"] == failures["agent"]["raised"]
    split = [t for t in trained if t.sample_index == 1]
    assert split and all(t.agent_reward == 0.25 and len(t.turns) == 1 for t in split)
    assert len({(t.group_id, tuple(t.prompt_tokens)) for t in split}) == len(split)  # per group: the two calls' samples


def test_under_strict_agents_the_first_failure_fails_the_run(tmp_path: Path) -> None:
    agent = tmp_path / "broken.py"
    agent.write_text("async def agent(ctx):\n    raise RuntimeError('broken agent')\n")
    cfg = load_config(
        None, agent_config(f"{agent}:agent", "run.backend=local", "task.kind=arithmetic", "task.strict_agents=true", "eval.enabled=false")
    )
    program = build_program(cfg, run_dir=tmp_path / "run")
    with pytest.raises(AgentError, match=r"RuntimeError: broken agent \(task.strict_agents = true\)"):
        asyncio.run(asyncio.wait_for(program.run(), 120))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "AgentError" in summary["error"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.backend=sim"], "task.agent needs run.backend = 'local'"),
        (["run.backend=local", 'task.environment="arithmetic_feedback"'], "task.agent and task.environment are both set"),
        (["run.backend=sim", "ray.enabled=true"], "task.agent needs run.backend = 'local'"),
    ],
)
def test_what_agents_cannot_run_with_is_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"task.agent={json.dumps(f'{EXAMPLE}:agent')}", *overrides])


@pytest.mark.parametrize("overrides", [["ray.enabled=true"], ["rollout.engine=vllm"], ["ray.enabled=true", "rollout.engine=vllm"]])
def test_agents_run_on_ray_and_on_the_vllm_engine(overrides: list[str]) -> None:
    """Accepted (the runs: tests/ray/test_ray_agents.py, tests/vllm/test_vllm_agents.py)."""
    cfg = load_config(None, ["run.backend=local", f"task.agent={json.dumps(f'{EXAMPLE}:agent')}", *overrides])
    assert cfg.task.agent is not None


def test_an_agent_that_is_not_an_async_function_is_refused(tmp_path: Path) -> None:
    agent = tmp_path / "sync_agent.py"
    agent.write_text("def agent(ctx):\n    return 1.0\n")
    cfg = load_config(None, ["run.backend=local", "task.kind=arithmetic", f"task.agent={json.dumps(f'{agent}:agent')}"])
    with pytest.raises(ValueError, match=r"task.agent = .* is a function, not an async function"):
        build_program(cfg, run_dir=tmp_path / "run")


def test_threads_and_subprocesses_an_agent_leaves_are_named_in_one_line_and_never_keep_relayrl_alive(tmp_path: Path) -> None:
    """A non-daemon thread an agent started kept the process alive after `done:` (for ever), and
    its subprocess outlived the run."""
    pid_file = tmp_path / "child.pid"
    agent = tmp_path / "leaves.py"
    agent.write_text(
        "import subprocess, threading\n"
        "import openai\n"
        "started = []\n"
        "async def agent(ctx):\n"
        "    if not started:\n"
        "        started.append(1)\n"
        "        threading.Thread(target=threading.Event().wait, name='agent-forever', daemon=False).start()\n"
        f"        open({str(pid_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '1000']).pid))\n"
        "    async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:\n"
        "        await client.completions.create(model=ctx.model, prompt=ctx.prompt.text, max_tokens=4)\n"
        "    return float(ctx.sample_index % 2)\n"
    )
    sets = [
        *QUICK,
        "run.steps=1",
        "run.backend=local",
        "task.kind=arithmetic",
        "eval.enabled=false",
        f"task.agent={json.dumps(f'{agent}:agent')}",
    ]
    result = relayrl("train", *[a for s in sets for a in ("--set", s)], "--set", f"run.output_dir={json.dumps(str(tmp_path))}", timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if "left running" in line]
    assert len(said) == 1, result.stderr[-2000:]
    pid = int(pid_file.read_text())
    assert "'agent-forever'" in said[0] and f"pid {pid} 'sleep 1000'" in said[0] and "ended (SIGTERM)" in said[0]
    assert "done: 1 steps" in result.stdout
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["status"] == "completed"
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # ended (a zombie of the gone run at most)
