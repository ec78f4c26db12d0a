"""The configuration reference and the resume policy, both read from the config models' metadata:
docs/configuration.md equals the text rendered from them, every key is described, and the keys a
resume may change are exactly the ones the policy allowed before it moved onto the fields."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relayrl.config.docs import REGENERATE, render_markdown
from relayrl.config.schema import Config, ConfigError, LoraConfig, config_keys, load_config, resumable_keys
from relayrl.orchestrator.build import resume_changes

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# The keys the 28 prefixes of the former orchestrator/build.py RESUMABLE_KEYS matched (computed
# once from them, written out in full): a regression guard on the policy's move onto the fields.
RESUMABLE_BEFORE = [
    "run.steps",
    "run.overwrite",
    "run.save_model",
    "task.reward_workers",
    "task.reward_timeout_s",
    "task.reward_concurrency",
    "task.reward_memory_mb",
    "task.reward_cpu_s",
    "task.strict_rewards",
    "task.strict_agents",  # added with task.agent (issue 22)
    "rollout.sampler_failover",
    "rollout.sampler_threads",
    "rollout.sampler_nice",
    "rollout.episode_cache_mb",
    "rollout.env_step_timeout_s",
    "rollout.strict_environment",
    "rollout.agent_timeout_s",  # added with task.agent (issue 22)
    "rollout.agent_processes",  # added with agent processes (issue 32): where an agent runs, not what it samples
    "rollout.agent_batches_per_replica",  # added with issue 32: how many batches a replica rolls out at once
    "train.torch_threads",
    "orchestrator.overlap_bookkeeping",
    "orchestrator.queue_size",
    "orchestrator.loop_lag_interval_ms",
    "orchestrator.switch_interval_ms",  # added with issue 22's sync rounds (not a result: how often threads switch)
    "orchestrator.log_trajectories",
    "orchestrator.release_memory",
    "orchestrator.malloc_trim",
    "orchestrator.checkpoint_every",
    "orchestrator.checkpoint_every_s",  # added with issue 32 (time-based checkpoints)
    "orchestrator.keep_checkpoints",
    "orchestrator.stop_grace_s",
    "orchestrator.stall_timeout_s",
    "orchestrator.max_filtered_per_step",
    "orchestrator.max_host_memory_gb",
    "sim.generate_per_request",
    "sim.generate_base",
    "sim.generate_per_token",
    "sim.train_step",
    "sim.optim_step",
    "sim.get_metrics",
    "sim.weight_sync",
    "sim.pack_per_microbatch",
    "sim.reduce_metrics",
    "sim.log_metrics",
    "sim.log_trajectories",
    "sim.on_step_end",
    "sim.release_memory",
    "eval.every_steps",
    "eval.max_new_tokens",
    "eval.enabled",
    "telemetry.sinks",
    "telemetry.project",
    "ray.enabled",
    "ray.address",
    "ray.num_cpus",
    "ray.object_store_mb",
    "ray.namespace",
    "ray.sampler_resources",
    "ray.trainer_resources",
    "ray.queue_ahead",
]


def test_checked_in_docs_are_the_generated_text() -> None:
    """docs/configuration.md cannot go stale: a changed default, bound, description or resume mark
    changes the rendered text."""
    assert DOCS.read_text(encoding="utf-8") == render_markdown(), f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`"


def test_every_key_and_section_is_described() -> None:
    keys = [(section, key, field) for section, _, key, field in config_keys()]
    dumped = [f"{section}.{key}" for section, values in Config().model_dump().items() for key in values]
    assert [f"{section}.{key}" for section, key, _ in keys] == dumped  # every key of every section, none skipped
    for section, key, field in keys:
        assert field.description and field.description.strip(), f"{section}.{key}"
    for name, section_field in Config.model_fields.items():
        model = section_field.annotation
        assert model is not None and model.__doc__ and model.__doc__.strip(), name


def _doc_rows() -> dict[str, list[str]]:
    """`section.key` → the cells of its row in the rendered reference."""
    rows: dict[str, list[str]] = {}
    section = ""
    for line in render_markdown().splitlines():
        if m := re.fullmatch(r"## \[([\w.]+)\]", line):  # a section, or a key that is a table (train.lora)
            section = m.group(1)
        elif m := re.match(r"\| `(\w+)` \|", line):
            rows[f"{section}.{m.group(1)}"] = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
    return rows


def test_docs_list_every_key_with_type_default_and_resume_mark() -> None:
    rows = _doc_rows()
    tables = [f"train.lora.{key}" for key in LoraConfig.model_fields]  # a table's keys: its own section, last
    assert list(rows) == [f"{section}.{key}" for section, _, key, _ in config_keys()] + tables
    resumable = resumable_keys()
    for key, (_, kind, default, mark, description) in rows.items():
        assert mark == ("yes" if key in resumable else "no"), key
        assert kind and default and description, key
    assert rows["run.steps"][1:4] == ["integer, ≥ 1", "`20`", "yes"]
    assert rows["rollout.num_generations"][1:4] == ["integer, ≥ 1", "`8`", "no"]
    assert rows["run.backend"][1:3] == ['one of "sim", "local"', '`"sim"`']
    assert rows["task.reward_functions"][1:3] == ["list of strings, at least 1 entry", '`["exact_match"]`']
    assert rows["algorithm.tis_cap"][1:3] == ["float (optional), ≥ 0.0", "unset"]
    assert rows["ray.sampler_resources"][1:4] == ["table of floats", "`{}`", "yes"]


def test_resumable_keys_are_the_former_prefixes_keys() -> None:
    assert sorted(resumable_keys()) == sorted(RESUMABLE_BEFORE)
    assert len(RESUMABLE_BEFORE) == len(set(RESUMABLE_BEFORE)) == 60


def test_resume_changes_reads_the_marks() -> None:
    """A resumable change becomes a row; the first fixed one is refused naming the key, both
    values and the steps trained."""
    before = load_config(None, ["run.steps=10"])
    after = load_config(None, ["run.steps=12", "sim.generate_base=0.5", "orchestrator.checkpoint_every=3"])
    assert resume_changes(before, after, 10) == [
        {"from_step": 11, "key": "run.steps", "old": 10, "new": 12},
        {"from_step": 11, "key": "orchestrator.checkpoint_every", "old": 50, "new": 3},
        {"from_step": 11, "key": "sim.generate_base", "old": 0.0, "new": 0.5},
    ]
    assert resume_changes(before, before, 10) == []
    fixed = load_config(None, ["run.steps=12", "rollout.num_generations=4", "sim.length_sigma=2.0"])
    with pytest.raises(ConfigError) as err:
        resume_changes(before, fixed, 10)
    assert str(err.value) == (
        "--resume cannot change rollout.num_generations (8 → 4): steps 1–10 were trained with the recorded value; "
        "start a new run to change it"
    )
