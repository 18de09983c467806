"""Pure parsers for SLURM's compressed host lists and per-node task counts."""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_nodelist", "expand_tasks_per_node", "first_host"]

_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
#: The most hosts (or nodes) a list may expand to: a job's ranks are at most 2**20 (mt-plan's
#: world-size limit), each node runs at least one. A longer list is malformed, and expanding
#: it (``n[1-99999999999999999999]``) would never end.
MAX_HOSTS = 1 << 20


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


def _ranges(body: str, context: str) -> list[tuple[str, int]]:
    """``"01-03,07"`` -> ``[("01", 3), ("07", 1)]``: each range's first name and length,
    checked (digits, not backwards, at most :data:`MAX_HOSTS` names) without expanding."""
    out: list[tuple[str, int]] = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not (lo.isascii() and lo.isdigit()) or (sep and not (hi.isascii() and hi.isdigit())):
            raise ValueError(f"bad range {part!r} in node list {context!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first > last:
            raise ValueError(f"range {part!r} runs backwards ({first} > {last}) in {context!r}")
        out.append((lo, last - first + 1))
    if sum(count for _, count in out) > MAX_HOSTS:
        raise ValueError(f"[{body}] names more than {MAX_HOSTS:,} hosts in node list {context!r}")
    return out


def _pieces(item: str, context: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """``"rack[1-2]-n[01-02]"`` -> ``[("rack", ranges), ("-n", ranges)]`` and a last
    ``(rest, [])``; the number of hosts it names is checked against :data:`MAX_HOSTS`."""
    pieces, rest, total = [], item, 1
    while "[" in rest:
        prefix, _, tail = rest.partition("[")
        body, _, rest = tail.partition("]")
        ranges = _ranges(body, context)
        total *= sum(count for _, count in ranges)
        if total > MAX_HOSTS:
            raise ValueError(f"{item!r} names more than {MAX_HOSTS:,} hosts in node list "
                             f"{context!r}")
        pieces.append((prefix, ranges))
    pieces.append((rest, []))
    return pieces


def _expand_item(item: str, context: str) -> list[str]:
    """One host pattern, e.g. ``"rack[1-2]-n[01-02]"`` -> 4 host names."""
    pieces: list[list[str]] = []
    for prefix, ranges in _pieces(item, context):
        pieces.append([prefix])
        if ranges:
            pieces.append([str(n).zfill(len(lo)) for lo, count in ranges
                           for n in range(int(lo), int(lo) + count)])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu5"`` -> ``[node01, ..., node07, gpu5]``.

    Raises ValueError for malformed lists (unbalanced brackets, bad or backwards ranges).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item, nodelist))
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"node list {nodelist!r} names more than {MAX_HOSTS:,} hosts")
    if not hosts:
        raise ValueError(f"node list {nodelist!r} names no host")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (where rank 0 of an srun step runs)."""
    items = _split_top_level(nodelist)
    if not items:
        raise ValueError(f"node list {nodelist!r} names no host")
    # Checked like expand_nodelist, but only the first name of each range is built: lists
    # can be long.
    return "".join(prefix + (ranges[0][0] if ranges else "")
                   for prefix, ranges in _pieces(items[0], nodelist))


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE: ``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (one entry per node)."""
    counts: list[int] = []
    for item in spec.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None or not item.isascii():
            raise ValueError(f"bad item {item!r} in tasks-per-node list {spec!r}")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise ValueError(f"tasks-per-node list {spec!r} names more than {MAX_HOSTS:,} nodes")
        counts.extend([int(match.group(1))] * repeat)
    return counts
