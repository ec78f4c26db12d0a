"""Multi-turn environments: the built-ins (`arithmetic_feedback`, `calculator`), resolving
`task.environment` into an environment with `build_environment` (and every way it can fail, each
naming the key and the entry), and the example environment of docs/environments.md played through its sync and
async versions."""

from __future__ import annotations

import asyncio
import inspect
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from relayrl.envs import ENVIRONMENTS, EnvironmentSpecError, build_environment, calculator
from relayrl.envs.arithmetic_feedback import ArithmeticFeedback, first_integer
from relayrl.envs.base import Environment, EnvStep
from relayrl.envs.calculator import CalcError, Calculator, evaluate, format_value
from relayrl.envs.draft_answer import DraftAnswer
from relayrl.tasks.arithmetic import ArithmeticTask
from relayrl.tasks.synthetic import synthetic_stream
from relayrl.types import Prompt

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "envs" / "guess_number.py"
TINY_CHARS = set("0123456789+-*/=()<>.,;:?!'\" \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")  # make_tiny_model.py

PROMPT = Prompt("q-7", "23+9=", "32")


def _play_sync(env: Environment, prompt: Prompt, actions: Sequence[str]) -> list[EnvStep]:
    """Play `actions` until the episode ends, calling plain methods directly."""
    episode = env.start(prompt)
    assert not inspect.isawaitable(episode)
    steps: list[EnvStep] = []
    for action in actions:
        step = episode.step(action)
        assert isinstance(step, EnvStep)
        steps.append(step)
        if step.observation is None:
            break
    return steps


async def _play(env: Environment, prompt: Prompt, actions: Sequence[str]) -> list[EnvStep]:
    """Play as a runner would: await what is awaitable, run plain calls in a thread."""

    async def call(fn: object, arg: object) -> object:
        assert callable(fn)
        if inspect.iscoroutinefunction(fn):
            return await fn(arg)
        result = await asyncio.to_thread(fn, arg)
        assert not inspect.isawaitable(result)
        return result

    episode = await call(env.start, prompt)
    steps: list[EnvStep] = []
    for action in actions:
        step = await call(episode.step, action)  # type: ignore[attr-defined]
        assert isinstance(step, EnvStep)
        steps.append(step)
        if step.observation is None:
            break
    return steps


# -- arithmetic_feedback ---------------------------------------------------------------------------


def test_feedback_says_too_high_too_low_and_restates_the_question() -> None:
    env = build_environment("arithmetic_feedback", {}, max_turns=5)
    steps = _play_sync(env, PROMPT, ["40", "x = 12", "no idea", "32"])
    assert [s.observation for s in steps] == ["too high\n23+9=", "too low\n23+9=", "not a number\n23+9=", None]
    assert [s.reward for s in steps] == [0.0, 0.0, 0.0, 0.5**3]
    assert [s.solved for s in steps] == [False, False, False, True]
    assert not any(s.tool_call for s in steps)
    for step in steps:
        assert set(step.observation or "") <= TINY_CHARS


def test_feedback_reward_is_discounted_by_turn() -> None:
    for discount in (0.5, 0.9, 1.0):
        env = build_environment("arithmetic_feedback", {"discount": discount}, max_turns=8)
        for k in range(1, 5):
            steps = _play_sync(env, PROMPT, ["0"] * (k - 1) + ["The answer is 32."])
            assert len(steps) == k
            assert steps[-1].solved and steps[-1].observation is None
            assert steps[-1].reward == pytest.approx(discount ** (k - 1))


def test_feedback_scores_the_first_integer_with_its_sign() -> None:
    assert first_integer("it is -7, not 8") == -7
    assert first_integer("3-5") == 3
    assert first_integer("none") is None
    negative = Prompt("neg", "3-10=", "-7")
    env = ArithmeticFeedback(max_turns=3)
    assert _play_sync(env, negative, ["-7"])[0].solved
    assert _play_sync(env, negative, ["7 or so"])[0].observation == "too high\n3-10="
    assert _play_sync(env, PROMPT, ["032"])[0].solved  # the integer, not its spelling


def test_feedback_without_restating_and_the_last_try() -> None:
    env = build_environment("arithmetic_feedback", {"restate": False}, max_turns=2)
    steps = _play_sync(env, PROMPT, ["1", "2", "32"])
    assert [s.observation for s in steps] == ["too low", None]  # the last try ends the episode
    assert [s.reward for s in steps] == [0.0, 0.0]
    assert not steps[-1].solved


def test_feedback_episodes_are_independent() -> None:
    env = ArithmeticFeedback(max_turns=4)
    first = env.start(PROMPT)
    second = env.start(Prompt("q-8", "1+1=", "2"))
    assert first.step("0").observation == "too low\n23+9="
    assert second.step("2").solved
    assert first.step("32").reward == 0.5  # its second turn, whatever the other episode did


