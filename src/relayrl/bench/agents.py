"""`relayrl bench agent`: agent mode beside the multi-turn environment path on the same task.

Both runs are the agent recipe (recipes/agent.toml: the tiny model, 2-digit arithmetic, G = 8,
16 prompts a step), shortened and without evaluation. (agent) trains the example agent
examples/agents/completions_agent.py: "draft, then answer", two /v1/completions calls per episode
through the `openai` client and the endpoint. (env) trains the built-in environment `draft_answer`
(envs/draft_answer.py): the same two turns and the same reward, sampled by the episode runner with
no HTTP. What differs: the second turn's context. The agent sends its draft's text stripped and a
newline, re-tokenized by the endpoint; the runner keeps the draft's sampled tokens (its
end-of-sequence token included) and appends the newline and the question. Both
train one sequence per episode.

Figures per run (medians over the repeats, run round-robin): samples/s (the run's summary),
trainer busy, sampler busy, sampling calls per step (from the trace), and their ratio agent/env
against the target AGENT_TARGET (agent mode within 2x of the environment path).

Invariant: nothing here asserts a time; both configurations run one after the other in this
process on the same workload (machines are noisy: the ratio is the figure).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import tomllib
from pathlib import Path

from relayrl.analysis import timeline
from relayrl.config.schema import Config, load_config
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.program import RunResult
from relayrl.recipes import shipped_recipe

__all__ = ["AGENT_CONFIGS", "AGENT_TARGET", "run_agent"]

#: agent samples/s over the environment path's, at least
AGENT_TARGET = 0.5

_COMMON = ["eval.enabled=false", "orchestrator.checkpoint_every=0"]
AGENT_CONFIGS: dict[str, list[str]] = {
    "agent": [],
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
    if label == "agent":
        return load_config(shipped_recipe("agent"), overrides)
    return load_config(None, [*_recipe_overrides(shipped_recipe("agent"), {"task.agent"}), *overrides])


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
    agent, env = figures["agent"], figures["env"]
    assert isinstance(agent, dict) and isinstance(env, dict)
    ratio = agent["samples_per_s"] / env["samples_per_s"]
    figures["ratio"] = ratio
    figures["target"] = AGENT_TARGET
    figures["met"] = bool(ratio >= AGENT_TARGET)
    return figures
