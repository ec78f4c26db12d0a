"""Real tasks: reasoning-gym datasets as prompts scored by their own `score_answer`, and the
`math_verify` reward for LaTeX / boxed answers (both from the `tasks` extra)."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from relayrl.config.extras import MissingExtra, check_extras
from relayrl.config.schema import ConfigError, load_config
from relayrl.orchestrator.build import build_program
from relayrl.rewards import registry as rewards
from relayrl.rewards.math_verify import answers_match, math_verify
from relayrl.tasks.build import build_task
from relayrl.tasks.reasoning_gym import (
    METADATA_KEY,
    ReasoningGymConfig,
    ReasoningGymTask,
    dataset_names,
    extract_answer,
    reasoning_gym_reward,
)
from relayrl.telemetry.trajlog import read_trajectories
from relayrl.types import Prompt, Trajectory
from support.cli import relayrl, run_python
from support.simutil import StopAt, Stopped, make_program, run_checked
from support.trajectories import trajectory

SIM_RECIPE = Path(__file__).resolve().parents[2] / "src" / "relayrl" / "recipes" / "sim.toml"
WIDE = {"COLUMNS": "160"}  # one line per error, whatever the terminal


def _trajectory(prompt: Prompt, completion: str) -> Trajectory:
    return trajectory(prompt=prompt, prompt_tokens=[1], completion_tokens=[2], logprob=-0.1, text=completion)


# -- reasoning-gym ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "countdown", "leg_counting"])
def test_a_reasoning_gym_dataset_gives_prompts_whose_own_answer_scores_one(name: str) -> None:
    assert name in dataset_names()
    task = ReasoningGymTask(ReasoningGymConfig(dataset=name, size=40, seed=3, heldout_size=10))
    assert len(task.train_prompts) == 40 and len(task.heldout_prompts) == 10
    for prompt in task.train_prompts[:5] + task.heldout_prompts[:5]:
        spec = prompt.metadata[METADATA_KEY]
        assert isinstance(spec, dict) and spec["dataset"] == name and spec["entry"]["question"] == prompt.text
        assert json.loads(json.dumps(prompt.metadata)) == prompt.metadata  # JSON, as checkpoints and worker processes carry it
        assert reasoning_gym_reward(_trajectory(prompt, prompt.answer)) == 1.0
        assert reasoning_gym_reward(_trajectory(prompt, f"thinking… <answer>{prompt.answer}</answer>")) == 1.0
        assert reasoning_gym_reward(_trajectory(prompt, "no idea")) < 1.0
        assert reasoning_gym_reward(_trajectory(prompt, "")) < 1.0  # some datasets give a little for any try


def test_held_out_prompts_are_disjoint_from_training_by_seed_and_by_question() -> None:
    # a tiny problem space (two 1-digit terms, + and -): many entries repeat across seeds
    options: dict[str, object] = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    task = ReasoningGymTask(ReasoningGymConfig(dataset="chain_sum", options=options, size=60, seed=5, heldout_size=20))
    train_questions = {p.text for p in task.train_prompts}
    held_questions = [p.text for p in task.heldout_prompts]
    assert len(held_questions) == 20 == len(set(held_questions))
    assert not train_questions & set(held_questions)
    # the held-out seeds (from seed + size on) do not overlap the training seeds 5..64
    assert all(p.prompt_id.startswith("rg-chain_sum-heldout-65-") for p in task.heldout_prompts)
    # the training set is reproducible and the stream resumes from any cursor
    again = ReasoningGymTask(ReasoningGymConfig(dataset="chain_sum", options=options, size=60, seed=5, heldout_size=20))
    assert again.train_prompts == task.train_prompts and again.heldout_prompts == task.heldout_prompts
    stream = task.stream()
    first = [next(stream) for _ in range(150)]
    assert first[70:] == [p for _, p in zip(range(80), task.stream(70))]
    assert sorted(p.prompt_id for p in first[:60]) == sorted(p.prompt_id for p in task.train_prompts)  # each entry once per epoch
    with pytest.raises(ConfigError, match=r"^task\.heldout_seed: 30 overlaps the training seeds 5\.\.64"):
        ReasoningGymTask(ReasoningGymConfig(dataset="chain_sum", options=options, size=60, seed=5, heldout_size=20, heldout_seed=30))
    with pytest.raises(ConfigError, match=r"^task\.heldout_size: only \d+ of 500 held-out questions"):
        ReasoningGymTask(ReasoningGymConfig(dataset="chain_sum", options=options, size=60, seed=5, heldout_size=500))


def test_the_config_builds_a_reasoning_gym_task_with_its_options_seed_and_size() -> None:
    cfg = load_config(
        None,
        [
            "task.kind=reasoning_gym",
            "task.dataset=basic_arithmetic",
            "task.dataset_config={min_terms=2, max_terms=2, max_digits=2, operators=['+', '*'], allow_negation=false,"
            " allow_parentheses=false}",
            "task.dataset_size=30",
            "task.dataset_seed=11",
            "task.heldout_size=8",
        ],
    )
    data = build_task(cfg)
    assert len(data.heldout) == 8
    first = next(data.stream)
    spec = first.metadata[METADATA_KEY]
    assert isinstance(spec, dict) and spec["config"]["operators"] == ["+", "*"]
    assert first.prompt_id.startswith("rg-basic_arithmetic-11-")
    assert all("-" not in p.text.split("Calculate")[-1] for p in data.heldout)  # the options reached the dataset
    # run.seed is the default dataset seed
    default_seed = build_task(cfg.model_copy(update={"task": cfg.task.model_copy(update={"dataset_seed": None})}))
    assert next(default_seed.stream).prompt_id.startswith("rg-basic_arithmetic-0-")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "task.dataset=basic_arithmetc",
            r"^task\.dataset: unknown reasoning-gym dataset 'basic_arithmetc' \(did you mean 'basic_arithmetic'",
        ),
        ("task.dataset_config={bogus=1}", r"^task\.dataset_config: reasoning-gym dataset 'basic_arithmetic' has no option\(s\) bogus"),
        ("task.dataset_config={min_terms=0}", r"^task\.dataset_config: invalid options for reasoning-gym dataset 'basic_arithmetic'"),
    ],
)
def test_a_bad_dataset_or_option_is_a_config_error_naming_the_key(override: str, message: str) -> None:
    cfg = load_config(None, ["task.kind=reasoning_gym", "task.dataset=basic_arithmetic", "task.heldout_size=4", override])
    with pytest.raises(ConfigError, match=message):
        build_task(cfg)


def test_config_keys_of_the_reasoning_gym_task_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"task\.dataset must name a reasoning-gym dataset"):
        load_config(None, ["task.kind=reasoning_gym"])
    with pytest.raises(ConfigError, match=r"'task\.dataset_config'.*'seed' is set by task\.dataset_seed"):
        load_config(None, ["task.kind=reasoning_gym", "task.dataset=chain_sum", "task.dataset_config={seed=3}"])
    with pytest.raises(ConfigError, match=r"'task\.dataset_config'.*finite numbers"):
        load_config(None, ["task.kind=reasoning_gym", "task.dataset=chain_sum", "task.dataset_config={x=nan}"])


def test_the_tasks_extra_is_required_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    import relayrl.config.extras as extras

    cfg = load_config(None, ["task.kind=reasoning_gym", "task.dataset=chain_sum", 'task.reward_functions=["math_verify"]'])
    check_extras(cfg)  # installed here
    monkeypatch.setattr(extras, "is_installed", lambda module: module not in ("reasoning_gym", "math_verify"))
    with pytest.raises(MissingExtra, match=r"reasoning_gym task .* pip install 'relayrl\[tasks\]'"):
        check_extras(cfg)
    with pytest.raises(MissingExtra, match=r"the math_verify reward .* pip install 'relayrl\[tasks\]'"):
        check_extras(cfg.model_copy(update={"task": cfg.task.model_copy(update={"kind": "synthetic"})}))


def test_the_reward_rebuilds_its_scorer_in_another_process_from_the_prompt_metadata(tmp_path: Path) -> None:
    task = ReasoningGymTask(ReasoningGymConfig(dataset="countdown", size=4, seed=1, heldout_size=0))
    prompt = task.train_prompts[0]
    (tmp_path / "prompt.json").write_text(json.dumps(asdict(prompt)))  # as a checkpoint stores in-flight prompts
    code = (
        "import json, sys\n"
        "from relayrl.types import Prompt, Trajectory\n"
        "from relayrl.tasks.reasoning_gym import reasoning_gym_reward\n"
        "p = Prompt(**json.load(open(sys.argv[1])))\n"
        "t = lambda text: Trajectory(0, 0, p, [1], [2], [-0.1], text, 0, 0)\n"
        "print(reasoning_gym_reward(t(p.answer)), reasoning_gym_reward(t('1 + 1')))\n"
    )
    res = run_python("-c", code, str(tmp_path / "prompt.json"), env=WIDE, timeout=120)
    assert res.returncode == 0, res.stderr
    right, wrong = map(float, res.stdout.split())
    assert right == 1.0 and wrong < 1.0


def test_the_reward_refuses_a_prompt_without_a_reasoning_gym_entry() -> None:
    with pytest.raises(ValueError, match="has no reasoning-gym entry"):
        reasoning_gym_reward(_trajectory(Prompt("p", "1+1=", "2"), "2"))


def test_answers_are_read_from_the_last_answer_tag_else_the_whole_completion() -> None:
    assert extract_answer("<answer> 1 </answer> then <answer>\n42\n</answer>") == "42"
    assert extract_answer("  42 \n") == "42"


#: the lines that register the two rewards under their built-in names
OPTIONAL = {"reasoning_gym": "relayrl.tasks.reasoning_gym:reasoning_gym_reward", "math_verify": "relayrl.rewards.math_verify:math_verify"}


def test_the_built_in_names_resolve_to_the_rewards(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, spec in OPTIONAL.items():
        monkeypatch.setitem(rewards.OPTIONAL_REWARDS, name, spec)
    assert rewards.resolve(["reasoning_gym", "math_verify"]) == [reasoning_gym_reward, math_verify]


# a sim run on reasoning-gym's chain_sum: 64 training entries, 16 held out, 4 steps
CHAIN_SUM_SIM = [
    "task.kind=reasoning_gym",
    "task.dataset=chain_sum",
    "task.dataset_size=64",
    "task.heldout_size=16",
    "run.steps=4",
    "orchestrator.release_memory=false",
]


@pytest.mark.parametrize("entry", ["reasoning_gym", OPTIONAL["reasoning_gym"]])
def test_a_sim_run_on_a_reasoning_gym_task_completes_with_its_reward(entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By its built-in name and as module:function (both in the reward worker processes, which
    rebuild the scorer from each prompt's metadata)."""
    monkeypatch.setitem(rewards.OPTIONAL_REWARDS, "reasoning_gym", OPTIONAL["reasoning_gym"])
    cfg = load_config(
        SIM_RECIPE,
        [
            *CHAIN_SUM_SIM,
            f'task.reward_functions=["{entry}"]',
            "rollout.num_generations=4",
            "rollout.groups_per_step=4",
            "rollout.prompts_per_request=2",
        ],
    )
    result = run_checked(make_program(cfg, tmp_path))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger"]["groups_trained"] == 16
    rows = read_trajectories(tmp_path / "run").to_pylist()
    assert len(rows) == 64 and all(r["status"] == "ok" for r in rows)
    assert {r["reward"] for r in rows} == {0.0, 1.0}  # the sim answers right or off by one
    assert all(str(r["prompt_id"]).startswith("rg-chain_sum-0-") for r in rows)
    assert all((r.metrics["reward_std"] or 0) > 0 for r in result.results)


