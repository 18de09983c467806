"""No import cycle in any package or app, counting the imports inside functions.

A function-local import hides a cycle from Python's import machinery but not from the
design: two modules that need each other are one concept split in two. The graph is every
module of packages/*/src and apps/*/src, with an edge for every ``import mt_...`` and
``from mt_... import ...`` anywhere in the file (a ``from package import name`` counts as an
edge to the submodule ``package.name`` when that is a module, else to the package). Imports
under ``if TYPE_CHECKING:`` are edges too: a module that names another's type depends on it
as much as one that calls it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path.cwd()


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every mt source tree."""
    found = {}
    for tree in _packages():
        for path in tree.rglob("*.py"):
            parts = path.relative_to(tree.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                           else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_finder_sees_a_cycle_through_a_local_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_local_and_type_only_imports_are_edges(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mt_b\n")
    b.write_text("def f():\n    import mt_a\n")
    graph = import_graph({"mt_a": a, "mt_b": b})
    assert graph == {"mt_a": {"mt_b"}, "mt_b": {"mt_a"}}
    assert cycles(graph) == [["mt_a", "mt_b"]]


def test_no_import_cycles() -> None:
    mods = modules()
    assert "mt_pretrain.config.resolve" in mods and "mt_dist.topology" in mods, sorted(mods)[:5]
    found = cycles(import_graph(mods))
    assert not found, "import cycles (function-local imports included): " + "; ".join(
        " <-> ".join(c) for c in found)


def _packages() -> list[Path]:
    """Every package folder (one with __init__.py: not an egg-info an editable install left)
    under packages/*/src and apps/*/src."""
    return [init.parent for pattern in ("packages/*/src/mt_*/__init__.py",
                                        "apps/*/src/mt_*/__init__.py")
            for init in sorted(ROOT.glob(pattern))]