def test_feedback_takes_the_shipped_tasks_prompts() -> None:
    env = ArithmeticFeedback(max_turns=2)
    prompts = [*ArithmeticTask().heldout(5), *[p for _, p in zip(range(5), synthetic_stream(3))]]
    for prompt in prompts:
        assert _play_sync(env, prompt, [prompt.answer])[0].solved


def test_feedback_refuses_a_non_integer_answer_naming_the_prompt() -> None:
    env = ArithmeticFeedback(max_turns=2)
    with pytest.raises(ValueError, match="'p-3'.*'4.5'"):
        env.start(Prompt("p-3", "9/2=", "4.5"))


# -- calculator ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2+3*4", "14"),
        ("(2+3)*4", "20"),
        ("-(7-10)", "3"),
        ("7/2", "3.5"),
        ("8/4", "2"),
        ("1/3", "0.333333"),
        ("7//2", "3"),
        ("-7//2", "-4"),
        ("7%3", "1"),
        ("2**10", "1024"),
        ("2**-1", "0.5"),
        (" 12 * 12 ", "144"),
        ("1e3", "1000"),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert format_value(evaluate(expression)) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os')", "unsupported expression"),
        ("__import__('os').system('true')", "unsupported expression"),
        ("(1).real", "unsupported expression"),
        ("().__class__", "unsupported expression"),
        ("x+1", "unsupported expression"),
        ("[1][0]", "unsupported expression"),
        ("'a'*3", "unsupported expression"),
        ("True+1", "unsupported expression"),
        ("1 if 1 else 2", "unsupported expression"),
        ("lambda: 1", "unsupported expression"),
        ("2**100000", "exponent too large"),
        ("2**2**2**2**2", "exponent too large"),
        ("9**60", "number too large"),
        ("10**15*10**15", "number too large"),
        ("99999999999999999999", "number too large"),
        ("1e300", "number too large"),
        ("1/0", "division by zero"),
        ("5%0", "division by zero"),
        ("0**-1", "division by zero"),
        ("(-8)**0.5", "not a real number"),
        ("2+", "invalid syntax"),
        ("1; 2", "invalid syntax"),
        ("", "empty expression"),
        ("1+" * 150 + "1", "expression too long"),
    ],
)
def test_calculator_refuses_anything_else(expression: str, error: str) -> None:
    with pytest.raises(CalcError) as raised:
        evaluate(expression)
    assert str(raised.value) == error
    assert set(f"<result>error: {error}</result>") <= TINY_CHARS


OVERSIZED = [
    ("9**9**9", "exponent too large"),
    ("2**-65", "exponent too large"),
    ("10**64", "number too large"),
    ("(10**15)**64", "number too large"),
    ("-(10**15)**63", "number too large"),
    ("9" * 16, "number too large"),
    ("10**15 * 10**15", "number too large"),
    ("1" + "+1" * 100, "expression too long"),
    ("(" * 101 + "1" + ")" * 101, "expression too long"),
]


def test_calculator_refuses_an_oversized_expression_before_computing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bound's message; and no value the evaluator computes (constants, intermediates,
    results: all go through `_bounded`) is ever beyond what one cheap step past the bound gives:
    a refused power is refused from its operands' sizes, never by computing it. The deepest
    expressions the length bound lets through (99 nested parentheses, 199 unary minuses) evaluate:
    the parser's own nesting limit is never reached."""
    computed: list[int | float] = []
    bounded = calculator._bounded

    def recording(value: object) -> int | float:
        if isinstance(value, int | float):
            computed.append(value)
        return bounded(value)

    monkeypatch.setattr(calculator, "_bounded", recording)
    for expression, message in OVERSIZED:
        with pytest.raises(CalcError, match=f"^{message}$"):
            evaluate(expression)
        assert all(abs(v) <= calculator.MAX_MAGNITUDE**2 for v in computed), (expression, max(computed, key=abs))
    assert evaluate("-" * 190 + "1") == 1
    assert evaluate("(" * 99 + "1" + ")" * 99) == 1
    assert evaluate("-" * 199 + "1") == -1


def test_calculator_tool_calls_and_final_answer() -> None:
    env = build_environment("calculator", {}, max_turns=4)
    steps = _play_sync(env, PROMPT, ["<calc>23+9</calc>", "<calc>1/0</calc> and <calc>2+2</calc>", "32"])
    assert [s.observation for s in steps] == ["<result>32</result>\n", "<result>error: division by zero</result>\n", None]
    assert [s.tool_call for s in steps] == [True, True, False]
    assert [s.reward for s in steps] == [0.0, 0.0, 1.0]  # no discount: the final answer scores 1
    assert steps[-1].solved
    wrong = _play_sync(env, PROMPT, ["31"])
    assert [(s.observation, s.reward, s.solved, s.tool_call) for s in wrong] == [(None, 0.0, False, False)]
    unclosed = _play_sync(env, PROMPT, ["<calc>32"])  # no tool call: the final answer
    assert unclosed[0].solved and not unclosed[0].tool_call


