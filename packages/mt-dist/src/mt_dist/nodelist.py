"""Pure parsers for SLURM's compressed host lists and per-node task counts."""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_nodelist", "expand_tasks_per_node", "first_host"]

_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` on commas that are not inside ``[...]``."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at position {i} in node list {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unmatched ']' at position {i} in node list {text!r}")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unclosed '[' in node list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(body: str, context: str) -> list[str]:
    """``"01-03,07"`` -> ``["01", "02", "03", "07"]`` (zero padding kept)."""
    out: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in node list {context!r}")
        if not sep:
            out.append(lo)
            continue
        first, last = int(lo), int(hi)
        if first > last:
            raise ValueError(f"range {part!r} runs backwards ({first} > {last}) in {context!r}")
        width = len(lo)  # "08-11" -> 08 09 10 11: pad to the lower bound's width
        out.extend(str(n).zfill(width) for n in range(first, last + 1))
    return out


def _expand_item(item: str, context: str) -> list[str]:
    """One host pattern, e.g. ``"rack[1-2]-n[01-02]"`` -> 4 host names."""
    pieces: list[list[str]] = []
    rest = item
    while "[" in rest:
        prefix, _, tail = rest.partition("[")
        body, _, rest = tail.partition("]")
        pieces.append([prefix])
        pieces.append(_expand_ranges(body, context))
    pieces.append([rest])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu5"`` -> ``[node01, ..., node07, gpu5]``.

    Raises ValueError for malformed lists (unbalanced brackets, bad or backwards ranges).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item, nodelist))
    if not hosts:
        raise ValueError(f"node list {nodelist!r} names no host")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (where rank 0 of an srun step runs)."""
    items = _split_top_level(nodelist)
    if not items:
        raise ValueError(f"node list {nodelist!r} names no host")
    return _expand_item(items[0], nodelist)[0]  # expand only the first item: lists can be long


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE: ``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (one entry per node)."""
    counts: list[int] = []
    for item in spec.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise ValueError(f"bad item {item!r} in tasks-per-node list {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
