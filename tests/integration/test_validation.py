"""Bad input gets one line, never a traceback (issue 8): `--set` items and recipe files through
`load_config`, prompt files through the JSONL loader and traces through `load_trace`, as units,
as property tests on random input and through the command line (exit 2, one `error:` line naming
what and where, nothing written)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.analysis import timeline
from relayrl.analysis.checker import check_events
from relayrl.analysis.report import RunData, key_figures
from relayrl.config.schema import Config, ConfigError, load_config, parse_override
from relayrl.tasks.jsonl import (
    JsonlTask,
    JsonlTaskConfig,
    TaskDataError,
    load_jsonl_prompts,
)
from relayrl.telemetry.tracer import TraceError, load_trace
from support import cli

WIDE = {"COLUMNS": "160"}  # one line per error, whatever the terminal
# RELAYRL_PROPERTY_EXAMPLES=5000 for a longer hunt
PROPERTY = settings(
    max_examples=int(os.environ.get("RELAYRL_PROPERTY_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def relayrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return cli.relayrl(*args, cwd=cwd, env=WIDE)


def assert_one_error(res: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit 2, and stderr is one line `error: ...` holding every fragment."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _fields(model: type, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, annotation) of every leaf field of a config model."""
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        ann = info.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            yield from _fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", ann


def _is_float(ann: object) -> bool:
    if ann is float:
        return True
    return get_origin(ann) in (Union, UnionType) and float in get_args(ann)


KEYS = [key for key, _ in _fields(Config)]
FLOAT_KEYS = [key for key, ann in _fields(Config) if _is_float(ann)]


# -- config: --set keys and values (item 5) -----------------------------------------------------------


def test_set_keys_may_be_quoted() -> None:
    assert load_config(None, ['rollout."num_generations"=3']).rollout.num_generations == 3
    assert load_config(None, ["\"rollout\" . 'num_generations' = 5"]).rollout.num_generations == 5
    assert parse_override('"a.b".c=1') == (["a.b", "c"], 1)
    assert parse_override('"a=b".c="x=y"') == (["a=b", "c"], "x=y")
    with pytest.raises(ConfigError, match=r"""^unknown config key '"a.b"' \(from --set\)$"""):
        load_config(None, ['"a.b".c=1'])
    with pytest.raises(ConfigError, match=r"""^unknown config key 'rollout."num gens"' \(from --set\)$"""):
        load_config(None, ['rollout."num gens"=1'])


@pytest.mark.parametrize(
    "item", ["x.y=[1,", 'run.name="abc', "run.name='abc", 'task.reward_functions=["a",', "run.name={a=1", "run.name=[1] 2"]
)
def test_a_value_that_looks_like_toml_must_be_toml(item: str) -> None:
    with pytest.raises(ConfigError, match=rf"^--set {re.escape(repr(item))}: invalid TOML value: "):
        load_config(None, [item])


