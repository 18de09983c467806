"""``DATA/groups.json``: the group-word counts of a prepared dataset, before and after its
filters (``mt data inspect DATA --groups``), so a user sees what the data carries into the
model, counted by the rules of :mod:`mt_data.groups` that mt's bias probes also use.

``prepare`` counts every document read (after Unicode normalisation, before every rule:
"before") and every document it keeps and tokenizes (after the quality rules, their edits,
decontamination and dedup: "after"), in its worker processes, and sums the chunks' counts with
:func:`~mt_data.groups.merge_counts`. The file is written atomically and ``index.json`` records
its SHA-256 (``stats.groups``); :func:`read_group_counts` checks it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mt_data.errors import DatasetError
from mt_data.groups import GroupWords
from mt_data.shards import INDEX_FILE, atomic_write_bytes, file_sha256

GROUPS_FILE = "groups.json"
FORMAT = "mt-data-group-counts"
VERSION = 1


def write_group_counts(output: Path, lists: GroupWords, before: dict[str, Any],
                       after: dict[str, Any]) -> dict[str, Any]:
    """Write ``OUTPUT/groups.json`` atomically; returns the record ``index.json`` keeps
    (``{"file", "sha256", "group_words": {"path", "sha256"}}``)."""
    source = {"path": lists.source, "sha256": file_sha256(Path(lists.source))}
    data = {"format": FORMAT, "version": VERSION, "group_words": source,
            "before": before, "after": after}
    raw = (json.dumps(data, indent=1) + "\n").encode()
    atomic_write_bytes(output / GROUPS_FILE, raw)
    return {"file": GROUPS_FILE, "sha256": hashlib.sha256(raw).hexdigest(),
            "group_words": source}


def read_group_counts(data: str | Path) -> dict[str, Any]:
    """``DATA/groups.json`` after checking it against the SHA-256 ``index.json`` records.

    Raises :class:`DatasetError` (one line naming the file) for a dataset without counts
    (prepared before they existed, or with ``--no-group-counts``), a missing or damaged file.
    """
    data = Path(data)
    index_path = data / INDEX_FILE
    try:
        stats = json.loads(index_path.read_text()).get("stats") or {}
    except (OSError, ValueError, AttributeError) as exc:
        raise DatasetError(f"{index_path}: unreadable ({exc}); not a prepared dataset?"
                           ) from None
    record = stats.get("groups")
    if not isinstance(record, dict):
        settings = (stats.get("fingerprint") or {}).get("settings") or {}
        if settings.get("group_counts") is False:
            raise DatasetError(f"{data} was prepared with --no-group-counts: it has no group "
                               "counts; prepare it again without that flag to count them")
        raise DatasetError(f"{data} has no {GROUPS_FILE}: it was prepared before mt-data "
                           "counted group words; prepare it again (mt data prepare ... "
                           "--overwrite) to count them")
    path = data / GROUPS_FILE
    if not path.exists():
        raise DatasetError(f"{path}: missing ({INDEX_FILE} records it); prepare the dataset "
                           "again")
    if file_sha256(path) != record.get("sha256"):
        raise DatasetError(f"{path}: damaged (its SHA-256 differs from the one {INDEX_FILE} "
                           "records); prepare the dataset again")
    counts = json.loads(path.read_text())
    if counts.get("format") != FORMAT or counts.get("version") != VERSION:
        raise DatasetError(f"{path}: not an {FORMAT} version {VERSION} file")
    return counts


def _change(before: int, after: int) -> str:
    if before == after:
        return "0"
    if before == 0:
        return f"{after - before:+,}"
    return f"{after - before:+,} ({(after - before) / before:+.1%})"


def group_rows(counts: dict[str, Any]) -> list[list[str]]:
    """Rows of the group table: dimension, group, mentions before / after / change,
    documents with the group before / after / change."""
    before, after = counts["before"], counts["after"]
    rows = [["(all)", "documents", "", "", "", f"{before['documents']:,}",
             f"{after['documents']:,}", _change(before["documents"], after["documents"])],
            ["(all)", "words", f"{before['words']:,}", f"{after['words']:,}",
             _change(before["words"], after["words"]), "", "", ""]]
    for dim, groups in before["mentions"].items():
        for group, mentions in groups.items():
            was, now = before["documents_with"][dim][group], after["documents_with"][dim][group]
            kept = after["mentions"][dim][group]
            rows.append([dim, group, f"{mentions:,}", f"{kept:,}", _change(mentions, kept),
                         f"{was:,}", f"{now:,}", _change(was, now)])
    return rows


def occupation_rows(counts: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """The occupation table: its header (mentions, then each gender group, before and after),
    rows of the occupations mentioned before or after (most mentioned first), and the
    occupations never mentioned."""
    before, after = counts["before"]["occupations"], counts["after"]["occupations"]
    genders = [k for k in next(iter(before.values()), {}) if k != "mentions"]
    header = ["occupation", "mentions before", "after"]
    for gender in genders:
        header += [f"{gender} before", "after"]
    mentioned = [o for o in before if before[o]["mentions"] or after[o]["mentions"]]
    mentioned.sort(key=lambda o: (-before[o]["mentions"], -after[o]["mentions"], o))
    rows = [[o] + [f"{side[o][key]:,}" for key in ("mentions", *genders)
                   for side in (before, after)] for o in mentioned]
    return header, rows, [o for o in before if o not in mentioned]
