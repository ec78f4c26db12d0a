"""Prompt sources: the arithmetic task and JSONL prompt files."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from relayrl.tasks.jsonl import JsonlTask, JsonlTaskConfig, TaskDataError, load_jsonl_prompts
from relayrl.types import Prompt

PROBLEM = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def _solve(text: str) -> tuple[int, str, int, int]:
    m = PROBLEM.match(text)
    assert m is not None, f"prompt text {text!r} is not '<a><op><b>='"
    a, op, b = int(m[1]), m[2], int(m[3])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return a, op, b, value


# -- arithmetic ------------------------------------------------------------------------------------


def test_arithmetic_stream_is_deterministic_and_resumable() -> None:
    first = list(itertools.islice(ArithmeticTask(ArithmeticConfig(seed=7)).stream(), 300))
    again = list(itertools.islice(ArithmeticTask(ArithmeticConfig(seed=7)).stream(), 300))
    assert first == again
    resumed = list(itertools.islice(ArithmeticTask(ArithmeticConfig(seed=7)).stream(start=120), 180))
    assert resumed == first[120:]
    assert [p.prompt_id for p in first] == [f"arith-train-{i}" for i in range(300)]
    other = list(itertools.islice(ArithmeticTask(ArithmeticConfig(seed=8)).stream(), 300))
    assert sum(a.text != b.text for a, b in zip(first, other, strict=True)) > 250


@settings(max_examples=40, deadline=None)
@given(
    max_digits=st.integers(1, 4),
    operators=st.lists(st.sampled_from(["+", "-", "*"]), min_size=1, max_size=3, unique=True),
    allow_negative=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_arithmetic_answers_are_exact(max_digits: int, operators: list[str], allow_negative: bool, seed: int) -> None:
    task = ArithmeticTask(ArithmeticConfig(max_digits=max_digits, operators=tuple(operators), allow_negative=allow_negative, seed=seed))
    for p in itertools.islice(task.stream(), 60):
        a, op, b, value = _solve(p.text)
        assert p.answer == str(value)
        assert op in operators
        assert a < 10**max_digits and b < 10**max_digits
        if op == "-" and not allow_negative:
            assert value >= 0
        assert len(p.answer) <= task.max_answer_chars()


def test_max_answer_chars_is_the_tight_bound() -> None:
    assert ArithmeticTask(ArithmeticConfig(max_digits=2, operators=("+", "-"))).max_answer_chars() == 3
    assert ArithmeticTask(ArithmeticConfig(max_digits=2, operators=("-",))).max_answer_chars() == 2
    assert ArithmeticTask(ArithmeticConfig(max_digits=2, operators=("-",), allow_negative=True)).max_answer_chars() == 3
    assert ArithmeticTask(ArithmeticConfig(max_digits=3, operators=("*",))).max_answer_chars() == 6


def test_default_task_mixes_its_operators() -> None:
    texts = [p.text for p in itertools.islice(ArithmeticTask().stream(), 2000)]
    plus = sum("+" in t for t in texts)
    assert 800 < plus < 1200
    assert all(("+" in t) != ("-" in t) for t in texts)


def test_heldout_is_fixed_distinct_and_disjoint_from_training() -> None:
    task = ArithmeticTask(ArithmeticConfig(seed=3))
    held = task.heldout(300)
    assert held == ArithmeticTask(ArithmeticConfig(seed=99)).heldout(300)  # independent of the train seed
    assert task.heldout(100) == held[:100]
    assert len({p.text for p in held}) == 300
    assert [p.prompt_id for p in held] == [f"arith-heldout-{i}" for i in range(300)]
    for p in held:
        assert p.answer == str(_solve(p.text)[3])
    train_texts = {p.text for p in itertools.islice(task.stream(), 20_000)}
    assert not train_texts & {p.text for p in held}
    assert ArithmeticTask(ArithmeticConfig(heldout_seed=5)).heldout(300) != held


def test_heldout_too_large_for_the_problem_space_raises() -> None:
    tiny = ArithmeticTask(ArithmeticConfig(max_digits=1, operators=("+",)))  # 100 problems, ~10 reserved
    with pytest.raises(ValueError, match="distinct held-out problems"):
        tiny.heldout(60)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"operators": ()}, "at least one"),
        ({"operators": ("+", "/")}, "unknown operator"),
        ({"operators": ("+", "+")}, "duplicates"),
        ({"max_digits": 0}, "max_digits"),
        ({"heldout_share": 1.0}, "heldout_share"),
        ({"seed": 4, "heldout_seed": 4}, "must differ"),
    ],
)
def test_arithmetic_config_rejects_bad_settings(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ArithmeticConfig(**kwargs)  # type: ignore[arg-type]


def test_arithmetic_config_accepts_a_list_of_operators() -> None:
    cfg = ArithmeticConfig(operators=["*", "+"])  # type: ignore[arg-type]  # as TOML would give it
    assert cfg.operators == ("*", "+")


# -- jsonl -----------------------------------------------------------------------------------------


def _write(tmp_path: Path, lines: list[str], name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _rows(n: int) -> list[str]:
    return [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(n)]


def test_jsonl_loads_fields_numbers_and_ids(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "2+2=", "answer": "4", "id": "q-a"}),
            "",
            json.dumps({"prompt": "half of 1", "answer": 0.5}),
            json.dumps({"prompt": "3*3=", "answer": 9, "id": 17, "extra": [1]}),
        ],
    )
    assert load_jsonl_prompts(path) == [
        Prompt("q-a", "2+2=", "4"),
        Prompt("prompts-3", "half of 1", "0.5"),  # no id: file stem and 1-based row
        Prompt("17", "3*3=", "9", metadata={"extra": [1]}),  # other fields: the prompt's metadata
    ]


BAD_FILES: list[tuple[str, list[str] | None, int | None, str]] = [
    ("invalid_json", ['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2=", "answer": '], 2, "invalid JSON"),
    ("missing_answer", [*_rows(2), '{"prompt": "x"}'], 3, "missing field 'answer'"),
    ("missing_prompt", ['{"answer": "1"}'], 1, "missing field 'prompt'"),
    ("prompt_not_string", [*_rows(1), '{"prompt": 5, "answer": "5"}'], 2, "'prompt' must be a string"),
    ("empty_prompt", ['{"prompt": "", "answer": "5"}'], 1, "'prompt' is empty"),
    ("answer_bool", ['{"prompt": "t?", "answer": true}'], 1, "'answer' must be a string or a number"),
    ("answer_null", [*_rows(3), "", '{"prompt": "t?", "answer": null}'], 5, "'answer' must be a string or a number"),
    ("not_object", [*_rows(1), "[1, 2]"], 2, "expected a JSON object"),
    ("bad_id", ['{"prompt": "a", "answer": "b", "id": [1]}'], 1, "'id' must be a string or an integer"),
    (
        "duplicate_id",
        ['{"prompt": "a", "answer": "b", "id": "x"}', '{"prompt": "c", "answer": "d", "id": "x"}'],
        2,
        "duplicate id 'x' (first used in row 1)",
    ),
    ("empty_file", [], None, "no prompts"),
    ("blank_lines_only", ["", "   "], None, "no prompts"),
    ("missing_file", None, None, "cannot read"),
]


@pytest.mark.parametrize(("name", "lines", "row", "fragment"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_jsonl_errors_name_file_row_and_problem(tmp_path: Path, name: str, lines: list[str] | None, row: int | None, fragment: str) -> None:
    path = tmp_path / f"{name}.jsonl" if lines is None else _write(tmp_path, lines, f"{name}.jsonl")
    with pytest.raises(TaskDataError) as info:
        JsonlTask(JsonlTaskConfig(path=path))
    message = str(info.value)
    assert str(path) in message
    assert fragment in message
    if row is not None:
        assert f"row {row}:" in message
    assert isinstance(info.value, ValueError)


def test_jsonl_invalid_utf8_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "caf\xe9", "answer": "b"}\n')
    with pytest.raises(TaskDataError, match=r"latin1\.jsonl, row 2: not valid UTF-8"):
        load_jsonl_prompts(path)


def test_jsonl_error_in_heldout_file_names_that_file(tmp_path: Path) -> None:
    train = _write(tmp_path, _rows(4), "train.jsonl")
    held = _write(tmp_path, [*_rows(1), "{oops"], "held.jsonl")
    with pytest.raises(TaskDataError, match=r"held\.jsonl, row 2: invalid JSON"):
        JsonlTask(JsonlTaskConfig(path=train, heldout_path=held))


def test_jsonl_stream_cycles_every_row_once_per_epoch_and_resumes(tmp_path: Path) -> None:
    path = _write(tmp_path, _rows(7))
    task = JsonlTask(JsonlTaskConfig(path=path, seed=1))
    items = list(itertools.islice(task.stream(), 21))
    epochs = [items[0:7], items[7:14], items[14:21]]
    for epoch in epochs:
        assert sorted(p.prompt_id for p in epoch) == sorted(f"prompts-{r}" for r in range(1, 8))
    assert len({tuple(p.prompt_id for p in e) for e in epochs}) > 1  # reshuffled per epoch
    assert list(itertools.islice(task.stream(start=10), 11)) == items[10:21]
    assert [task.train_prompt(i) for i in range(21)] == items
    assert list(itertools.islice(JsonlTask(JsonlTaskConfig(path=path, seed=1)).stream(), 21)) == items
    assert list(itertools.islice(JsonlTask(JsonlTaskConfig(path=path, seed=2)).stream(), 21)) != items


def test_jsonl_unshuffled_stream_keeps_file_order(tmp_path: Path) -> None:
    path = _write(tmp_path, _rows(3))
    task = JsonlTask(JsonlTaskConfig(path=path, shuffle=False))
    assert [p.text for p in itertools.islice(task.stream(), 6)] == ["0+1=", "1+1=", "2+1="] * 2


def test_jsonl_heldout_last_rows_are_split_off(tmp_path: Path) -> None:
    path = _write(tmp_path, _rows(10))
    task = JsonlTask(JsonlTaskConfig(path=path, heldout_last=3))
    assert [p.text for p in task.heldout()] == ["7+1=", "8+1=", "9+1="]
    assert task.heldout(2) == task.heldout()[:2]
    trained = {p.prompt_id for p in itertools.islice(task.stream(), 70)}
    assert len(trained) == 7
    assert not trained & {p.prompt_id for p in task.heldout()}
    with pytest.raises(ValueError, match="3 available"):
        task.heldout(4)


def test_jsonl_heldout_file_and_bad_splits(tmp_path: Path) -> None:
    train = _write(tmp_path, _rows(4), "train.jsonl")
    held = _write(tmp_path, _rows(2), "held.jsonl")
    task = JsonlTask(JsonlTaskConfig(path=train, heldout_path=held))
    assert [p.prompt_id for p in task.heldout()] == ["held-1", "held-2"]
    assert len(task.train_prompts) == 4
    with pytest.raises(TaskDataError, match=r"train\.jsonl: heldout_last=4 leaves no training rows"):
        JsonlTask(JsonlTaskConfig(path=train, heldout_last=4))
    with pytest.raises(ValueError, match="not both"):
        JsonlTaskConfig(path=train, heldout_path=held, heldout_last=1)


# Characters str.splitlines() takes for line breaks, besides "\n". JSON allows U+2028, U+2029 and
# U+0085 raw inside a string; the loader also takes raw control characters there (JSON's strict
# mode would not), since a row ends at "\n" only.
SPLITLINES_BREAKS = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\r", "\t"]


@pytest.mark.parametrize("char", SPLITLINES_BREAKS, ids=[f"U+{ord(c):04X}" for c in SPLITLINES_BREAKS])
def test_jsonl_rows_end_at_newline_only(tmp_path: Path, char: str) -> None:
    path = tmp_path / "p.jsonl"
    rows = ['{"prompt": "a' + char + 'b=", "answer": "x' + char + '"}', '{"prompt": "2+2=", "answer": "4"}', '{"prompt": "3+3="}']
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(TaskDataError, match=r"p\.jsonl, row 3: missing field 'answer'"):  # rows still counted right
        load_jsonl_prompts(path)
    path.write_text("\n".join(rows[:2]) + "\n", encoding="utf-8")
    assert load_jsonl_prompts(path) == [Prompt("p-1", f"a{char}b=", f"x{char}"), Prompt("p-2", "2+2=", "4")]


def test_jsonl_crlf_bom_and_odd_rows(tmp_path: Path) -> None:
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": 1}\r\n\r\n{"prompt": "b", "answer": 2}\r\n')
    assert load_jsonl_prompts(path) == [Prompt("crlf-1", "a", "1"), Prompt("crlf-3", "b", "2")]


ODD_FILES: list[tuple[str, bytes, str]] = [
    ("not_utf8", b'{"prompt": "a", "answer": "b"}\n\xff\xfe\n', r"row 2: not valid UTF-8"),
    ("empty", b"", r": no prompts"),
    ("whitespace_only", b" \n\t\n\r\n", r": no prompts"),
    ("number_row", b'{"prompt": "a", "answer": "b"}\n3\n', r"row 2: expected a JSON object, got int"),
    ("string_row", b'"prompt"\n', r"row 1: expected a JSON object, got str"),
    ("null_row", b"null\n", r"row 1: expected a JSON object, got NoneType"),
    ("form_feed_row", b'{"prompt": "a", "answer": "b"}\n\x0c\n', r"row 2: invalid JSON"),
    ("huge_integer", b'{"prompt": "a", "answer": ' + b"9" * 5000 + b"}\n", r"row 1: invalid JSON \(Exceeds the limit"),
    (
        "deep_nesting",
        b'{"prompt": "a", "answer": "b", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        r"row 1: invalid JSON \(nested too deeply\)",
    ),
    ("lone_surrogate", b'{"prompt": "a\\ud800", "answer": "b"}\n', r"row 1: field 'prompt' holds an unpaired surrogate"),
    ("surrogate_id", b'{"prompt": "a", "answer": "b", "id": "\\udfff"}\n', r"row 1: field 'id' holds an unpaired surrogate"),
]


@pytest.mark.parametrize(("name", "content", "fragment"), ODD_FILES, ids=[f[0] for f in ODD_FILES])
def test_jsonl_odd_files_give_one_error_naming_file_and_row(tmp_path: Path, name: str, content: bytes, fragment: str) -> None:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(content)
    with pytest.raises(TaskDataError) as info:
        JsonlTask(JsonlTaskConfig(path=path))
    message = str(info.value)
    assert message.startswith(f"{path}") and re.search(fragment, message), message
    assert "\n" not in message
