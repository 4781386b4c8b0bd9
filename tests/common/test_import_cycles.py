"""No import cycle between the modules of the first-party packages, read from source with `ast`.

The edges are tests/helpers/imports.py's: every import statement, at the top, inside a function, under
`if TYPE_CHECKING:` or in a `try`, relative ones resolved, `from P import submodule` an edge to the submodule.
The parent packages Python runs on the way are not edges, so a package `__init__` that re-exports its
submodules is no cycle by itself, and becomes one as soon as one of those submodules imports the package
`__init__` back (`from P import name` with name defined there).

A cycle is a strongly connected component of more than one module, or a module importing itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.imports import SOURCE_ROOTS, import_graph, imports_of


def strongly_connected(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`, each sorted (iterative: no recursion limit)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The import cycles of `graph`: components of more than one module, and modules importing themselves."""
    return sorted(c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]])


def _path_through(graph: dict[str, frozenset[str]], component: list[str]) -> list[str]:
    """One closed import chain inside `component`, starting at its first module (for the failure message)."""
    members, start = set(component), component[0]
    previous, todo = {start: None}, [start]
    while todo:
        node = todo.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                chain = [node]
                while previous[chain[-1]] is not None:
                    chain.append(previous[chain[-1]])
                return [*reversed(chain), start]
            if child not in previous:
                previous[child] = node
                todo.append(child)
    raise AssertionError(f"{component} is not a cycle")


def describe(graph: dict[str, frozenset[str]]) -> str:
    """Each cycle's modules, and one chain of imports closing it."""
    lines = []
    for component in cycles(graph):
        lines.append(f"{len(component)} modules: {', '.join(component)}")
        lines.append("  e.g. " + " -> ".join(_path_through(graph, component)))
    return "\n".join(lines)


def test_the_graph_reads_every_kind_of_import():
    """Function-level, TYPE_CHECKING, relative and `from package import submodule` imports are all edges,
    checked on a throwaway graph built the same way."""
    source = {
        "pkg": "from pkg import a\n",
        "pkg.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import X\n",
        "pkg.b": "def f():\n    from . import c\n",
        "pkg.c": "import pkg.d\n",
        "pkg.d": "from .a import Y\nfrom pkg import VALUE\n",
    }
    known = {name: Path(name.replace(".", "/") + ("/__init__.py" if name == "pkg" else ".py")) for name in source}
    graph = {name: imports_of(name, known[name], text, known) for name, text in source.items()}
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.d"},
        "pkg.d": {"pkg.a", "pkg"},
    }
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"]]
    assert cycles({"x": frozenset({"x"}), "y": frozenset()}) == [["x"]]


def test_every_package_is_read():
    graph = import_graph()
    assert {module.split(".")[0] for module in graph} == set(SOURCE_ROOTS)


def test_no_import_cycles():
    graph = import_graph()
    assert not cycles(graph), f"import cycles (A -> B: A imports B):\n{describe(graph)}"


if __name__ == "__main__":
    # `python tests/common/test_import_cycles.py` lists today's cycles (empty output: none)
    sys.stdout.write(describe(import_graph()) + "\n")