def test_bare_strings_and_toml_values() -> None:
    cfg = load_config(
        None, ["run.name=my-run 2", "rollout.temperature=0.5", 'task.reward_functions=["numeric_match"]', "run.steps = 3 # three"]
    )
    assert (cfg.run.name, cfg.rollout.temperature, cfg.task.reward_functions, cfg.run.steps) == ("my-run 2", 0.5, ["numeric_match"], 3)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("oops", "--set expects key=value, got 'oops'"),
        ("=1", "--set '=1': a key is missing"),
        ("a b=1", "--set 'a b=1': 'a b' is not a key"),
        ("run.steps=1\n[x]", "the value must be a single TOML value"),
        ("run.steps=" + "9" * 5000, "invalid TOML value: Exceeds the limit"),
        ("run.steps=" + "[" * 5000, "nested too deeply"),
        ("run.name.x=1", "invalid config key 'run.name' (from --set)"),
    ],
)
def test_bad_set_items_name_the_item(item: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [item])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_errors_under_a_set_are_blamed_on_the_set_not_the_recipe(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text("[run]\nsteps = 2\n")
    for item, message in [
        ("x.y=1", "unknown config key 'x' (from --set)"),  # the section it creates is unknown
        ("train.row_tokens.a=1", "invalid config key 'train.row_tokens' (from --set)"),
        ("train={row_tokens=-1}", "invalid config key 'train.row_tokens' (from --set)"),
        ("task.reward_functions=[1]", "invalid config key 'task.reward_functions[0]' (from --set)"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(recipe, [item])
        assert message in str(info.value), (item, str(info.value))
    recipe.write_text("[x]\ny = 1\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'x' \(from {re.escape(str(recipe))}\)"):
        load_config(recipe, ["run.steps=3"])


def test_unreadable_recipes_are_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'[run]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: not UTF-8 text"):
        load_config(bad)
    bad.write_text("[run]\nsteps = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="invalid TOML: Exceeds the limit"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)  # a directory


# -- config: finite floats, reward functions (item 6), prompt template (item 3) -------------------------


def test_every_float_key_is_found() -> None:
    assert {"sim.train_step", "train.learning_rate", "algorithm.tis_cap", "rollout.temperature"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_every_float_must_be_finite(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^invalid config key '{re.escape(key)}' \(from --set\): Input should be a finite number"):
        load_config(None, [f"{key}={value}"])


def test_a_recipe_float_must_be_finite(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text("[sim]\ntrain_step = inf\n")
    with pytest.raises(ConfigError, match=rf"'sim.train_step' \(from {re.escape(str(recipe))}\): Input should be a finite number"):
        load_config(recipe)


def test_reward_functions_need_at_least_one() -> None:
    with pytest.raises(ConfigError, match=r"^invalid config key 'task.reward_functions' \(from --set\): List should have at least 1 item"):
        load_config(None, ["task.reward_functions=[]"])


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{text} {other}", "unknown field {other}"),
        ("{text} {", "Single '{' encountered"),
        ("{text} }", "Single '}' encountered"),
        ("{text", "expected '}' before end of string"),
        ("{}: {text}", "unknown field {}"),
        ("{0}", "unknown field {0}"),
        ("{text.upper}", "unknown field {text.upper}"),
        ("{text[0]}", "unknown field {text[0]}"),
        ("{text!r}", "unknown field {text!r}"),
        ("{text:{width}}", "unknown field {text:{width}}"),
        ("no field", "must contain the field {text}"),
        ("{{text}}", "must contain the field {text}"),
    ],
)
def test_prompt_template_is_a_format_string_with_only_text(template: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"task.prompt_template={json.dumps(template)}"])
    text = str(info.value)
    assert text.startswith("invalid config key 'task.prompt_template' (from --set): ") and message in text, text


@given(st.text(max_size=30))
@PROPERTY
def test_an_accepted_prompt_template_always_formats(template: str) -> None:
    try:
        cfg = load_config(None, [f"task.prompt_template={json.dumps(template)}"])
    except ConfigError as exc:
        assert "task.prompt_template" in str(exc)
        return
    out = cfg.task.prompt_template.format(text="<T>")
    assert "<T>" in out
    assert load_config(None, ['task.prompt_template="Q: {text} {{json}}"']).task.prompt_template.format(text="x") == "Q: x {json}"


# -- property: random --set items and recipe files give a Config or one ConfigError (item 7) ---------

_TOML_VALUES = st.one_of(
    st.integers().map(str),
    st.floats().map(lambda f: "nan" if math.isnan(f) else ("inf" if f == math.inf else ("-inf" if f == -math.inf else repr(f)))),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.text(max_size=10).map(json.dumps),
    st.sampled_from(
        ["[]", "[1, 2]", '["exact_match"]', "{}", "{a = 1}", "1979-05-27", "07:32:00", "[1,", "{", "'", '"', "'a'", "0x1f", "1e999", "-0.0"]
    ),
    st.text(max_size=12),  # a bare string, or something that is neither
)
_KEY_TEXT = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: ".".join(f'"{p}"' for p in k.split("."))),
    st.text(alphabet="abcdefgruntsk._-\"' =[]{}#\n", max_size=15),
)


def _weighted(*choices: tuple[int, st.SearchStrategy[object]]) -> st.SearchStrategy[object]:
    """One of the strategies, drawn with the given weights (st.one_of weighs its branches alike)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


DEFAULTS = [
    f"{section}.{key}={json.dumps(value)}"
    for section, values in Config().model_dump().items()
    for key, value in values.items()
    if value is not None
]
_SET_ITEMS = _weighted(
    (6, st.sampled_from(DEFAULTS)),  # valid items (JSON scalars and lists are TOML too)
    (12, st.builds(lambda k, v: f"{k}={v}", _KEY_TEXT, _TOML_VALUES)),
    (1, st.text(max_size=25)),
    (1, st.text(alphabet="ab.=\"'[]{}, \n\\#", max_size=20)),
)


def _is_one_line_config_error(exc: ConfigError) -> bool:
    return bool(str(exc)) and "\n" not in str(exc) and "\r" not in str(exc)


@given(st.lists(_SET_ITEMS, max_size=3))
@PROPERTY
def test_random_set_items_give_a_config_or_one_config_error(items: list[str]) -> None:
    try:
        cfg = load_config(None, items)
    except ConfigError as exc:
        assert _is_one_line_config_error(exc), str(exc)
    else:
        assert isinstance(cfg, Config)


_SECTIONS = sorted({k.split(".")[0] for k in KEYS})
_RECIPE_LINES = st.one_of(
    st.sampled_from(_SECTIONS).map(lambda s: f"[{s}]"),
    st.text(alphabet="abcrunt.[]", max_size=8).map(lambda s: f"[{s}]"),
    st.builds(lambda k, v: f"{k.split('.')[-1]} = {v}", st.sampled_from(KEYS), _TOML_VALUES),
    st.builds(lambda k, v: f"{k} = {v}", st.sampled_from(KEYS), _TOML_VALUES),
    st.text(max_size=20),
)


@given(
    st.one_of(st.lists(_RECIPE_LINES, max_size=8).map(lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass")), st.binary(max_size=60))
)
@PROPERTY
def test_random_recipe_files_give_a_config_or_one_config_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "recipe.toml"
        recipe.write_bytes(content)
        try:
            cfg = load_config(recipe)
        except ConfigError as exc:
            assert _is_one_line_config_error(exc), str(exc)
        else:
            assert isinstance(cfg, Config)


# -- property: random JSONL files give prompts or one TaskDataError naming file and row (items 4, 7) --

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_ROW_OBJECTS = st.fixed_dictionaries(
    {
        "prompt": st.one_of(st.text(min_size=1, max_size=12), _JSON),
        "answer": st.one_of(st.text(max_size=5), st.integers(), st.floats(), _JSON),
    },
    optional={"id": st.one_of(st.text(max_size=4), st.integers(-3, 3), _JSON)},
)
_ROWS = st.one_of(
    st.builds(lambda o, a: json.dumps(o, ensure_ascii=a), _ROW_OBJECTS, st.booleans()),
    st.builds(json.dumps, _JSON),
    st.text(max_size=15),
    st.just(""),
)


def _jsonl_bytes(rows: list[str], crlf: bool, tail: bytes) -> bytes:
    return ("\r\n" if crlf else "\n").join(rows).encode("utf-8") + tail


@given(
    st.one_of(
        st.builds(_jsonl_bytes, st.lists(_ROWS, max_size=6), st.booleans(), st.sampled_from([b"", b"\n", b"\xff", b"\xe2\x80"])),
        st.binary(max_size=40),
    )
)
@PROPERTY
def test_random_jsonl_files_give_prompts_or_one_task_data_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_bytes(content)
        try:
            task = JsonlTask(JsonlTaskConfig(path=path))
        except TaskDataError as exc:
            message = str(exc)
            assert message.startswith(str(path)) and "\n" not in message, message
            assert re.match(rf"{re.escape(str(path))}, row \d+: ", message) or message.startswith(f"{path}: no prompts"), message
        else:
            assert task.train_prompts and all(p.text for p in task.train_prompts)


@given(st.lists(st.tuples(st.text(min_size=1, max_size=10), st.text(max_size=6), st.booleans()), min_size=1, max_size=5))
@PROPERTY
def test_jsonl_rows_read_back_exactly_whatever_characters_they_hold(rows: list[tuple[str, str, bool]]) -> None:
    # any text, U+2028, U+0085, \x0c and friends included, written as JSON by any writer (raw or escaped)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.jsonl"
        path.write_text("".join(json.dumps({"prompt": p, "answer": a}, ensure_ascii=e) + "\n" for p, a, e in rows), encoding="utf-8")
        prompts = load_jsonl_prompts(path)
    assert [(p.prompt_id, p.text, p.answer) for p in prompts] == [(f"p-{i}", p, a) for i, (p, a, _) in enumerate(rows, start=1)]


# -- property: random traces are read or rejected, and what is read never trips the checker or report -


def _mostly(good: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """`good` nineteen times in twenty, any JSON value otherwise."""
    return _weighted((19, good), (1, _JSON))


def _events(garbage: bool) -> st.SearchStrategy[list[object]]:
    """Lists of trace events of the fields the readers use; with `garbage`, any of them (or the
    whole event) may be some other JSON value."""
    g = _mostly if garbage else (lambda s: s)
    args = st.fixed_dictionaries(
        {},
        optional={
            "step": g(st.integers(-2, 5)),
            "microbatch": g(st.integers(0, 2)),
            "min_version": g(st.integers(-1, 5)),
            "version": _JSON,
            "thread": g(st.sampled_from(["MainThread", "relayrl-book"])),
            "status": g(st.just("completed")),
            "max_staleness": g(st.integers(0, 3)),
            "first_step": g(st.integers(0, 3)),
            "overlap_bookkeeping": _JSON,
            "loop_thread": _JSON,
        },
    )
    names = [
        "train_step",
        "optim_step",
        "get_metrics",
        "log_metrics",
        "on_step_end",
        "reduce_metrics",
        "weight_sync",
        "relayrl_run",
        "run_end",
        "checkpoint",
        "wait_data",
    ]
    event = st.fixed_dictionaries(
        {
            "ph": g(st.sampled_from(["X", "X", "X", "M", "i", "B"])),
            "name": g(st.sampled_from(names)),
            "ts": g(st.one_of(st.floats(0, 1e7), st.integers(0, 10**7))),
        },
        optional={
            "dur": g(st.one_of(st.floats(0, 1e6), st.integers(0 if not garbage else -1, 10**6))),
            "cat": g(st.sampled_from(["trainer", "bookkeeping", "orchestrator", "trainer.fetch"])),
            "args": g(args),
        },
    )
    return st.lists(g(event), max_size=12)


@pytest.mark.slow
@given(st.dictionaries(st.text(max_size=4), _JSON, max_size=4), st.booleans(), st.booleans())
@PROPERTY
def test_any_event_cut_anywhere_is_dropped_as_torn(event: dict[str, object], ascii_only: bool, one_line: bool) -> None:
    # whatever the event holds (escapes, non-ASCII text, NaN, nesting), every cut through it reads
    # as the events before it, in Tracer's one-event-a-line layout and in a one-line file
    first = {"ph": "M", "name": "process_name", "args": {"name": "relayrl"}}
    head = "[" + json.dumps(first) + ", " if one_line else "[\n" + json.dumps(first) + ",\n"
    body = json.dumps(event, ensure_ascii=ascii_only)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        for cut in range(len(body)):
            path.write_text(head + body[:cut], encoding="utf-8")
            assert load_trace(path) == [first], body[:cut]
        path.write_text(head + body + "}", encoding="utf-8")  # a complete value with one more character is not torn
        with pytest.raises(TraceError):
            load_trace(path)


@given(st.booleans().flatmap(_events), st.one_of(st.just(0), st.integers(0, 10**6)), st.booleans())
@PROPERTY
def test_random_traces_are_read_or_rejected_and_never_crash_downstream(events: list[object], cut: int, closed: bool) -> None:
    text = "[" + ",".join("\n" + json.dumps(e, separators=(",", ":")) for e in events) + ("\n]\n" if closed else "")
    text = text[: max(1, len(text) - cut % (len(text) + 1))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        path.write_text(text)
        try:
            read = load_trace(path)
        except TraceError as exc:
            assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)
            return
        check_events(read)
        spans = timeline.spans(read)
        timeline.trainer_busy_fraction(spans)
        timeline.exposed_bookkeeping_time(spans)
        key_figures(RunData(run_dir=Path(tmp), events=read))


# -- the command line: exit 2, one line, nothing written ----------------------------------------------


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("validation")
    res = relayrl("train", "--backend", "sim", "--set", "run.steps=3", "--set", "run.name=v", cwd=cwd)
    assert res.returncode == 0, res.stderr
    return cwd / "runs" / "v"


def _written(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_cli_item1_a_trace_cut_mid_event_is_read_by_check_trace_and_report(sim_run: Path, tmp_path: Path) -> None:
    text = (sim_run / "trace.json").read_text()
    lines = text.split("\n")
    cut = len("\n".join(lines[: len(lines) // 2])) + 1 + len(lines[len(lines) // 2]) // 2  # the middle of an event
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "trace.json").write_text(text[:cut])
    check = relayrl("check-trace", str(crashed), cwd=tmp_path)
    assert check.returncode == 0 and "run not completed (partial trace)" in check.stdout, check.stderr
    report = relayrl("report", str(crashed), cwd=tmp_path)
    assert report.returncode == 0 and (crashed / "report.html").exists(), report.stderr


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b'[1,"x",null]', "event 1: not an object"),
        (b'[{"ph":"X","name":"train_step","ts":"abc","dur":1}]', "event 1: 'ts' is not a number"),
        (bytes(range(256)), "not UTF-8 text"),
        (b"", "the file is empty"),
    ],
    ids=["not-objects", "ts-text", "random-bytes", "empty"],
)
@pytest.mark.parametrize("command", ["check-trace", "report"])
def test_cli_item1_garbage_traces_are_rejected_by_check_trace_and_report(
    tmp_path: Path, command: str, content: bytes, fragment: str
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "trace.json").write_bytes(content)
    assert_one_error(relayrl(command, str(run_dir), cwd=tmp_path), f"{run_dir / 'trace.json'}: ", fragment)
    assert _written(run_dir) == {"trace.json"}


@pytest.mark.parametrize("content", [None, "notes.txt"], ids=["empty", "other-files"])
def test_cli_item2_report_on_a_directory_that_is_not_a_run(tmp_path: Path, content: str | None) -> None:
    target = tmp_path / "somewhere"
    target.mkdir()
    if content:
        (target / content).write_text("x")
    before = _written(tmp_path)
    assert_one_error(relayrl("report", str(target), cwd=tmp_path), f"error: {target}: not a run directory")
    assert _written(tmp_path) == before


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ('"{text} {other}"', "invalid config key 'task.prompt_template' (from --set): unknown field {other}"),
        ('"{text} {"', "invalid config key 'task.prompt_template' (from --set): must be a format string"),
        ("{text} {other}", "--set 'task.prompt_template={text} {other}': invalid TOML value"),
    ],
)
@pytest.mark.parametrize("backend", ["sim", "local"])
def test_cli_item3_bad_prompt_templates(tmp_path: Path, value: str, fragment: str, backend: str) -> None:
    assert_one_error(relayrl("train", "--backend", backend, "--set", f"task.prompt_template={value}", cwd=tmp_path), fragment)
    assert not (tmp_path / "runs").exists()


JSONL = [
    "--backend",
    "sim",
    "--set",
    "task.kind=jsonl",
    "--set",
    "task.path=data.jsonl",
    "--set",
    "run.steps=2",
    "--set",
    "eval.enabled=false",
]


def test_cli_item4_a_jsonl_row_with_a_line_separator_trains(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}\u2028+\u20291\x85=\x0c", "answer": str(i + 1)} for i in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    res = relayrl("train", *JSONL, cwd=tmp_path)
    assert res.returncode == 0 and "done: 2 steps" in res.stdout, res.stderr


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "caf\xe9", "answer": 1}\n', "data.jsonl, row 2: not valid UTF-8"),
        (b"", "data.jsonl: no prompts"),
        (b'{"prompt": "1+1=", "answer": 2}\n[1, 2]\n', "data.jsonl, row 2: expected a JSON object, got list"),
    ],
    ids=["not-utf8", "empty", "not-an-object"],
)
def test_cli_item4_bad_jsonl_files(tmp_path: Path, content: bytes, fragment: str) -> None:
    (tmp_path / "data.jsonl").write_bytes(content)
    assert_one_error(relayrl("train", *JSONL, cwd=tmp_path), fragment)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--set", "x.y=[1,"], "error: --set 'x.y=[1,': invalid TOML value"),
        (["--set", '"a.b".c=1'], """error: unknown config key '"a.b"' (from --set)"""),
        (["RECIPE", "--set", "x.y=1"], "error: unknown config key 'x' (from --set)"),
    ],
)
def test_cli_item5_set_errors_name_the_set(tmp_path: Path, args: list[str], fragment: str) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[run]\nbackend = "sim"\nsteps = 2\n')
    assert_one_error(relayrl("train", *[str(recipe) if a == "RECIPE" else a for a in args], cwd=tmp_path), fragment)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ("sim.train_step=inf", "error: invalid config key 'sim.train_step' (from --set): Input should be a finite number (got inf)"),
        ("train.learning_rate=inf", "error: invalid config key 'train.learning_rate' (from --set): Input should be a finite number"),
        ("rollout.temperature=nan", "error: invalid config key 'rollout.temperature' (from --set): Input should be a finite number"),
        ("task.reward_functions=[]", "error: invalid config key 'task.reward_functions' (from --set): List should have at least 1 item"),
    ],
)
def test_cli_item6_infinite_floats_and_no_reward_functions(tmp_path: Path, item: str, fragment: str) -> None:
    assert_one_error(relayrl("train", "--backend", "sim", "--set", item, cwd=tmp_path), fragment)
    assert not (tmp_path / "runs").exists()