def test_calculator_max_calls_and_the_last_turn() -> None:
    env = build_environment("calculator", {"max_calls": 2, "result_suffix": ""}, max_turns=5)
    steps = _play_sync(env, PROMPT, ["<calc>1+1</calc>", "<calc>2+2</calc>", "<calc>3+3</calc>", "<calc>4+4</calc>", "<calc>5+5</calc>"])
    assert [s.observation for s in steps] == [
        "<result>2</result>",
        "<result>4</result>",
        "<result>error: too many calls</result>",
        "<result>error: too many calls</result>",
        None,  # a tool call at the last turn: no turn left to read it, the episode ends unsolved
    ]
    assert all(s.tool_call and s.reward == 0.0 and not s.solved for s in steps)
    none_allowed = build_environment("calculator", {"max_calls": 0}, max_turns=3)
    assert _play_sync(none_allowed, PROMPT, ["<calc>1</calc>"])[0].observation == "<result>error: too many calls</result>\n"


# -- resolving task.environment --------------------------------------------------------------------


def test_builtins_are_registered_and_get_max_turns() -> None:
    assert set(ENVIRONMENTS) == {"arithmetic_feedback", "calculator", "draft_answer"}
    env = build_environment("arithmetic_feedback", {"discount": 0.9}, max_turns=3)
    assert isinstance(env, ArithmeticFeedback) and env.max_turns == 3 and env.discount == 0.9
    calc = build_environment("calculator", {"max_calls": 1}, max_turns=6)
    assert isinstance(calc, Calculator) and calc.max_turns == 6 and calc.max_calls == 1


def _write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


USER_ENV = """
    from relayrl.envs.base import EnvStep

    class Echo:
        def __init__(self, greeting="hi"):
            self.greeting = greeting

        def start(self, prompt):
            return self

        def step(self, action):
            return EnvStep(None, reward=1.0 if action == self.greeting else 0.0)

    def make_echo(**options):
        return Echo(**options)

    class NeedsSecret:
        def __init__(self, secret):
            if secret < 0:
                raise ValueError("secret must be >= 0")

        def start(self, prompt):
            return self

    class NoStart:
        pass

    NOT_CALLABLE = 3
"""


def test_user_classes_and_factories_by_file_and_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "user_envs.py", USER_ENV)
    by_file = build_environment(f"{path}:Echo", {"greeting": "hello"}, max_turns=4)
    assert _play_sync(by_file, PROMPT, ["hello"])[0].reward == 1.0
    assert _play_sync(build_environment(f"{path}:make_echo", {}, max_turns=4), PROMPT, ["hi"])[0].reward == 1.0
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = build_environment("user_envs:Echo", {}, max_turns=4)
    assert type(by_module).__name__ == "Echo" and by_module.greeting == "hi"  # type: ignore[attr-defined]


def test_user_classes_do_not_get_max_turns(tmp_path: Path) -> None:
    source = """
        class Strict:
            def __init__(self):  # no max_turns, no options
                pass

            def start(self, prompt):
                return None
    """
    path = _write(tmp_path / "strict.py", source)
    assert type(build_environment(f"{path}:Strict", {}, max_turns=9)).__name__ == "Strict"


def _refused(spec: str, options: dict[str, object] | None = None, *, match: str) -> str:
    with pytest.raises(EnvironmentSpecError, match=match) as raised:
        build_environment(spec, options or {}, max_turns=3)
    message = str(raised.value)
    assert "task.environment" in message and repr(spec) in message, message
    assert "\n" not in message
    return message


def test_every_resolution_error_names_the_key_and_the_entry(tmp_path: Path) -> None:
    path = _write(tmp_path / "user_envs2.py", USER_ENV)
    broken = _write(tmp_path / "broken.py", "raise RuntimeError('boom at import')\n")
    exits = _write(tmp_path / "exits.py", "import sys\nsys.exit(3)\n")
    assert "arithmetic_feedback, calculator" in _refused("no_such_env", match="unknown environment")
    _refused("not a module:Env", match="neither a module name")
    _refused("mod:not-a-name", match="not a function name")
    _refused(f"{tmp_path / 'missing.py'}:Env", match="no such file")
    _refused("relayrl_no_such_module_xyz:Env", match="importing module 'relayrl_no_such_module_xyz' failed.*ModuleNotFoundError")
    _refused(f"{broken}:Env", match="loading .*broken.py failed.*RuntimeError: boom at import")
    _refused(f"{exits}:Env", match="SystemExit")
    _refused(f"{path}:Missing", match="has no attribute 'Missing'")
    _refused(f"{path}:NOT_CALLABLE", match="not callable.*int")
    _refused(f"{path}:NoStart", match="no callable 'start'")


