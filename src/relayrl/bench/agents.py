"""`relayrl bench agent`: agent mode beside the multi-turn environment path on the same task.

Every run is the agent recipe (recipes/agent.toml: the tiny model, 2-digit arithmetic, G = 8,
16 prompts a step), shortened and without evaluation; with `--model smollm2`, on the smollm2
recipe's SmolLM2-135M-Instruct instead (AGENT_MODELS: plain completions, dynamic sampling off). (agent) trains the example agent
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
trainer busy, sampler busy, sampling calls per step (from the trace), the CPU seconds a step (from
the first step's end to the last's: this process, every thread, and the agent processes apart,
sampled from /proc every 50 ms), and the ratio agent/env against the target AGENT_TARGET (agent
mode within 2x of the environment path; loop/env beside it). Beside it the work bound and the
share of the machine's cores each configuration keeps busy (its CPU seconds over its steps' wall
seconds times the cores): every configuration trains the same samples a step on the same cores,
so where the CPU is the limit (the cores busy) agent/env cannot exceed env's CPU a step over
agent's, however well the work overlaps; where something else is (the trainer's own step, with
cores to spare), the bound does not apply. Then where an agent call's time goes
without the model: `endpoint` (agents on the loop) and `endpoint_processes` (in 2 agent
processes), one step's episodes (16 prompts x 8) of the example agent through the endpoint on a
sampler that answers at once (`_Instant`): wall time per call, and the CPU time per call of the
run's process (with the agents on the loop: the `openai` client, HTTP, the endpoint's parsing,
tokenizing and recording, everything agent mode adds to a sampled turn; with agent processes: what
stays in the run's process, the endpoint's side).

Invariant: nothing here asserts a time; the configurations run one after the other in this
process on the same workload (machines are noisy: the ratio is the figure).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from relayrl.analysis import timeline
from relayrl.backends.protocols import Sampler
from relayrl.config.schema import Config, load_config
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.program import RunResult
from relayrl.recipes import shipped_recipe
from relayrl.types import Completion, GenerateResult, Prompt, SampleRequest, TurnRequest, TurnResult, Weights

__all__ = ["AGENT_CONFIGS", "AGENT_MODELS", "AGENT_TARGET", "run_agent", "run_endpoint"]

#: agent samples/s over the environment path's, at least
AGENT_TARGET = 0.5
#: the cores this process may run on (the runs' and the agent processes' CPU is read against them)
CORES = len(os.sched_getaffinity(0))

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


def _recipe_overrides(path: Path, drop: set[str], sections: set[str] | None = None) -> list[str]:
    """`path`'s values as `--set` items (section.key=TOML value), but the keys in `drop` (and, given
    `sections`, only theirs)."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    items = []
    for section, values in data.items():
        for key, value in values.items():
            if f"{section}.{key}" not in drop and (sections is None or section in sections):
                items.append(f"{section}.{key}={json.dumps(value)}")
    return items


def _smollm2() -> list[str]:
    """The smollm2 recipe's model (SmolLM2-135M-Instruct from its GGUF file) without its chat template
    (the example agent sends plain completions, as the environment path samples them); dynamic
    sampling off: the model rarely answers the bare "23+9=" right, so with it every configuration
    would spend its time sampling anew the groups whose rewards are all 0 (measured: 1,351 of 1,415
    groups dropped in 4 steps), where the bench compares the cost of the same samples a step."""
    model = _recipe_overrides(shipped_recipe("smollm2"), {"model.chat_template"}, {"model"})
    return [*model, "algorithm.dynamic_sampling=false"]


#: the models `bench agent --model` runs the configurations on: their overrides
AGENT_MODELS: dict[str, Callable[[], list[str]]] = {"tiny": list, "smollm2": _smollm2}


def _config(label: str, steps: int, extra: list[str], model: str = "tiny") -> Config:
    overrides = [f"run.steps={steps}", *_COMMON, *AGENT_MODELS[model](), *AGENT_CONFIGS[label], *extra]
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


