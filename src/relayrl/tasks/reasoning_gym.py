"""reasoning-gym tasks: any procedural dataset of the `reasoning-gym` package (the `tasks` extra)
as prompts, scored by the dataset's own answer scoring.

Job: turn `task.kind = "reasoning_gym"` (`task.dataset`, `task.dataset_config`, `task.dataset_size`,
`task.dataset_seed`, `task.heldout_seed`, `task.heldout_size`) into a training stream and a fixed
held-out set of `Prompt`s, and provide the `reasoning_gym` reward: the dataset's
`score_answer(answer, entry)` on the completion's answer (the last ``<answer>…</answer>`` in it,
else the whole completion, stripped).

Invariants:
- Bad input fails when the task is built, before the run starts: an unknown dataset name is a
  `ConfigError` naming `task.dataset`, options the dataset does not take or rejects one naming
  `task.dataset_config`, overlapping seeds one naming `task.heldout_seed`.
- The training set is the `dataset_size` entries of seed `dataset_seed`, generated up front; item
  ``i`` of the stream is a pure function of (config, i) (epochs reshuffled with the seed), so the
  stream resumes from a cursor. Nothing is generated on the event loop. Generation that takes
  more than ~1.5 s shows its progress on stderr (tasks/progress.py); its size is bounded up front
  (config/sizing.py).
- Held-out prompts are disjoint from the training ones by seed and by question: reasoning-gym
  draws entry ``i`` of seed ``s`` from ``Random(s + i)`` (seed s + 1's entry 0 is seed s's entry
  1), so held-out entries come from a seed range that does not overlap the training range, and
  any whose question is also a training question (or an earlier held-out one) is skipped.
- Each prompt's `metadata["reasoning_gym"]` is ``{"dataset", "config", "entry"}`` with the entry
  round-tripped through JSON: enough to rebuild the scorer in any process (a worker process, a
  resumed run), and the scorer sees the same entry in every process.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from relayrl.config.schema import ConfigError
from relayrl.errors import UserError
from relayrl.tasks.correctness import parsed_answer
from relayrl.tasks.epochs import EpochCycle
from relayrl.tasks.progress import GenerationProgress
from relayrl.types import Prompt, Trajectory

METADATA_KEY = "reasoning_gym"


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _package() -> ModuleType:
    try:
        import reasoning_gym
    except ModuleNotFoundError:
        raise ConfigError(
            "task.kind = 'reasoning_gym' needs the Python package 'reasoning_gym', which is not installed; "
            "install the 'tasks' extra: pip install 'relayrl[tasks]'"
        ) from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """The reasoning-gym datasets the installed package knows, sorted."""
    _package()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def create_dataset(name: str, options: Mapping[str, object], seed: int, size: int) -> Any:
    """`reasoning_gym.create_dataset(name, seed=, size=, **options)`; any problem is one
    `ConfigError` line naming `task.dataset` or `task.dataset_config`."""
    rg = _package()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=3)
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"{len(DATASETS)} known, e.g. 'chain_sum', 'basic_arithmetic'"
        raise ConfigError(f"task.dataset: unknown reasoning-gym dataset {name!r} ({hint})")
    config_cls = DATASETS[name][1]
    allowed = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"task.dataset_config: reasoning-gym dataset {name!r} has no option(s) {', '.join(unknown)} (its options: {', '.join(allowed)})"
        )
    try:
        return rg.create_dataset(name, seed=seed, size=size, **options)
    except Exception as exc:  # the dataset's own validation: AssertionError, TypeError, ValueError, ...
        why = _one_line(str(exc)) or type(exc).__name__
        raise ConfigError(f"task.dataset_config: invalid options for reasoning-gym dataset {name!r}: {why}") from None


@dataclass(slots=True, frozen=True)
class ReasoningGymConfig:
    """Settings of a reasoning-gym task (the `task.*` keys, with the seed resolved)."""

    dataset: str
    options: Mapping[str, object] = field(default_factory=dict)
    size: int = 1000  # training entries
    seed: int = 0  # training seed: entries come from seeds seed .. seed + size - 1
    heldout_size: int = 200
    heldout_seed: int | None = None  # None = seed + size, the first seed past the training range

    @property
    def resolved_heldout_seed(self) -> int:
        return self.seed + self.size if self.heldout_seed is None else self.heldout_seed

    @property
    def heldout_candidates(self) -> int:
        """How many entries of the held-out seed are drawn to find `heldout_size` new questions."""
        return 4 * self.heldout_size + 64 if self.heldout_size else 0


class ReasoningGymTask:
    """Prompts of one reasoning-gym dataset: ``stream()`` for training, ``heldout(n)`` for evaluation."""

    __slots__ = ("config", "train_prompts", "heldout_prompts", "_cycle")

    def __init__(self, config: ReasoningGymConfig) -> None:
        self.config: ReasoningGymConfig = config
        if config.size < 1:
            raise ConfigError(f"task.dataset_size must be >= 1, got {config.size}")
        options = json.loads(json.dumps(dict(config.options)))
        train_ds = create_dataset(config.dataset, options, config.seed, config.size)
        _remember_scorer(config.dataset, options, train_ds)
        progress = GenerationProgress(f"reasoning-gym dataset {config.dataset!r} entries", config.size)
        train = []
        for i in range(config.size):
            train.append(self._prompt(train_ds, options, i, f"rg-{config.dataset}-{config.seed}-{i}"))
            progress.tick(i + 1)
        progress.finish()
        questions = {p.text for p in train}

        heldout: list[Prompt] = []
        n, candidates, hseed = config.heldout_size, config.heldout_candidates, config.resolved_heldout_seed
        if n:
            if hseed < config.seed + config.size and config.seed < hseed + candidates:
                raise ConfigError(
                    f"task.heldout_seed: {hseed} overlaps the training seeds {config.seed}..{config.seed + config.size - 1} "
                    f"(the held-out set draws from seeds {hseed}..{hseed + candidates - 1}; reasoning-gym draws entry i of seed s "
                    "from seed s + i); leave it unset or choose one outside that range"
                )
            heldout_ds = create_dataset(config.dataset, options, hseed, candidates)
            for j in range(candidates):
                p = self._prompt(heldout_ds, options, j, f"rg-{config.dataset}-heldout-{hseed}-{j}")
                if p.text in questions:
                    continue
                questions.add(p.text)
                heldout.append(p)
                if len(heldout) == n:
                    break
            if len(heldout) < n:
                raise ConfigError(
                    f"task.heldout_size: only {len(heldout)} of {n} held-out questions of reasoning-gym dataset {config.dataset!r} "
                    f"are not training questions ({candidates} entries of seed {hseed} drawn); lower task.heldout_size "
                    "or task.dataset_size, or widen the dataset's options"
                )
        self.train_prompts: tuple[Prompt, ...] = tuple(train)
        self.heldout_prompts: tuple[Prompt, ...] = tuple(heldout)
        self._cycle = EpochCycle(self.train_prompts, f"reasoning_gym:{config.seed}")

    def _prompt(self, dataset: Any, options: dict[str, object], index: int, prompt_id: str) -> Prompt:
        name = self.config.dataset
        try:
            raw = dataset[index]
        except Exception as exc:
            raise ConfigError(
                f"task.dataset_config: reasoning-gym dataset {name!r} failed to generate entry {index} "
                f"with these options: {_one_line(f'{type(exc).__name__}: {exc}')}"
            ) from None
        try:
            entry = json.loads(json.dumps(raw))
        except (TypeError, ValueError) as exc:
            why = _one_line(str(exc))
            raise ConfigError(f"task.dataset: reasoning-gym dataset {name!r} has entries that are not JSON ({why})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("question"), str):
            raise ConfigError(f"task.dataset: reasoning-gym dataset {name!r} gave an entry without a question text")
        answer = entry.get("answer")
        return Prompt(
            prompt_id=prompt_id,
            text=entry["question"],
            answer="" if answer is None else str(answer),
            metadata={METADATA_KEY: {"dataset": name, "config": options, "entry": entry}},
        )

    def train_prompt(self, index: int) -> Prompt:
        """Training item number ``index`` (epoch ``index // dataset_size``; random access for resuming)."""
        return self._cycle.prompt_at(index)

    def stream(self, start: int = 0) -> Iterator[Prompt]:
        """Endless training prompts from item ``start`` on: every entry once per epoch, reshuffled."""
        return self._cycle.stream(start)

    def heldout(self, n: int | None = None) -> list[Prompt]:
        """The first ``n`` held-out prompts (all of them when ``n`` is None); fixed order."""
        if n is None:
            return list(self.heldout_prompts)
        if not 0 <= n <= len(self.heldout_prompts):
            raise UserError(f"{n} held-out prompts requested, {len(self.heldout_prompts)} available")
        return list(self.heldout_prompts[:n])


# -- the reward ------------------------------------------------------------------------------------
# One dataset object per (name, options) per process scores every entry of that dataset (its
# score_answer may read the options, never the seed or the size).
_scorers: dict[tuple[str, str], Any] = {}
_scorers_lock = threading.Lock()


def _scorer_key(name: str, options: Mapping[str, object]) -> tuple[str, str]:
    return name, json.dumps(options, sort_keys=True)


def _remember_scorer(name: str, options: Mapping[str, object], dataset: Any) -> None:
    with _scorers_lock:
        _scorers.setdefault(_scorer_key(name, options), dataset)


def scorer(name: str, options: Mapping[str, object]) -> Any:
    """The dataset object whose `score_answer` scores entries of `name` with these options
    (created once per process)."""
    key = _scorer_key(name, options)
    with _scorers_lock:
        found = _scorers.get(key)
        if found is None:
            found = _scorers[key] = create_dataset(name, options, seed=0, size=1)
    return found


def extract_answer(completion: str) -> str:
    """The text inside the last ``<answer>…</answer>`` of the completion, else the whole completion;
    stripped either way (`tasks.correctness.parsed_answer`)."""
    return parsed_answer(completion)


def reasoning_gym_correct(trajectory: Trajectory) -> float:
    """The task's correctness check (tasks/correctness.py): 1.0 when the dataset's scorer gives the
    completion's answer full credit (`score_answer` = 1.0), else 0.0; raises as
    `reasoning_gym_reward` does."""
    return 1.0 if reasoning_gym_reward(trajectory) == 1.0 else 0.0


def reasoning_gym_reward(trajectory: Trajectory) -> float:
    """The reward `reasoning_gym`: the prompt's dataset scores the completion's answer against the
    prompt's entry (`score_answer(answer, entry)`, 0.0 to 1.0; most datasets give partial credit to
    an answer that contains the right one among other text). Raises (a failed trajectory) for a
    prompt that is not a reasoning-gym one."""
    spec = trajectory.prompt.metadata.get(METADATA_KEY)
    if not isinstance(spec, dict) or not isinstance(spec.get("dataset"), str) or not isinstance(spec.get("entry"), dict):
        raise ValueError(
            f"prompt {trajectory.prompt.prompt_id!r} has no reasoning-gym entry in its metadata: "
            "the reasoning_gym reward scores prompts of task.kind = 'reasoning_gym'"
        )
    options = spec.get("config") or {}
    if not isinstance(options, dict):
        raise ValueError(f"prompt {trajectory.prompt.prompt_id!r}: metadata reasoning_gym.config must be a table, got {options!r}")
    score = scorer(spec["dataset"], options).score_answer(extract_answer(trajectory.completion_text), spec["entry"])
    return float(score)
