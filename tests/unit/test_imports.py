"""No import cycle anywhere in src/relayrl.

The graph is built with ``ast`` from every import statement a module can execute: top-level ones
and those inside functions and methods alike (an import that runs late still closes a cycle; it only
hides it until the function is called). Imports under ``if TYPE_CHECKING:`` never run and are left
out. ``from relayrl.x import y`` is an edge to ``relayrl.x.y`` when that is a module and to
``relayrl.x`` otherwise; importing ``relayrl.x.y`` runs ``relayrl.x``'s ``__init__`` first, so it is
an edge to that package as well (unless the importer lives inside it).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "relayrl"


def _modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` at any depth, except the bodies of ``if TYPE_CHECKING:``."""
    nodes: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            nodes.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return sorted(nodes, key=lambda n: n.lineno)


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(src: Path = SRC) -> dict[str, dict[str, tuple[Path, int, str]]]:
    """module -> {imported relayrl module: (file, line, source text of the import)}."""
    modules = _modules(src)
    graph: dict[str, dict[str, tuple[Path, int, str]]] = {name: {} for name in modules}
    for name, path in modules.items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _import_nodes(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: resolve against this module's package
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for alias in node.names:
                    sub = f"{origin}.{alias.name}"
                    targets.append(sub if sub in modules else origin)
            where = (path, node.lineno, ast.get_source_segment(text, node) or ast.unparse(node))
            for target in targets:
                # the target module itself (or the nearest enclosing one that exists) and its packages
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if not target:
                    continue
                # importing relayrl.x.y runs relayrl.x's __init__ first; a module's own packages are
                # already running when it is imported, so only an explicit import of one is an edge
                for dep in [*_parents(target), target]:
                    if dep != name and (dep == target or dep not in _parents(name)):
                        graph[name].setdefault(dep, where)
    return graph


def find_cycles(graph: dict[str, dict[str, tuple[Path, int, str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as one cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(comp), comp[0]) for comp in components]


def _cycle_in(graph: dict[str, dict[str, tuple[Path, int, str]]], comp: set[str], start: str) -> list[str]:
    """One shortest cycle through ``start`` inside the component (breadth-first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in comp:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def describe(graph: dict[str, dict[str, tuple[Path, int, str]]], cycle: list[str]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        path, line, source = graph[a][b]
        lines.append(f"  {path.relative_to(SRC.parent) if path.is_relative_to(SRC.parent) else path}:{line}: {source}")
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in src/relayrl:\n" + "\n".join(describe(graph, c) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_finder_sees_function_level_and_submodule_imports(tmp_path: Path) -> None:
    src = _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from relayrl.pkg import b\n",
            "pkg/__init__.py": "",
            "pkg/b.py": "from relayrl import c\n",
            "c.py": "import relayrl.a\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relayrl import a\n",
            "e.py": "from . import d\n",
        },
    )
    graph = import_graph(src)
    assert set(graph["relayrl.a"]) == {"relayrl.pkg", "relayrl.pkg.b"}
    assert "relayrl.a" not in graph["relayrl.d"]  # TYPE_CHECKING imports never run
    assert "relayrl.d" in graph["relayrl.e"]  # relative import of a submodule
    cycles = find_cycles(graph)
    assert len(cycles) == 1
    assert set(cycles[0]) == {"relayrl.a", "relayrl.pkg.b", "relayrl.c"}
    text = describe(graph, cycles[0])
    assert "from relayrl.pkg import b" in text and "import relayrl.a" in text


def test_default_recipe_lives_outside_cli() -> None:
    from relayrl.recipes import default_recipe

    assert default_recipe().is_file()
    graph = import_graph()
    assert "relayrl.cli.main" not in graph["relayrl.bench.suite"]
    assert "relayrl.cli.main" not in graph["relayrl.recipes"]
