"""The wheels of `pants package ::` install with plain pip into fresh virtualenvs.

Run through Pants (`./pants test tests:wheels`), which builds the eleven wheels into the sandbox.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

DISTRIBUTIONS = ["mt_dist", "mt_model", "mt_data", "mt_tensor_parallel", "mt_pipeline", "mt_zero",
                 "mt_checkpoint", "mt_plan", "mt_eval", "mt_pretrain", "mt_convert"]
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
LOCAL_WHEELS = Path("/opt/wheels")  # where this kind of machine keeps the CPU build of torch


def built_wheels() -> dict[str, Path]:
    wheels = {p.name.split("-")[0]: p for p in Path.cwd().rglob("mt_*.whl")}
    if not wheels:
        pytest.skip("no wheels in the working directory: run `./pants test tests:wheels`")
    return wheels


def metadata(wheel: Path) -> dict[str, list[str]]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(zf.read(name).decode())
    return {key: msg.get_all(key) or [] for key in ("Name", "Version", "Requires-Dist")}


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
    # Optional integrations stay optional: only behind an extra.
    for dist, optional in (("mt_dist", "mpi4py"), ("mt_pipeline", "matplotlib")):
        plain = [r for r in metadata(wheels[dist])["Requires-Dist"] if "extra ==" not in r]
        assert not any(r.startswith(optional) for r in plain), (dist, plain)
    data = metadata(wheels["mt_data"])["Requires-Dist"]
    assert not any(r.startswith(("torch", "mt-")) for r in data), data


def test_mt_data_alone_does_not_pull_torch(tmp_path: Path) -> None:
    wheels = built_wheels()
    python = make_venv(tmp_path / "venv")
    pip_install(python, str(wheels["mt_data"]))
    done = run(python, "import mt_data, importlib.util; "
                       "print(importlib.util.find_spec('torch') is None)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", "installing mt-data pulled torch"


def test_all_wheels_install_and_mt_runs(tmp_path: Path) -> None:
    wheels = built_wheels()
    python = make_venv(tmp_path / "venv")
    # Name the local CPU build of torch so pip does not fetch a multi-GB CUDA build.
    pip_install(python, "torch==2.13.0", *map(str, wheels.values()))
    mt = python.parent / "mt"
    done = subprocess.run([str(mt), "--version"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for dist in DISTRIBUTIONS:
        assert f"{dist.replace('_', '-')}" in done.stdout
    assert "(source)" not in done.stdout and "not installed" not in done.stdout, done.stdout
    helped = subprocess.run([str(mt), "--help"], capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0, helped.stderr
    assert sys.version_info >= (3, 10)
