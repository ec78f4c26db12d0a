"""`relayrl bench agent`: agent mode beside the multi-turn environment path on the same task.

Every run is the agent recipe (recipes/agent.toml: the tiny model, 2-digit arithmetic, G = 8,
16 prompts a step), shortened and without evaluation. (agent) trains the example agent
examples/agents/completions_agent.py: "draft, then answer", two /v1/completions calls per episode
through the `openai` client and the endpoint, as the recipe runs it (its agents in
`rollout.agent_processes` processes of their own); (loop) the same with the agents on the run's
event loop (`rollout.agent_processes = 0`). (env) trains the built-in environment `draft_answer`
(envs/draft_answer.py): the same two turns and the same reward, sampled by the episode runner with
no HTTP. What differs: the second turn's context. The agent sends its draft's text stripped and a
newline, re-tokenized by the endpoint; the runner keeps the draft's sampled tokens (its
end-of-sequence token included) and appends the newline and the question. Both
train one sequence per episode.

Figures per run (medians over the repeats, run round-robin): samples/s (the run's summary),
trainer busy, sampler busy, sampling calls per step (from the trace), and the ratio agent/env
against the target AGENT_TARGET (agent mode within 2x of the environment path; loop/env beside
it). Then where an agent call's time goes without the model: `endpoint` (agents on the loop) and
`endpoint_processes` (in 2 agent processes), one step's episodes (16 prompts x 8) of the example
agent through the endpoint on a sampler that answers at once (`_Instant`): wall time per call,
and the CPU time per call of the run's process (with the agents on the loop: the `openai`
client, HTTP, the endpoint's parsing, tokenizing and recording, everything agent mode adds to a
sampled turn; with agent processes: what stays in the run's process, the endpoint's side).

Invariant: nothing here asserts a time; both configurations run one after the other in this
process on the same workload (machines are noisy: the ratio is the figure).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from relayrl.analysis import timeline
from relayrl.backends.protocols import Sampler
from relayrl.config.schema import Config, load_config
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.program import RunResult
from relayrl.recipes import shipped_recipe
from relayrl.types import Completion, GenerateResult, Prompt, SampleRequest, TurnRequest, TurnResult, Weights

__all__ = ["AGENT_CONFIGS", "AGENT_TARGET", "run_agent", "run_endpoint"]

#: agent samples/s over the environment path's, at least
AGENT_TARGET = 0.5

_COMMON = ["eval.enabled=false", "orchestrator.checkpoint_every=0"]
AGENT_CONFIGS: dict[str, list[str]] = {
    "agent": [],
    "loop": ["rollout.agent_processes=0"],
    "env": [  # on the agent recipe's other values (task.agent dropped)
        'task.environment="draft_answer"',
        'task.observation_template="{observation}"',
        "rollout.max_turns=2",
    ],
}


def _recipe_overrides(path: Path, drop: set[str]) -> list[str]:
    """`path`'s values as `--set` items (section.key=TOML value), but the keys in `drop`."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    items = []
    for section, values in data.items():
        for key, value in values.items():
            if f"{section}.{key}" not in drop:
                items.append(f"{section}.{key}={json.dumps(value)}")
    return items


def _config(label: str, steps: int, extra: list[str]) -> Config:
    overrides = [f"run.steps={steps}", *_COMMON, *AGENT_CONFIGS[label], *extra]
    if label != "env":
        return load_config(shipped_recipe("agent"), overrides)
    return load_config(None, [*_recipe_overrides(shipped_recipe("agent"), {"task.agent", "rollout.agent_processes"}), *overrides])


