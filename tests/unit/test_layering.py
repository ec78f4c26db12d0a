"""Workers never know who drives them, and telemetry never steers: no module under
`relayrl.backends`, `relayrl.telemetry`, `relayrl.algorithms` or `relayrl.envs` imports
`relayrl.orchestrator` (its stages included), directly or through other modules.

Uses the import graph of tests/unit/test_imports.py: every import a module can execute (top level and
inside functions), `if TYPE_CHECKING:` imports left out.
"""

from __future__ import annotations

from collections.abc import Mapping

from test_imports import import_graph

LOWER = ("relayrl.backends", "relayrl.telemetry", "relayrl.algorithms", "relayrl.envs")
FORBIDDEN = "relayrl.orchestrator"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _path_to_forbidden(graph: Mapping[str, Mapping[str, tuple[object, int, str]]], start: str) -> list[str] | None:
    """The shortest import chain from `start` to a module of the orchestrator (None: there is none)."""
    prev: dict[str, str] = {}
    seen = {start}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w in seen:
                    continue
                seen.add(w)
                prev[w] = v
                if _within(w, FORBIDDEN):
                    chain = [w]
                    while chain[-1] != start:
                        chain.append(prev[chain[-1]])
                    return chain[::-1]
                nxt.append(w)
        frontier = nxt
    return None


def test_lower_layers_never_import_the_orchestrator() -> None:
    graph = import_graph()
    offenders = []
    for name in sorted(graph):
        if not any(_within(name, p) for p in LOWER):
            continue
        chain = _path_to_forbidden(graph, name)
        if chain is not None:
            line = graph[chain[0]][chain[1]]
            offenders.append(f"{' -> '.join(chain)}  (first edge: {line[0]}:{line[1]}: {line[2]})")
    assert not offenders, "lower layers reach the orchestrator:\n" + "\n".join(offenders)


def test_the_check_sees_a_transitive_import() -> None:
    """The search follows chains through modules outside the checked packages."""
    graph = {
        "relayrl.envs.x": {"relayrl.rewards.y": (None, 1, "")},
        "relayrl.rewards.y": {"relayrl.orchestrator.stages.z": (None, 2, "")},
        "relayrl.orchestrator.stages.z": {},
    }
    assert _path_to_forbidden(graph, "relayrl.envs.x") == ["relayrl.envs.x", "relayrl.rewards.y", "relayrl.orchestrator.stages.z"]
    assert _path_to_forbidden(graph, "relayrl.rewards.y") is not None
    assert _path_to_forbidden({"relayrl.envs.x": {}}, "relayrl.envs.x") is None