def test_bad_options_name_environment_config(tmp_path: Path) -> None:
    path = _write(tmp_path / "user_envs3.py", USER_ENV)
    cases: list[tuple[str, dict[str, object], str]] = [
        (f"{path}:Echo", {"colour": "red"}, "unexpected keyword argument 'colour'"),
        (f"{path}:NeedsSecret", {}, "missing a required argument: 'secret'"),
        (f"{path}:NeedsSecret", {"secret": -1}, "constructing it failed.*secret must be >= 0"),
        (f"{path}:make_echo", {"colour": "red"}, "constructing it failed.*TypeError.*colour"),
        ("arithmetic_feedback", {"discount": 2.0}, "discount must be a number in"),
        ("arithmetic_feedback", {"discunt": 0.9}, "unexpected keyword argument 'discunt'"),
        ("arithmetic_feedback", {"max_turns": 2}, "set by rollout.max_turns"),
        ("calculator", {"max_calls": -1}, "max_calls must be an integer"),
        ("calculator", {"max_calls": "4"}, "max_calls must be an integer"),
    ]
    for spec, options, match in cases:
        assert "task.environment_config" in _refused(spec, options, match=match)


# -- docs/environments.md's example---------------------------------------------------------------------


def test_the_readme_example_plays_sync_and_async() -> None:
    secret = Prompt("g-1", "Guess my number (1 to 100):", "37")
    guesses = ["50", "I say 20", "hmm", "37", "99"]
    expected = ["50 is too high. Guess again:", "20 is too low. Guess again:", "Say a number.", None]

    sync_env = build_environment(f"{EXAMPLE}:GuessNumberSync", {"penalty": 0.2}, max_turns=5)
    assert not inspect.iscoroutinefunction(sync_env.start)
    for steps in (_play_sync(sync_env, secret, guesses), asyncio.run(_play(sync_env, secret, guesses))):
        assert [s.observation for s in steps] == expected
        assert steps[-1].solved and steps[-1].reward == pytest.approx(1.0 - 0.2 * 3)

    async_env = build_environment(f"{EXAMPLE}:GuessNumber", {}, max_turns=5)
    assert inspect.iscoroutinefunction(async_env.start)
    steps = asyncio.run(_play(async_env, secret, guesses))
    assert [s.observation for s in steps] == expected
    assert steps[-1].solved and steps[-1].reward == pytest.approx(1.0 - 0.25 * 3)
    assert asyncio.run(_play(async_env, secret, ["37"]))[0].reward == 1.0

    assert "penalty must lie in [0, 1]" in _refused(f"{EXAMPLE}:GuessNumber", {"penalty": 3}, match="task.environment_config")


def test_pick_last_scores_a_chatty_models_final_number() -> None:
    prompt = Prompt("p1", "Calculate 5 + 10.", "15")
    first = ArithmeticFeedback(max_turns=2).start(prompt)
    assert first.step("5 + 10 = 15").observation is not None  # the first integer, 5, is wrong
    last = ArithmeticFeedback(max_turns=2, pick="last").start(prompt)
    assert last.step("5 + 10 = 15").solved
    calc = Calculator(max_turns=2, pick="last").start(prompt)
    assert calc.step("So 5 + 10 = 15").solved
    with pytest.raises(ValueError, match="pick must be 'first' or 'last'"):
        ArithmeticFeedback(max_turns=2, pick="middle")


def test_draft_answer_scores_the_draft_and_the_answer_as_the_example_agent_does() -> None:
    env = build_environment("draft_answer", {}, max_turns=2)
    assert isinstance(env, DraftAnswer)
    prompt = Prompt("p", "23+9=", "32")
    right_then_right = env.start(prompt)
    first = right_then_right.step("32")
    assert isinstance(first, EnvStep) and first.observation == "\n23+9=" and first.reward == 0.5 and not first.solved
    last = right_then_right.step(" 32 ")
    assert isinstance(last, EnvStep) and last.observation is None and last.reward == 1.0 and last.solved
    wrong_then_right = env.start(prompt)
    steps = [wrong_then_right.step("31"), wrong_then_right.step("32")]
    assert [s.reward for s in steps if isinstance(s, EnvStep)] == [0.0, 1.0]
    with pytest.raises(EnvironmentSpecError, match="max_turns must be >= 2"):
        build_environment("draft_answer", {}, max_turns=1)
