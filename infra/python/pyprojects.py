"""Write each package's and app's pyproject.toml from the wheel Pants builds for it.

The Pants build is the one source of a distribution's metadata: its name, version, summary
and extras are in the folder's BUILD (`mt_distribution`), and its requirements are inferred
from what the sources import (ranges from infra/python/requirements.txt). The pyproject.toml
beside each `src/` lets pip build the same distribution without Pants (`pip install
./packages/mt-data`, `pip install -e packages/mt-data`). tests/test_wheels.py fails when a
pyproject.toml and its wheel disagree; then run:

    ./pants package :: && python infra/python/pyprojects.py dist/

Standard library only (Python >= 3.10).
"""

from __future__ import annotations

import configparser
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = ("# Generated from the Pants build by infra/python/pyprojects.py (edit the BUILD file or\n"
          "# infra/python/requirements.txt, then rerun it); tests/test_wheels.py checks that\n"
          "# this file and the wheel Pants builds agree.\n")


def wheel_metadata(wheel: Path) -> dict:
    """Name, version, summary, license, Python range, requirements (plain and per extra),
    entry points and package data of a wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        points = configparser.ConfigParser(delimiters=("=",))
        points.optionxform = str  # keep names' case
        if f"{info}/entry_points.txt" in names:
            points.read_string(zf.read(f"{info}/entry_points.txt").decode())
    plain, extras = [], {}
    for req in msg.get_all("Requires-Dist") or []:
        spec, _, marker = (part.strip() for part in req.partition(";"))
        spec = spec.replace(" (", "").replace(")", "")  # "torch (>=2.4)" -> "torch>=2.4"
        if marker.startswith("extra =="):
            extras.setdefault(marker.split("==", 1)[1].strip().strip("'\""), []).append(spec)
        else:
            plain.append(spec)
    data: dict[str, set[str]] = {}
    for name in names:
        if "/" in name and not name.endswith(".py") and ".dist-info/" not in name:
            package, _, rest = name.partition("/")
            folder = rest.rsplit("/", 1)[0] + "/*" if "/" in rest else "*"
            data.setdefault(package, set()).add(folder)
    return {
        "name": msg["Name"], "version": msg["Version"], "description": msg["Summary"],
        "license": msg["License"], "requires-python": msg["Requires-Python"],
        "dependencies": sorted(plain), "optional-dependencies": {
            k: sorted(v) for k, v in sorted(extras.items())},
        "entry-points": {group: dict(points[group]) for group in points.sections()},
        "package-data": {k: sorted(v) for k, v in sorted(data.items())},
    }


def _list(items: list[str], indent: str = "") -> str:
    if not items:
        return "[]"
    return "[\n" + "".join(f'{indent}  "{item}",\n' for item in items) + f"{indent}]"


def render(meta: dict) -> str:
    """The pyproject.toml text of a distribution (setuptools, sources under src/)."""
    lines = [HEADER, "[build-system]", 'requires = ["setuptools>=69"]',
             'build-backend = "setuptools.build_meta"', "", "[project]",
             f'name = "{meta["name"]}"', f'version = "{meta["version"]}"',
             f'description = "{meta["description"]}"',
             f'license = {{text = "{meta["license"]}"}}',
             f'requires-python = "{meta["requires-python"]}"',
             f"dependencies = {_list(meta['dependencies'])}"]
    if meta["optional-dependencies"]:
        lines += ["", "[project.optional-dependencies]"]
        lines += [f"{extra} = {_list(reqs)}" for extra, reqs in
                  meta["optional-dependencies"].items()]
    for group, points in meta["entry-points"].items():
        table = "project.scripts" if group == "console_scripts" else \
            f'project.entry-points."{group}"'
        lines += ["", f"[{table}]"] + [f'{k} = "{v}"' for k, v in points.items()]
    lines += ["", "[tool.setuptools.packages.find]", 'where = ["src"]']
    if meta["package-data"]:
        lines += ["", "[tool.setuptools.package-data]"]
        lines += [f"{package} = {_list(globs)}" for package, globs in
                  meta["package-data"].items()]
    return "\n".join(lines) + "\n"


def folder_of(name: str) -> Path:
    """packages/mt-data for mt-data, apps/pretrain for mt-pretrain."""
    for folder in (ROOT / "packages" / name, ROOT / "apps" / name.removeprefix("mt-")):
        if (folder / "src").is_dir():
            return folder
    raise SystemExit(f"no folder with src/ for distribution {name}")


def main(dist_dir: str) -> None:
    wheels = sorted(Path(dist_dir).glob("mt_*.whl"))
    if not wheels:
        raise SystemExit(f"no mt_*.whl in {dist_dir}: run ./pants package :: first")
    for wheel in wheels:
        meta = wheel_metadata(wheel)
        path = folder_of(meta["name"]) / "pyproject.toml"
        path.write_text(render(meta), encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dist")