class _CpuMeter:
    """Samples, every SAMPLE_S, the CPU seconds of this process (every thread) and of its live
    child processes (the agent processes), so that the CPU spent between two trace times can be read."""

    SAMPLE_S = 0.05

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, own CPU s, children's CPU s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relayrl-bench-cpu", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> _CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _children(self) -> float:
        total = 0.0
        for task in os.listdir("/proc/self/task"):
            try:
                pids = open(f"/proc/self/task/{task}/children").read().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    stat = open(f"/proc/{pid}/stat").read()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2 :].split()
                total += (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            self.samples.append((time.perf_counter(), time.process_time(), self._children()))

    def between(self, start: float, end: float) -> tuple[float, float, float]:
        """CPU seconds of this process and of its children from perf_counter `start` to `end`
        (the samples nearest each), and the wall seconds between those samples."""
        if not self.samples:
            return float("nan"), float("nan"), float("nan")
        a = min(self.samples, key=lambda x: abs(x[0] - start))
        b = min(self.samples, key=lambda x: abs(x[0] - end))
        return b[1] - a[1], b[2] - a[2], b[0] - a[0]


def _figures(result: RunResult, steps: int, meter: _CpuMeter, offset: float) -> dict[str, float]:
    """The run's figures; `offset`: the perf_counter time of the trace's zero."""
    spans = timeline.spans(result.tracer.events)
    generate = [s for s in spans if s.lane.startswith("sampler/") and s.name == "generate"]
    optim = sorted(s.end for s in spans if s.lane == "trainer" and s.name == "optim_step")
    # the CPU of the steps after the first (start-up, imports, the first calls' warm-up left out)
    nan = float("nan")
    own, children, wall = meter.between(offset + optim[0], offset + optim[-1]) if len(optim) > 1 else (nan, nan, nan)
    per_step = max(1, len(optim) - 1)
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
        "cpu_run_s_per_step": own / per_step,  # the run's process, every thread
        "cpu_agents_s_per_step": children / per_step,  # the agent processes
        "cpu_s_per_step": (own + children) / per_step,
        "cpu_busy": (own + children) / (wall * CORES),  # the share of the cores busy
    }


def run_agent(steps: int = 8, repeats: int = 1, extra: list[str] | None = None, model: str = "tiny") -> dict[str, object]:
    """(agent), (loop) and (env) (see the module) on `model` (AGENT_MODELS), `repeats` times
    round-robin; medians, and the ratio."""
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in AGENT_CONFIGS}
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-agent-") as tmp:
        for rep in range(repeats):
            for label in AGENT_CONFIGS:
                cfg = _config(label, steps, extra or [], model)
                with _CpuMeter() as meter:
                    result = asyncio.run(build_program(cfg, run_dir=Path(tmp) / f"{label}{rep}").run())
                offset = time.perf_counter() - result.tracer.now()
                runs[label].append(_figures(result, steps, meter, offset))
    figures: dict[str, object] = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    agent, loop, env = figures["agent"], figures["loop"], figures["env"]
    assert isinstance(agent, dict) and isinstance(loop, dict) and isinstance(env, dict)
    ratio = agent["samples_per_s"] / env["samples_per_s"]
    figures["ratio"] = ratio
    figures["loop_ratio"] = loop["samples_per_s"] / env["samples_per_s"]
    # the work bound: with every configuration using the same cores, samples/s cannot beat their
    # ratio of CPU per step (the same samples a step) where the CPU is the limit (`cpu_busy`),
    # however well the work overlaps
    figures["cpu_bound_ratio"] = env["cpu_s_per_step"] / agent["cpu_s_per_step"]
    figures["agent_processes"] = _config("agent", steps, extra or [], model).rollout.agent_processes
    figures["model"] = model
    figures["cores"] = CORES
    figures["target"] = AGENT_TARGET
    figures["met"] = bool(ratio >= AGENT_TARGET)
    figures["endpoint"] = run_endpoint()
    figures["endpoint_processes"] = run_endpoint(processes=2)
    return figures
