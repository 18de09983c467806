"""The generation probes of the bias suite: prompts (``probes.yaml``), each sampled N times
with a seed of its own (the same seed gives the same samples at any layout and batching)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mt_data.groups import GroupWords
from mt_data.text import not_utf8
from mt_eval.errors import TaskError, unique_keys_loader, yaml_problem

__all__ = ["PROBES", "Probe", "Probes", "load_probes", "sample_seed"]

#: The probes mt ships.
PROBES = Path(__file__).parent / "probes.yaml"


@dataclass(frozen=True)
class Probe:
    """One prompt of a probe: the occupation probe's (``group`` an occupation, ``dimension``
    None) or a group's (``dimension`` gender, race...)."""

    kind: str
    """"occupation" or "group"."""
    dimension: str | None
    group: str
    template: str
    prompt: str


@dataclass(frozen=True)
class Probes:
    """Every prompt of a probe file, in the file's order."""

    prompts: tuple[Probe, ...]
    source: str

    def occupation(self) -> list[Probe]:
        return [p for p in self.prompts if p.kind == "occupation"]

    def groups(self) -> list[Probe]:
        return [p for p in self.prompts if p.kind == "group"]


def sample_seed(seed: int, prompt: str, index: int) -> int:
    """The sampling seed of sample ``index`` of ``prompt``: a function of the three only, so
    that adding prompts or reordering them changes no other sample."""
    digest = hashlib.sha256(f"{seed}\0{prompt}\0{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _fail(path: Path, what: str) -> TaskError:
    return TaskError(f"{path}: {what}")


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, str) and v.strip() for v in value)


def load_probes(lists: GroupWords, path: str | Path | None = None) -> Probes:
    """The probes of ``path`` (default: mt's), checked against the group-word ``lists``: a
    TaskError names the file and the entry at fault."""
    path = Path(path) if path is not None else PROBES
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=unique_keys_loader())
    except (OSError, UnicodeDecodeError) as err:
        raise _fail(path, f"not a readable probes YAML file: {err}") from None
    except yaml.YAMLError as err:
        raise _fail(path, f"not a readable probes YAML file: {yaml_problem(err)}") from None
    except RecursionError:
        raise _fail(path, "not a readable probes YAML file: nested too deeply") from None
    unknown = sorted(set(raw) - {"occupation", "groups"}) if isinstance(raw, dict) else []
    if unknown:
        raise _fail(path, f"unknown key {unknown[0]!r} (occupation, groups)")
    if not isinstance(raw, dict) or not ({"occupation", "groups"} & set(raw)):
        raise _fail(path, "needs an 'occupation' probe, a 'groups' probe, or both")
    prompts: list[Probe] = []
    occupation = raw.get("occupation")
    if occupation is not None:
        if not isinstance(occupation, dict) or not _strings(occupation.get("templates")):
            raise _fail(path, "occupation.templates must be a list of prompts")
        extra = sorted(set(occupation) - {"templates", "occupations"}, key=str)
        if extra:
            raise _fail(path, f"occupation: unknown key {extra[0]!r} (templates, occupations)")
        names = occupation.get("occupations", list(lists.occupations))
        if not _strings(names):
            raise _fail(path, "occupation.occupations must be a list of occupations (or left "
                        f"out: those of {lists.source})")
        if not {"female", "male"} <= set(lists.dimensions.get("gender", {})):
            raise _fail(path, f"the occupation probe counts gendered words; {lists.source} "
                        "has no 'gender' dimension with groups 'female' and 'male'")
        for template in occupation["templates"]:
            if "{occupation}" not in template:
                raise _fail(path, f"occupation template {template!r} lacks {{occupation}}")
            prompts += [Probe("occupation", None, name, template,
                              template.replace("{occupation}", name)) for name in names]
    groups = raw.get("groups")
    if groups is not None:
        if not isinstance(groups, dict) or not groups:
            raise _fail(path, "groups must map dimensions to {group: [prompts]}")
        for dimension, by_group in groups.items():
            known = lists.dimensions.get(dimension)
            if known is None:
                raise _fail(path, f"groups.{dimension}: not a dimension of {lists.source} "
                            f"({', '.join(lists.dimensions)})")
            if not isinstance(by_group, dict) or len(by_group) < 2:
                raise _fail(path, f"groups.{dimension} needs two groups or more")
            for group, texts in by_group.items():
                if group not in known:
                    raise _fail(path, f"groups.{dimension}.{group}: not a group of "
                                f"{dimension} in {lists.source} ({', '.join(known)})")
                if not _strings(texts):
                    raise _fail(path, f"groups.{dimension}.{group} must be a list of prompts")
                prompts += [Probe("group", dimension, group, text, text) for text in texts]
    seen: set[str] = set()
    for probe in prompts:
        if why := not_utf8(probe.prompt):  # a YAML escape ("\\ud800") or the lists' JSON
            raise _fail(path, f"prompt {probe.prompt!r} holds {why}: give UTF-8 text")
        if probe.prompt in seen:  # two prompts, one seed sequence: the same samples twice
            raise _fail(path, f"prompt {probe.prompt!r} appears twice")
        seen.add(probe.prompt)
    return Probes(tuple(prompts), str(path))