class _Instant(Sampler):
    """Answers every turn at once with the same two tokens (no model)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.calls = 0

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        raise NotImplementedError("agent calls only")

    async def generate_turns(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        self.calls += 1
        return [TurnResult(r.episode, Completion(list(self.tokens), [-0.1] * len(self.tokens), "", "stop"), 0, 0) for r in requests]

    async def end_episodes(self, episodes: Sequence[str]) -> None:
        return None

    async def load_weights(self, weights: Weights) -> None:
        return None


def run_endpoint(rounds: int = 3, prompts: int = 16, samples: int = 8, processes: int = 0) -> dict[str, float]:
    """`rounds` rollouts of `prompts` x `samples` episodes of the example agent on `_Instant`, its
    agents in `processes` agent processes (0: on the loop): the median wall seconds per agent call
    (two calls an episode), the CPU seconds per call of this process, and sampling calls per round."""
    from transformers import AutoTokenizer

    from relayrl.agents.context import load_agent
    from relayrl.agents.endpoint import AgentEndpoint, EndpointSettings, Tokenizer
    from relayrl.agents.processes import AgentProcesses
    from relayrl.models.loading import shipped_model_dir
    from relayrl.orchestrator.replicas import SamplerSlot
    from relayrl.orchestrator.stages.agents import AgentRollout, AgentSettings
    from relayrl.telemetry.tracer import Tracer

    cfg = load_config(shipped_recipe("agent"))
    assert cfg.task.agent is not None
    tok = cast(Tokenizer, AutoTokenizer.from_pretrained(shipped_model_dir()))
    agent = load_agent(cfg.task.agent)
    settings = EndpointSettings(model="policy", max_new_tokens=cfg.rollout.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
    pool = AgentProcesses(cfg.task.agent, processes) if processes > 0 else None
    rollout = AgentRollout(agent, AgentEndpoint(settings, tok), AgentSettings(name="bench", model="policy"), Tracer(None, {}), pool)
    sampler = _Instant([int(i) for i in tok("12", add_special_tokens=False)["input_ids"]])
    rng = random.Random(0)
    requests = []
    for g in range(prompts):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        text = f"{a}+{b}="
        ids = [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
        requests.append(SampleRequest(g, Prompt(f"bench-{g}", text, str(a + b)), ids, samples, f"bench{g}"))
    walls: list[float] = []
    cpus: list[float] = []

    async def main() -> None:
        await rollout.start()
        try:
            for _ in range(rounds + 1):  # the first (the endpoint's and the client's first use) is not counted
                wall, cpu = time.perf_counter(), time.process_time()
                await rollout(SamplerSlot(0, sampler), requests)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
        finally:
            await rollout.stop()

    asyncio.run(main())
    calls = 2 * prompts * samples
    return {
        "wall_ms_per_call": statistics.median(walls[1:]) / calls * 1e3,
        "cpu_ms_per_call": statistics.median(cpus[1:]) / calls * 1e3,
        "first_round_s": walls[0],
        "sampling_calls_per_round": sampler.calls / (rounds + 1),
    }


def _figures(result: RunResult, steps: int) -> dict[str, float]:
    spans = timeline.spans(result.tracer.events)
    generate = [s for s in spans if s.lane.startswith("sampler/") and s.name == "generate"]
    summary = result.summary

    def number(key: str) -> float:
        value = summary.get(key)
        return float(value) if isinstance(value, int | float) else float("nan")

    return {
        "samples_per_s": number("samples_per_s"),
        "trainer_busy": number("trainer_busy_fraction"),
        "sampler_busy": timeline.lane_busy_fraction(spans, "sampler/", "generate"),
        "sampling_calls_per_step": len(generate) / max(1, steps),
        "wall_s": number("wall_time_s"),
    }


def run_agent(steps: int = 8, repeats: int = 1, extra: list[str] | None = None) -> dict[str, object]:
    """(agent) and (env) (see the module), `repeats` times round-robin; medians, and the ratio."""
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in AGENT_CONFIGS}
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-agent-") as tmp:
        for rep in range(repeats):
            for label in AGENT_CONFIGS:
                cfg = _config(label, steps, extra or [])
                result = asyncio.run(build_program(cfg, run_dir=Path(tmp) / f"{label}{rep}").run())
                runs[label].append(_figures(result, steps))
    figures: dict[str, object] = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    agent, loop, env = figures["agent"], figures["loop"], figures["env"]
    assert isinstance(agent, dict) and isinstance(loop, dict) and isinstance(env, dict)
    ratio = agent["samples_per_s"] / env["samples_per_s"]
    figures["ratio"] = ratio
    figures["loop_ratio"] = loop["samples_per_s"] / env["samples_per_s"]
    figures["agent_processes"] = _config("agent", steps, extra or []).rollout.agent_processes
    figures["target"] = AGENT_TARGET
    figures["met"] = bool(ratio >= AGENT_TARGET)
    figures["endpoint"] = run_endpoint()
    figures["endpoint_processes"] = run_endpoint(processes=2)
    return figures
