"""The wheels of `pants package ::` install with plain pip into fresh virtualenvs.

Run through Pants (`./pants test tests:wheels`), which builds the thirteen wheels into the
sandbox.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest

DISTRIBUTIONS = ["mt_dist", "mt_model", "mt_data", "mt_tensor_parallel", "mt_pipeline", "mt_zero",
                 "mt_checkpoint", "mt_plan", "mt_eval", "mt_formats", "mt_inference",
                 "mt_pretrain", "mt_convert"]
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
LOCAL_WHEELS = Path("/opt/wheels")  # where this kind of machine keeps the CPU build of torch
ROOT = Path.cwd()  # the repository root (Pants' sandbox, or a checkout)


def built_wheels() -> dict[str, Path]:
    wheels = {p.name.split("-")[0]: p for p in Path.cwd().rglob("mt_*.whl")}
    if not wheels:
        pytest.skip("no wheels in the working directory: run `./pants test tests:wheels`")
    return wheels


def metadata(wheel: Path) -> dict[str, Any]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(zf.read(name).decode())
        points = configparser.ConfigParser(delimiters=("=",))
        points.optionxform = str  # type: ignore[assignment,method-assign]  # keep the case
        entry = name.replace("METADATA", "entry_points.txt")
        if entry in zf.namelist():
            points.read_string(zf.read(entry).decode())
    found: dict[str, Any] = {key: msg.get_all(key) or []
                             for key in ("Name", "Version", "Summary", "Requires-Dist")}
    found["entry_points"] = {group: dict(points[group]) for group in points.sections()}
    return found


def make_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def pip_install(python: Path, *args: str) -> None:
    extra = []
    if CA_BUNDLE.exists():
        extra += ["--cert", str(CA_BUNDLE)]
    if LOCAL_WHEELS.exists():
        extra += ["--find-links", str(LOCAL_WHEELS)]
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONFIG_FILE"}
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *extra,
           *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


def run(python: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)


def test_one_wheel_per_distribution_with_ranges() -> None:
    wheels = built_wheels()
    assert sorted(wheels) == sorted(DISTRIBUTIONS)
    for dist, wheel in wheels.items():
        meta = metadata(wheel)
        assert meta["Version"] == ["0.1.0"], (dist, meta["Version"])
        for req in meta["Requires-Dist"]:
            assert "+cpu" not in req, f"{wheel.name} pins a local torch build: {req}"
            if req.startswith("mt-"):
                assert "~=" in req or ">=" in req, f"{wheel.name}: {req} is not a range"
    pipeline = metadata(wheels["mt_pipeline"])["Requires-Dist"]
    assert any(r.startswith("mt-dist") for r in pipeline), pipeline
    assert any(r.startswith("torch") for r in pipeline), pipeline
    data = metadata(wheels["mt_data"])["Requires-Dist"]
    assert not any(r.startswith(("torch", "mt-")) for r in data), data


def _requirement(text: str) -> str:
    """``torch (>=2.4)`` and ``torch>=2.4`` alike."""
    return text.replace(" (", "").replace(")", "").replace(" ", "")


def test_each_pyproject_agrees_with_its_wheel() -> None:
    """pip without Pants builds what Pants builds: the name, version, summary, requirements
    (plain and per extra) and entry points of each pyproject.toml are its wheel's."""
    wheels = built_wheels()
    for dist, wheel in wheels.items():
        name = dist.replace("_", "-")
        folder = ROOT / "packages" / name
        if not folder.is_dir():
            folder = ROOT / "apps" / name.removeprefix("mt-")
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        meta = metadata(wheel)
        fix = "run `./pants package :: && python infra/python/pyprojects.py dist`"
        assert [project["name"]] == meta["Name"] and [project["version"]] == meta["Version"], fix
        assert [project["description"]] == meta["Summary"], (dist, fix)
        wheel_reqs = {"": set()}
        for req in meta["Requires-Dist"]:
            spec, _, marker = req.partition(";")
            extra = marker.split("==")[1].strip(" '\"") if "extra ==" in marker else ""
            wheel_reqs.setdefault(extra, set()).add(_requirement(spec))
        declared = {"": {_requirement(r) for r in project["dependencies"]}}
        for extra, reqs in project.get("optional-dependencies", {}).items():
            declared[extra] = {_requirement(r) for r in reqs}
        assert declared == wheel_reqs, (dist, fix)
        points = dict(project.get("entry-points", {}))
        if "scripts" in project:
            points["console_scripts"] = project["scripts"]
        assert points == meta["entry_points"], (dist, fix)


def test_optional_integrations_are_extras_only() -> None:
    """deepspeed, lm-eval, wandb, tensorboard, matplotlib and mpi4py are never plain
    requirements: a package that works without them offers them as an extra."""
    optional = ("deepspeed", "lm-eval", "lm_eval", "wandb", "tensorboard", "matplotlib",
                "mpi4py")
    for dist, wheel in built_wheels().items():
        plain = [r for r in metadata(wheel)["Requires-Dist"] if "extra ==" not in r]
        assert not [r for r in plain if r.startswith(optional)], (dist, plain)
    extras = metadata(built_wheels()["mt_zero"])["Requires-Dist"]
    assert any(r.startswith("deepspeed") and "extra == 'deepspeed'" in r for r in extras), extras


