"""Every path the documentation cites exists: the README, docs/*.md (the design doc included) and
benchmarks/README.md.

What is checked, read from the text (URLs removed first):
- file paths with a known extension (``orchestrator/stages/sync.py``, ``src/relayrl/...``,
  ``tests/unit/test_x.py``, ``scripts/setup.sh``, ``recipes/default.toml``, ``docs/x.md``), resolved
  against the repo root, ``src/`` and ``src/relayrl/``; a bare ``name.py`` may live anywhere in the
  repository's source folders;
- folder paths in backticks ending in ``/`` whose first part is a repository or package folder
  (``backends/local/``);
- ``tests/unit/test_x.py::test_name``: the test function exists in that file; a backticked bare
  ``test_name``: some test file defines it;
- dotted modules ``relayrl.x.y`` (and ``relayrl.x.y.Name``): the modules exist and the name is
  defined (or imported) at the top of the last one;
- relative markdown links ``[text](docs/x.md#anchor)``: the file exists (relative to the citing
  file) and the anchor is one of its headings.

Placeholders (``path/to/file.py``, ``RUN_DIR/...``) and files a run writes are not repository paths
and are left out by the patterns, not by a list of exceptions.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "relayrl"
SOURCE_DIRS = ("src", "tests", "scripts", "benchmarks", "examples")

URL = re.compile(r"[a-z]+://[^\s)>`]+")
# a path with at least one folder: parts of word characters, dots and dashes; the first part must
# not be a placeholder in capitals (RUN_DIR/..., RECIPE.toml) or the `path/to/` example
PATH = re.compile(r"(?<![\w./:-])((?:[a-z_.][\w.-]*/)+[\w.-]+\.(?:py|md|toml|sh|txt))(?![\w/-])")
BARE_PY = re.compile(r"(?<![\w./:-])([A-Za-z_]\w*\.py)(?![\w/.-])")
DIR = re.compile(r"`((?:[a-z_][\w.-]*/)+)`")
TEST_REF = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*test_\w+\.py)::(test_\w+)")
TEST_NAME = re.compile(r"`(test_\w+)`")
DOTTED = re.compile(r"(?<![\w.])relayrl((?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PLACEHOLDERS = {"file.py", "path/to/file.py"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def _text(path: Path) -> str:
    return URL.sub("", path.read_text(encoding="utf-8"))


def _resolves(rel: str) -> bool:
    return any((base / rel).exists() for base in (ROOT, ROOT / "src", PACKAGE))


@cache
def _source_files() -> frozenset[str]:
    return frozenset(p.name for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


@cache
def _package_dirs() -> frozenset[str]:
    top = {p.name for p in ROOT.iterdir() if p.is_dir()}
    return frozenset(top | {p.name for p in PACKAGE.iterdir() if p.is_dir()})


def missing_paths(text: str) -> list[str]:
    """The file and folder paths `text` cites that do not exist."""
    missing = [m for m in PATH.findall(text) if m not in PLACEHOLDERS and not _resolves(m)]
    missing += [m for m in BARE_PY.findall(text) if m not in PLACEHOLDERS and m not in _source_files()]
    for folder in DIR.findall(text):
        if folder.split("/")[0] in _package_dirs() and not _resolves(folder):
            missing.append(folder)
    return missing


@cache
def _test_functions() -> dict[str, frozenset[str]]:
    """Test module path (relative to the repo) → the test functions it defines."""
    found: dict[str, frozenset[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        found[path.relative_to(ROOT).as_posix()] = frozenset(names)
    return found


def missing_tests(text: str) -> list[str]:
    """`tests/unit/test_x.py::test_y` and backticked `test_y` names `text` cites that no test file defines."""
    tests = _test_functions()
    missing = []
    for module, name in TEST_REF.findall(text):
        defined = [names for path, names in tests.items() if path == module or path.endswith("/" + module)]
        if not any(name in names for names in defined):
            missing.append(f"{module}::{name}")
    every = frozenset().union(*tests.values())
    missing += [name for name in TEST_NAME.findall(text) if name not in every]
    return missing


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def dotted_missing(dotted: str) -> bool:
    """Whether `relayrl<dotted>` (".x.y.Name") names no module or no top-level name of one."""
    parts = dotted.strip(".").split(".")
    here, module = PACKAGE, PACKAGE / "__init__.py"
    for i, part in enumerate(parts):
        if (here / part / "__init__.py").exists():
            here, module = here / part, here / part / "__init__.py"
        elif (here / f"{part}.py").exists():
            module = here / f"{part}.py"
            rest = parts[i + 1 :]
            return bool(rest) and rest[0] not in _top_level_names(module)
        else:
            return part not in _top_level_names(module)
    return False


def missing_modules(text: str) -> list[str]:
    return [f"relayrl{d}" for d in DOTTED.findall(text) if dotted_missing(d)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(path: Path) -> list[str]:
    """Relative markdown links in `path` whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(_text(path)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    return broken


DOCS = [pytest.param(p, id=p.relative_to(ROOT).as_posix()) for p in doc_files()]


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_path_exists(doc: Path) -> None:
    assert missing_paths(_text(doc)) == [], f"{doc.relative_to(ROOT)} cites paths that do not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_test_exists(doc: Path) -> None:
    assert missing_tests(_text(doc)) == [], f"{doc.relative_to(ROOT)} cites tests that do not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_module_exists(doc: Path) -> None:
    assert missing_modules(_text(doc)) == [], f"{doc.relative_to(ROOT)} cites modules or names that do not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == [], f"{doc.relative_to(ROOT)} has links that do not resolve"


def test_the_checks_catch_a_broken_citation(tmp_path: Path) -> None:
    text = (
        "the boundary (`bookkeeping.py`, orchestrator/stages/nothere.py, `backends/gone/`), "
        "relayrl.orchestrator.nothere, relayrl.types.NoSuchName, "
        "tests/unit/test_docs.py::test_that_does_not_exist and `test_nor_this_one`"
    )
    assert missing_paths(text) == ["orchestrator/stages/nothere.py", "bookkeeping.py", "backends/gone/"]
    assert missing_modules(text) == ["relayrl.orchestrator.nothere", "relayrl.types.NoSuchName"]
    assert missing_tests(text) == ["tests/unit/test_docs.py::test_that_does_not_exist", "test_nor_this_one"]
    fine = "see `orchestrator/stages/sync.py`, src/relayrl/rundir/checkpoint.py, `backends/local/`, relayrl.types.Trajectory"
    assert missing_paths(fine) == [] and missing_modules(fine) == []
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n\n[ok](#title) [gone](#nowhere) [file](missing.md) [web](https://example.com/a.md)\n")
    assert broken_links(doc) == ["#nowhere", "missing.md"]
