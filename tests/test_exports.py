"""No stale ``__all__``: every name a module of a package or app exports exists there (lazy
names included, through the package's ``__getattr__``), once."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path.cwd()


def _declared(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def test_every_exported_name_exists_once() -> None:
    checked, problems = 0, []
    for tree in _packages():
        for path in sorted(tree.rglob("*.py")):
            parts = path.relative_to(tree.parent).with_suffix("").parts
            if parts[-1] == "__main__" or (names := _declared(path)) is None:
                continue
            module = importlib.import_module(".".join(
                parts[:-1] if parts[-1] == "__init__" else parts))
            problems += [f"{module.__name__}.{n}: exported, not defined" for n in names
                         if not hasattr(module, n)]
            if len(set(names)) != len(names):
                problems.append(f"{module.__name__}: a name twice in __all__")
            checked += 1
    assert checked > 100 and not problems, problems


def _packages() -> list[Path]:
    """Every package folder (one with __init__.py: not an egg-info an editable install left)
    under packages/*/src and apps/*/src."""
    return [init.parent for pattern in ("packages/*/src/mt_*/__init__.py",
                                        "apps/*/src/mt_*/__init__.py")
            for init in sorted(ROOT.glob(pattern))]