def test_mt_data_installs_from_its_folder_and_runs_its_readme_example(tmp_path: Path) -> None:
    """`pip install -e packages/mt-data` in a fresh virtualenv (no Pants, no torch pulled),
    then the README's first example, from raw text to samples."""
    python = make_venv(tmp_path / "venv")
    pip_install(python, "-e", str(ROOT / "packages" / "mt-data"))
    readme = (ROOT / "packages" / "mt-data" / "README.md").read_text()
    example = re.search(r"## Install and a first dataset.*?```python\n(.*?)```", readme,
                        re.S).group(1)
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([str(python), "-c", example], cwd=work, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.match(r"\d+ documents, \d+ samples; first: \[", done.stdout), done.stdout
    where = run(python, "import mt_data, importlib.util; print(importlib.util.find_spec("
                        "'torch') is None, mt_data.__file__)")
    assert where.stdout.split()[0] == "True", "installing mt-data pulled torch"
    assert where.stdout.split()[1].startswith(str(ROOT)), where.stdout  # editable: the source


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with torch and the wheels mt-inference needs, not mt-pretrain's or
    mt-convert's: mt-inference alone; the test after it installs those two into it (one
    torch install, about a minute, for both)."""
    wheels = built_wheels()
    python = make_venv(tmp_path_factory.mktemp("wheels") / "venv")
    # Name the local CPU build of torch so pip does not fetch a multi-GB CUDA build.
    pip_install(python, "torch==2.13.0", *(str(w) for dist, w in wheels.items()
                                           if dist not in ("mt_pretrain", "mt_convert")))
    return python


def test_mt_inference_alone_scores_and_generates(wheel_venv: Path, tmp_path: Path) -> None:
    """mt-inference's wheel and the libraries it needs, without mt-pretrain (the training
    app) or mt-convert, in a fresh virtualenv: `python -m mt_inference generate` completes a
    prompt from a checkpoint with the greedy text mt-model gives here, and `eval` scores a
    built-in task into a results file."""
    import torch

    from mt_data import load_tokenizer
    from mt_formats import save_model
    from mt_model import GPT, GPTConfig, Sampling, generate

    python = wheel_venv
    found = run(python, "import importlib.util as u; print(u.find_spec('mt_pretrain'), "
                        "u.find_spec('mt_convert'))")
    assert found.stdout.split() == ["None", "None"], found.stdout + found.stderr
    torch.manual_seed(0)
    model = GPT(GPTConfig(2, 64, 4, 1000, 64), seed=5).eval()
    checkpoint = save_model(model, tmp_path / "model")
    tokenizer = load_tokenizer("tokenizer-1k")
    prompt = "Call me Ishmael."
    with torch.no_grad():
        tokens = generate(model, [tokenizer.encode(prompt)],
                          Sampling(max_new_tokens=12, stop_ids=(tokenizer.eod_id,)))[0].tokens
    common = [str(checkpoint), "--tokenizer", "tokenizer-1k"]
    done = subprocess.run([str(python), "-m", "mt_inference", "generate", *common, "--prompt",
                           prompt, "--max-new-tokens", "12"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(prompt + tokenizer.decode(tokens)), done.stdout
    results = tmp_path / "results.json"
    done = subprocess.run([str(python), "-m", "mt_inference", "eval", *common, "--task",
                           "mt-cloze", "--limit", "4", "--engine", "mt", "--output",
                           str(results)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(results.read_text())["results"]["mt-cloze"]["sample_len"] == 4


def test_all_wheels_install_and_mt_runs(wheel_venv: Path) -> None:
    """The thirteen wheels in one virtualenv (mt-pretrain's and mt-convert's added to the
    others: test_mt_inference_alone_scores_and_generates runs first), their requirements
    consistent (pip check), and `mt` runs."""
    wheels = built_wheels()
    python = wheel_venv
    pip_install(python, str(wheels["mt_pretrain"]), str(wheels["mt_convert"]))
    checked = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True,
                             text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    mt = python.parent / "mt"
    done = subprocess.run([str(mt), "--version"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for dist in DISTRIBUTIONS:
        assert f"{dist.replace('_', '-')}" in done.stdout
    assert "(source)" not in done.stdout and "not installed" not in done.stdout, done.stdout
    helped = subprocess.run([str(mt), "--help"], capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0, helped.stderr
    for command in ("convert", "eval", "generate", "serve", "bias"):  # from entry points
        assert command in helped.stdout, helped.stdout
    # No wheel pulls an optional integration, and `mt convert --help` (the plug-in) starts
    # without torch as `mt --help` does.
    done = run(python, "import importlib.util as u; print([m for m in ('deepspeed', 'lm_eval', "
                       "'wandb', 'tensorboard', 'matplotlib', 'mpi4py') if u.find_spec(m)])")
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
    done = run(python, "import sys; sys.modules['torch'] = None; from mt_pretrain.cli.app "
                       "import main; sys.argv = ['mt', 'convert', '--help']; main()")
    assert done.returncode == 0 and "Usage:" in done.stdout, done.stdout + done.stderr
    assert sys.version_info >= (3, 10)
