"""The architecture's layering, enforced: a package may import only what its layer allows.

- mt-model and mt-data import no other mt package;
- the parallel packages (mt-tensor-parallel, mt-pipeline, mt-zero) import only mt-dist;
- mt-checkpoint imports mt-dist, mt-model and the parallel packages it reshards and
  materializes stages for; mt-plan
  imports mt-model and the parallel packages whose constants and simulator it uses; mt-eval
  imports only mt-data; mt-formats (every checkpoint format) sits on mt-checkpoint and what
  it needs; mt-inference (scoring, decoding, serving and their commands) on all of these;
- mt-dist imports no mt package;
- nothing imports an app (mt_pretrain, mt_convert) but the app itself;
- inside mt_pretrain and mt_inference, each subpackage or module imports only those below it
  (:data:`STACKS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path.cwd()
APPS = {"mt_pretrain", "mt_convert"}
#: What each distribution's sources may import among mt modules (itself always allowed).
ALLOWED: dict[str, set[str]] = {
    "mt_dist": set(),
    "mt_model": set(),
    "mt_data": set(),
    "mt_tensor_parallel": {"mt_dist"},
    "mt_pipeline": {"mt_dist"},
    "mt_zero": {"mt_dist"},
    # The checkpoint format and resharding, and the planner: above the parallel packages,
    # below the apps.
    "mt_checkpoint": {"mt_dist", "mt_model", "mt_tensor_parallel", "mt_pipeline", "mt_zero"},
    "mt_plan": {"mt_dist", "mt_model", "mt_pipeline", "mt_tensor_parallel", "mt_zero"},
    # Evaluation knows tasks, prompts and metrics, no model: it builds its built-in tasks
    # from mt-data's corpus.
    "mt_eval": {"mt_data"},
    # The format library: every checkpoint format mt reads or writes, over the packages that
    # define the model, its slicing and the training checkpoint.
    "mt_formats": {"mt_dist", "mt_model", "mt_data", "mt_tensor_parallel", "mt_pipeline",
                   "mt_zero", "mt_checkpoint"},
    # A trained checkpoint put to use (scoring, decoding, serving, the bias report) and its
    # commands: above every library it composes, below the apps (it imports none of them).
    "mt_inference": {"mt_dist", "mt_model", "mt_data", "mt_tensor_parallel", "mt_pipeline",
                     "mt_zero", "mt_checkpoint", "mt_plan", "mt_eval", "mt_formats"},
    "mt_pretrain": {"mt_dist", "mt_model", "mt_data", "mt_tensor_parallel", "mt_pipeline",
                    "mt_zero", "mt_checkpoint", "mt_plan", "mt_eval", "mt_formats",
                    "mt_inference"},
    # The command line over the format library.
    "mt_convert": {"mt_formats"},
}


def mt_imports(path: Path) -> set[tuple[str, int]]:
    """Top-level mt_* modules imported by a file, with the line of each import."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {(n.split(".")[0], node.lineno) for n in names if n.startswith("mt_")}
    return found


def source_trees() -> dict[str, Path]:
    trees = {}
    for src in _packages():
        if src.is_dir():
            trees[src.name] = src
    return trees


def test_every_distribution_is_checked() -> None:
    missing = set(ALLOWED) - set(source_trees())
    assert not missing, f"sources not found for {sorted(missing)} under {ROOT}"


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_layering(module: str) -> None:
    tree = source_trees()[module]
    violations = []
    for path in sorted(tree.rglob("*.py")):
        for imported, line in sorted(mt_imports(path)):
            if imported != module and imported not in ALLOWED[module]:
                violations.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not violations, f"{module} breaks the layering:\n" + "\n".join(violations)


def test_rules_forbid_importing_apps() -> None:
    for module, allowed in ALLOWED.items():
        assert not (allowed & APPS), f"{module} is allowed to import an app"


def _exported(init: Path) -> list[str]:
    """The names in a package's ``__all__`` (a literal list in its __init__.py)."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return []


def test_no_two_packages_export_one_name() -> None:
    """A name means one thing across mt: `from mt_x import name` never needs the package to
    tell which (e.g. the pipeline's step result is PipelineStepResult, the optimizer's
    StepResult)."""
    owners: dict[str, list[str]] = {}
    for module, tree in source_trees().items():
        if module in APPS:
            continue
        for name in _exported(tree / "__init__.py"):
            owners.setdefault(name, []).append(module)
    shared = {name: mods for name, mods in owners.items()
              if len(mods) > 1 and name != "__version__"}
    assert len(owners) > 100 and not shared, shared


#: The subpackages and top-level modules of mt_pretrain and mt_inference, bottom to top: each
#: imports only the ones before it, function-local imports included.
#: mt_pretrain: config is pure data and the engine registry; data is what a run reads;
#: engines run the model and write its checkpoints; run is one rank's training loop (it
#: scores tasks during training through mt-inference's scorer); launch starts ranks; contract
#: (the layout matrix) launches runs; the command line sits on everything.
#: mt_inference: the placement; figures and text (plots written atomically, text as tokens
#: come); whether the hub answers; the model read from a checkpoint; the scorer, then the
#: session (a model's stage on this rank, with its scorer), decoding by stages, generation;
#: evaluation (mt-eval's engine, the suites, lm-evaluation-harness), the bias report; the
#: launcher; the server; lm-eval's command line with mt registered; the commands.
STACKS = {
    "mt_pretrain": ["config", "data", "engines", "run", "launch", "contract", "cli",
                    "__main__"],
    "mt_inference": ["placement", "figures", "text", "hub", "model", "scorer", "session",
                     "decoder", "generation", "rank", "suites", "harness", "bias",
                     "bias_report", "launch", "serving", "lm_eval", "cli", "__main__"],
}


def _part(path: Path, tree: Path) -> str:
    rel = path.relative_to(tree)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("package", sorted(STACKS))
def test_a_stack_without_cycles(package: str) -> None:
    stack = STACKS[package]
    tree = source_trees()[package]
    parts = {_part(p, tree) for p in tree.rglob("*.py")} - {"__init__"}
    assert parts == set(stack), f"place {sorted(parts - set(stack))} in STACKS[{package!r}]"
    violations = []
    for path in sorted(tree.rglob("*.py")):
        mine = _part(path, tree)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                bits = name.split(".")
                if bits[0] != package or len(bits) < 2:
                    continue
                if stack.index(bits[1]) > stack.index(mine):
                    violations.append(f"{path.relative_to(ROOT)}:{node.lineno}: {mine} imports "
                                      f"{bits[1]}, which sits above it")
    assert not violations, "\n".join(violations)


def _packages() -> list[Path]:
    """Every package folder (one with __init__.py: not an egg-info an editable install left)
    under packages/*/src and apps/*/src."""
    return [init.parent for pattern in ("packages/*/src/mt_*/__init__.py",
                                        "apps/*/src/mt_*/__init__.py")
            for init in sorted(ROOT.glob(pattern))]
