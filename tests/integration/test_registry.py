"""The backend registry (relayrl/backends/registry.py): a compute kind is one `KINDS` entry, looked
up lazily; a host places its factories; the program builds the held-out evaluator from the kind's
greedy engine; the protocols' defaults answer for what a worker does not do."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from relayrl.backends import registry
from relayrl.backends.protocols import Sampler, Trainer, UnsupportedError
from relayrl.backends.sim import build as sim_build
from relayrl.config.schema import Config
from relayrl.orchestrator.build import build_program
from relayrl.types import GenerateResult, SampleRequest, TrainBatch, Trajectory, Weights
from support.cli import run_python
from support.simutil import run_checked, sim_config

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class _Engine:
    """A greedy engine answering "1" to every prompt, recording the versions it loaded."""

    loaded: list[int] = []

    async def load_weights(self, weights: Weights) -> None:
        _Engine.loaded.append(weights.version)

    async def greedy(self, prompts_tokens: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return [[1] for _ in prompts_tokens]

    async def close(self) -> None:
        return None


def greedy_sim(cfg: Config, abort: threading.Event) -> registry.Compute:
    """A compute kind of this test module: the sim's, plus a greedy engine and a decoder."""
    compute = sim_build.compute(cfg, abort)
    compute.greedy_engine = _Engine
    compute.decode = lambda tokens: "1"
    return compute


def test_a_compute_kind_is_one_registry_entry_and_the_program_evaluates_on_its_greedy_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pointing `run.backend`'s entry at another function is all a new kind takes; the program
    builds the held-out evaluator from its greedy engine and judges through the run's scorer."""
    monkeypatch.setitem(registry.KINDS, "sim", f"{__name__}:greedy_sim")
    _Engine.loaded = []
    judged: list[int] = []

    def one(t: Trajectory) -> float:
        if t.group_id < 0:  # a held-out completion
            judged.append(t.policy_version)
        return 1.0 if t.completion_text == "1" else 0.0

    cfg = sim_config("task.heldout_size=5", "run.steps=3")
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run", reward_fns=[one]))
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert [(e["version"], e["reward_mean"], e["num_prompts"]) for e in evals] == [(0, 1.0, 5), (3, 1.0, 5)]
    assert _Engine.loaded == [3]  # the start is measured on the weights the engine holds
    assert judged == [0] * 5 + [3] * 5  # through the run's scorer, which calls the run's functions
    assert result.summary["heldout_reward_mean_before"] == 1.0
    assert result.summary["accuracy_before"] == 0.0  # the task's check: no held-out sum is 1


def test_the_sim_kind_does_not_evaluate_and_imports_no_torch_nor_what_only_agents_or_lora_need() -> None:
    code = (
        "import sys\n"
        "from relayrl.config.schema import load_config\n"
        "from relayrl.orchestrator.build import build_program\n"
        "p = build_program(load_config(None, ['task.heldout_size=4']))\n"
        "assert p.backend.greedy is None and p.eval_schedule._evaluator is None\n"
        "print(sorted(m for m in ('torch', 'transformers', 'ray', 'fastapi', 'uvicorn', 'peft') if m in sys.modules))\n"
    )
    out = run_python("-c", code, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_an_unknown_kind_is_named() -> None:
    with pytest.raises(ValueError, match=r"run.backend: no compute kind named 'vllm' \(known: local, sim\)"):
        registry.compute_kind("vllm")


def test_the_in_process_host_calls_each_factory_once_samplers_first() -> None:
    calls: list[str] = []
    compute = sim_build.compute(sim_config("rollout.num_samplers=2"), threading.Event())

    def logged(name: str, factory: Callable[[], T]) -> Callable[[], T]:
        def call() -> T:
            calls.append(name)
            return factory()

        return call

    compute.samplers = [logged(f"sampler{i}", f) for i, f in enumerate(compute.samplers)]
    compute.trainer = logged("trainer", compute.trainer)
    backend = registry.place_in_process(sim_config(), compute, True)
    assert calls == ["sampler0", "sampler1", "trainer"]
    assert backend.greedy is None and backend.startup == {} and backend.host_work is compute.host_work
    asyncio.run(backend.close())


def test_sim_factories_pickle() -> None:
    """A host may call them in another process."""
    compute = sim_build.compute(sim_config("rollout.num_samplers=2"), threading.Event())
    sampler = pickle.loads(pickle.dumps(compute.samplers[1]))()
    assert type(sampler).__name__ == "SimSampler" and sampler._replica == 1
    assert type(pickle.loads(pickle.dumps(compute.trainer))()).__name__ == "SimTrainer"


# -- the protocols' defaults ---------------------------------------------------------------------


class _OnlyGenerates(Sampler):
    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        return []

    async def load_weights(self, weights: Weights) -> None:
        return None


class _OnlyTrains(Trainer):
    def __init__(self) -> None:
        self.version = 0

    async def train_step(self, batch: TrainBatch) -> None:
        return None

    async def optim_step(self) -> int:
        self.version += 1
        return self.version

    async def get_metrics(self) -> dict[str, float]:
        return {}

    async def export_weights(self) -> Weights:
        return Weights(self.version, None)


def test_a_sampler_writes_only_what_it_computes() -> None:
    sampler = _OnlyGenerates()

    async def go() -> None:
        with pytest.raises(UnsupportedError, match=r"the _OnlyGenerates sampler cannot run multi-turn episodes \(task.environment\)"):
            await sampler.generate_turns([])
        await sampler.end_episodes(["e0"])  # no caches: nothing to forget
        assert not sampler.restartable(ConnectionError("gone"))
        with pytest.raises(UnsupportedError, match="cannot be restarted"):
            await sampler.restart()
        await sampler.close()

    asyncio.run(go())


def test_a_trainer_writes_only_what_it_computes(tmp_path: Path) -> None:
    trainer = _OnlyTrains()
    asked: list[bool] = []

    def ahead() -> TrainBatch | None:
        asked.append(True)
        return None

    async def go() -> None:
        assert trainer.queue_ahead is False
        assert await trainer.optim_step_ahead(ahead) == (1, False)  # a plain optim_step, nothing queued
        with pytest.raises(UnsupportedError, match=r"the _OnlyTrains trainer cannot save its state \(orchestrator.checkpoint_every\)"):
            await trainer.save_state(tmp_path)
        with pytest.raises(UnsupportedError, match=r"cannot load a checkpoint \(--resume\)"):
            await trainer.load_state(tmp_path)
        await trainer.close()

    asyncio.run(go())
    assert not asked


def test_a_local_factory_sent_to_another_process_leaves_the_drivers_model_behind() -> None:
    """In the driver's process a local factory builds from the model the driver loaded; pickled
    (for a Ray actor) it carries only the config, and loads the model where it is called."""
    pytest.importorskip("torch")
    from relayrl.backends.local.build import SamplerFactory, TrainerFactory

    cfg = sim_config("run.backend=local")
    heavy: Any = (object(), object())  # stands for the loaded (model, tokenizer); not picklable
    for factory in (SamplerFactory(cfg, (1, 2), heavy), TrainerFactory(cfg, (3,), heavy)):
        assert factory.base() is heavy
        copy = pickle.loads(pickle.dumps(factory))
        assert type(copy) is type(factory) and copy.args == factory.args and copy.cfg == cfg
        assert copy._base is None