@pytest.mark.slow
def test_a_resumed_reasoning_gym_run_scores_its_replayed_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompts in flight at a checkpoint come back with their metadata, so their reward works."""

    monkeypatch.setitem(rewards.OPTIONAL_REWARDS, "reasoning_gym", OPTIONAL["reasoning_gym"])
    cfg = load_config(
        SIM_RECIPE,
        [
            *CHAIN_SUM_SIM,
            'task.reward_functions=["reasoning_gym"]',
            f"run.output_dir={tmp_path}",
            "run.name=r",
            "orchestrator.checkpoint_every=2",
        ],
    )
    # stopped in on_step_end(3), after the checkpoint of step 2
    with pytest.raises(Stopped):
        asyncio.run(asyncio.wait_for(build_program(cfg, [StopAt(3)], run_dir=tmp_path / "r").run(), 60))
    (checkpoint,) = (tmp_path / "r" / "checkpoints").glob("step-*")
    in_flight = json.loads((checkpoint / "state.json").read_text())["in_flight"]
    assert in_flight and all(METADATA_KEY in d["prompt"]["metadata"] for d in in_flight)  # max_staleness 1: step 3's groups
    result = run_checked(build_program(cfg, run_dir=tmp_path / "r", resume=True))
    assert [r.step for r in result.results] == [3, 4]
    rows = read_trajectories(tmp_path / "r").to_pylist()
    assert len(rows) == 4 * 64 and all(r["status"] == "ok" for r in rows)
    replayed = {d["prompt"]["prompt_id"] for d in in_flight}
    assert replayed <= {r["prompt_id"] for r in rows if r["step"] >= 3}


def test_a_bad_dataset_name_exits_2_naming_task_dataset(tmp_path: Path) -> None:
    args = ["train", str(SIM_RECIPE), "--set", "task.kind=reasoning_gym"]
    res = relayrl(*args, "--set", "task.dataset=no_such_dataset", cwd=tmp_path, env=WIDE)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: task.dataset: unknown reasoning-gym dataset 'no_such_dataset'"), res.stderr
    assert not (tmp_path / "runs").exists()  # refused before the run directory was written
    res = relayrl(*args, cwd=tmp_path, env=WIDE)
    assert res.returncode == 2 and "task.dataset must name a reasoning-gym dataset" in res.stderr


# -- math_verify ------------------------------------------------------------------------------------

EQUAL = [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("0.5", "The answer is $\\boxed{\\frac{1}{2}}$."),
    ("$x^2+2x+1$", "(x+1)^2"),
    ("(x+1)^2", "so we get $x^2 + 2x + 1$"),
    ("\\frac{1}{2}", "1/2"),
    ("2\\pi", "\\boxed{2\\pi}"),
    ("\\sqrt{2}", "$\\sqrt 2$"),
    ("1024", "$2^{10}$"),
    ("42", "I think it is 42"),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}"),
]
UNEQUAL = [
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("3", "\\boxed{4}"),
    ("$x^2+2x+1$", "(x-1)^2"),
    ("42", "no idea"),
    ("42", ""),
    ("", "42"),
    ("5", "\\boxed{9^{9^{9^{9}}}}"),  # too large to compare: refused, never computed for ever
    ("5", "\\boxed{(10^{10})!}"),
    ("}}}", "\\boxed{"),  # unparsable on both sides: 0.0, not an exception
]


@pytest.mark.parametrize(("gold", "completion"), EQUAL)
def test_math_verify_accepts_equal_answers(gold: str, completion: str) -> None:
    assert math_verify(_trajectory(Prompt("m", "?", gold), completion)) == 1.0


@pytest.mark.parametrize(("gold", "completion"), UNEQUAL)
def test_math_verify_rejects_unequal_or_unparsable_answers(gold: str, completion: str) -> None:
    assert math_verify(_trajectory(Prompt("m", "?", gold), completion)) == 0.0


def test_math_verify_runs_off_the_main_thread() -> None:
    """Rewards may run off the main thread (the scoring thread, a reward-call thread): math-verify's
    signal.alarm timeouts must not be used there."""
    results: list[tuple[bool, bool]] = []
    errors: list[BaseException] = []

    def score() -> None:
        try:
            for pairs, expected in ((EQUAL, True), (UNEQUAL, False)):
                results.extend((answers_match(g, c), expected) for g, c in pairs)
        except BaseException as exc:  # noqa: B036 - reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=score) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 2 * (len(EQUAL) + len(UNEQUAL))
    assert all(got == expected for got, expected in results)


def test_math_verify_scores_jsonl_math_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """JSONL rows with LaTeX answers, scored by math_verify in a sim run (in the reward worker processes)."""
    rows = [{"prompt": f"What is {i}/{i + 2} in lowest terms?", "answer": f"\\frac{{{i}}}{{{i + 2}}}"} for i in range(1, 21)]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setitem(rewards.OPTIONAL_REWARDS, "math_verify", OPTIONAL["math_verify"])
    cfg = load_config(SIM_RECIPE, ["task.kind=jsonl", f"task.path={path}", 'task.reward_functions=["math_verify"]', "run.steps=2"])
    run_checked(make_program(cfg, tmp_path))
    scored = read_trajectories(tmp_path / "run").to_pylist()
    # the sim's completion is the answer itself or "?" (unparsable): 1.0 or 0.0, never a failure
    assert all(r["status"] == "ok" and r["reward"] == (1.0 if r["completion"] != "?" else 0.0) for r in scored)
    assert {r["reward"] for r in scored} == {0.0, 1.0}
