"""Group-word counts: the rules of ``mt_data.groups`` and the data-side view, ``prepare``
counting every document before and after the filters (``groups.json``, checksummed) and
``mt data inspect --groups`` showing it. Counts are checked against a counter written here,
from the rules as documented (sentences, words, lookups: no code of mt_data.groups)."""

from __future__ import annotations

import json
import random
import re
import shutil
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mt_data.cli import app
from mt_data.corpus import corpus_texts, iter_corpus
from mt_data.errors import DatasetError
from mt_data.group_counts import GROUPS_FILE, read_group_counts
from mt_data.groups import (
    GROUP_WORDS,
    GroupCounter,
    first_group,
    load_group_words,
    merge_counts,
    words,
)
from mt_data.ingest import IngestConfig
from mt_data.pipeline import PrepareConfig, PrepareError, prepare
from mt_data.shards import TokenDataset, file_sha256
from mt_data.stages import CleanConfig

runner = CliRunner()
WIDE = {"COLUMNS": "250"}

# ---------------------------------------------------------------- an independent counter

_TEST_WORD = re.compile(r"[a-z]+(?:['-][a-z]+)*")


def count_independently(texts: list[str], lists: dict[str, Any]) -> dict[str, Any]:
    """The counts of ``texts`` by the documented rules, sentence by sentence."""
    dims = lists["dimensions"]
    by_word = {dim: {w: g for g, ws in groups.items() for w in ws} for dim, groups in dims.items()}
    occupation_of = {}
    for occupation in lists["occupations"]:
        occupation_of[occupation] = occupation_of[occupation + "s"] = occupation
    genders = list(dims.get("gender", {}))
    out: dict[str, Any] = {
        "documents": 0, "words": 0,
        "mentions": {d: dict.fromkeys(g, 0) for d, g in dims.items()},
        "documents_with": {d: dict.fromkeys(g, 0) for d, g in dims.items()},
        "occupations": {o: {"mentions": 0, **dict.fromkeys(genders, 0)}
                        for o in lists["occupations"]},
    }
    for text in texts:
        out["documents"] += 1
        named = set()
        for sentence in re.split(r"[.!?]", text):
            tokens = _TEST_WORD.findall(sentence.lower().replace("\u2019", "'"))
            out["words"] += len(tokens)
            for i, token in enumerate(tokens):
                for dim in dims:
                    if token in by_word[dim]:
                        out["mentions"][dim][by_word[dim][token]] += 1
                        named.add((dim, by_word[dim][token]))
                if token in occupation_of:
                    row = out["occupations"][occupation_of[token]]
                    row["mentions"] += 1
                    later = [by_word["gender"][t] for t in tokens[i + 1:] if t in by_word["gender"]]
                    if later:
                        row[later[0]] += 1
        for dim, group in named:
            out["documents_with"][dim][group] += 1
    return out


SHIPPED = json.loads(GROUP_WORDS.read_text())


def counted(texts: list[str], path: Path | None = None) -> dict[str, Any]:
    counter = GroupCounter(load_group_words(path))
    for text in texts:
        counter.add(text)
    return counter.counts


# ------------------------------------------------------------------------ the rules


def test_words_are_lowercase_letters_joined_by_inner_apostrophes_and_hyphens() -> None:
    assert words("She’s a co-worker's NURSE -- x- -y rock-'n'-roll 3rd e-mail.") == [
        "she's", "a", "co-worker's", "nurse", "x", "y", "rock", "n", "roll", "rd", "e-mail"]
    assert words("Café naïve") == ["caf", "na", "ve"]  # letters are a-z only


def test_first_group_is_the_first_word_naming_one() -> None:
    lookup = {"she": "female", "he": "male"}
    assert first_group(["the", "nurse", "he", "she"], lookup) == "male"
    assert first_group(["the", "nurse"], lookup) is None


def test_occupations_match_their_word_and_plural_with_s() -> None:
    counts = counted(["The nurses and a nurse. Two nursess, a Nurse, secretaries."])
    assert counts["occupations"]["nurse"]["mentions"] == 3
    assert counts["occupations"]["secretary"]["mentions"] == 0  # "ies" plurals are not listed


def test_association_is_the_first_gendered_word_after_it_in_its_sentence() -> None:
    counts = counted(["She met the doctor. The nurse said that he and she left!",
                      "The engineer? Her bag. The chef and the baker thanked him, then her."])
    occupations = counts["occupations"]
    assert occupations["doctor"] == {"mentions": 1, "female": 0, "male": 0}  # "She" is before
    assert occupations["nurse"] == {"mentions": 1, "female": 0, "male": 1}
    assert occupations["engineer"] == {"mentions": 1, "female": 0, "male": 0}  # "?" ends it
    assert occupations["chef"] == occupations["baker"] == {"mentions": 1, "female": 0, "male": 1}
    assert counts["mentions"]["gender"] == {"female": 4, "male": 2}
    assert counts["documents_with"]["gender"] == {"female": 2, "male": 2}


def test_counter_equals_the_documented_rules_on_real_and_random_text() -> None:
    texts = corpus_texts()
    assert counted(texts) == count_independently(texts, SHIPPED)
    rng = random.Random(7)
    pieces = ([w for groups in SHIPPED["dimensions"].values() for ws in groups.values()
               for w in ws] + SHIPPED["occupations"]
              + ["Mr.", "NURSES", "doctors!", "he-she", "don't", "\u2019", "x-", "-y", "'",
                 "\u0130", "\u03a3", "é", "\n", "...", "?", "middle-eastern", "officer's",
                 "\ud800", "the", "a"])
    seps = [" ", "", ".", "-", "'", "é", "!", "\u2019"]
    for _ in range(1500):
        text = "".join(rng.choice(pieces) + rng.choice(seps) for _ in range(rng.randrange(40)))
        assert counted([text]) == count_independently([text], SHIPPED), repr(text)


def test_merge_counts_adds_counts_of_the_same_lists() -> None:
    texts = corpus_texts(("sotu",))
    merged = merge_counts([counted(texts[:10]), counted(texts[10:20]), counted(texts[20:])])
    assert merged == counted(texts)
    with pytest.raises(ValueError, match="one count or more"):
        merge_counts([])


@pytest.mark.parametrize(("content", "message"), [
    (None, "not a readable group-words JSON file"),
    ("{oops", "not a readable group-words JSON file"),
    ("[1, 2]", 'needs "dimensions"'),
    ('{"dimensions": {"gender": {"female": ["she"]}}}', "'gender' needs two groups"),
    ('{"dimensions": {"gender": {"female": ["She"], "male": ["he"]}}}',
     "gender.female must be a list of lowercase words"),
    ('{"dimensions": {"gender": {"female": ["she"], "male": ["she"]}}}',
     "'she' names two groups of gender: female and male"),
    ('{"dimensions": {"race": {"a": ["x"], "b": ["y"]}}, "occupations": ["nurse"]}',
     "lacks"),
    ('{"dimensions": {"gender": {"female": ["she"], "male": ["he"]}}, "occupations": ["A"]}',
     "occupations must be lowercase words, got 'A'"),
    ('{"dimensions": {"gender": {"mentions": ["she"], "male": ["he"]}}}',
     "'mentions' cannot name a gender group"),
])
def test_load_group_words_errors_name_the_file(tmp_path: Path, content: str | None,
                                               message: str) -> None:
    path = tmp_path / "words.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_group_words(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


# ------------------------------------------------------------------ the data side

SHORT = "She is a nurse. The nurses said he was a Muslim doctor."  # too_short (< 100 chars)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SOTU addresses and Moby-Dick chapters, a short document and an exact duplicate (both
    mention groups and are dropped: too_short, exact dedup)."""
    root = tmp_path_factory.mktemp("groups-raw")
    docs = list(iter_corpus())
    chosen = [{"id": d["id"], "text": d["text"]} for d in docs[135:147] + docs[:6]]
    chosen.insert(3, {"id": "short", "text": SHORT})
    chosen.insert(9, {"id": "dup", "text": chosen[1]["text"]})
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in chosen))
    return {"path": path, "docs": chosen}


def _config(**kw: Any) -> PrepareConfig:
    return PrepareConfig(CleanConfig(ingest=IngestConfig(batch_docs=4)), "tokenizer-1k", **kw)


@pytest.fixture(scope="module")
def prepared(raw: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("groups") / "data"
    summary = prepare([raw["path"]], out, _config(workers=2))
    assert summary["dropped"]["too_short"] == 1 and summary["exact_duplicates"] == 1
    return out


def _expected(raw: dict[str, Any], data: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    ds = TokenDataset(data)
    kept = {ds.metadata(i)[0] for i in range(len(ds))}
    assert "short" not in kept and "dup" not in kept
    texts = [unicodedata.normalize("NFC", d["text"]) for d in raw["docs"]]
    after = [t for d, t in zip(raw["docs"], texts, strict=True) if d["id"] in kept]
    return count_independently(texts, SHIPPED), count_independently(after, SHIPPED)


def test_prepare_stores_counts_before_and_after_the_filters(raw: dict[str, Any],
                                                            prepared: Path) -> None:
    before, after = _expected(raw, prepared)
    stored = read_group_counts(prepared)
    assert stored["before"] == before and stored["after"] == after
    assert before != after
    dropped = count_independently([SHORT, raw["docs"][1]["text"]], SHIPPED)
    assert before["documents"] - after["documents"] == dropped["documents"] == 2
    assert before["mentions"]["religion"]["Islam"] - after["mentions"]["religion"]["Islam"] \
        == dropped["mentions"]["religion"]["Islam"] >= 1
    assert before["occupations"]["nurse"]["mentions"] - after["occupations"]["nurse"][
        "mentions"] >= 2
    assert stored["group_words"] == {"path": str(GROUP_WORDS),
                                     "sha256": file_sha256(GROUP_WORDS)}
    index = json.loads((prepared / "index.json").read_text())
    assert index["stats"]["groups"]["sha256"] == file_sha256(prepared / GROUPS_FILE)


def _cells(output: str, first: str, second: str) -> list[str]:
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells[:2] == [first, second]:
            return cells[2:]
    raise AssertionError(f"no row {first} {second} in:\n{output}")


def _change(was: int, now: int) -> str:
    return "0" if was == now else f"{now - was:+,}" + (f" ({(now - was) / was:+.1%})"
                                                       if was else "")


def test_inspect_groups_shows_the_counts(raw: dict[str, Any], prepared: Path) -> None:
    before, after = _expected(raw, prepared)
    result = runner.invoke(app, ["inspect", str(prepared), "--groups"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert str(GROUP_WORDS) in result.output
    for dim, groups in before["mentions"].items():
        for group, mentions in groups.items():
            was, now = before["documents_with"][dim][group], after["documents_with"][dim][group]
            kept = after["mentions"][dim][group]
            assert _cells(result.output, dim, group) == [
                f"{mentions:,}", f"{kept:,}", _change(mentions, kept), f"{was:,}", f"{now:,}",
                _change(was, now)]
    assert _cells(result.output, "(all)", "documents")[3:5] == [
        f"{before['documents']:,}", f"{after['documents']:,}"]
    shown = 0
    for occupation, row in before["occupations"].items():
        now = after["occupations"][occupation]
        if row["mentions"]:
            cells = _cells(result.output, occupation, f"{row['mentions']:,}")
            assert cells == [f"{now['mentions']:,}", f"{row['female']:,}",
                             f"{now['female']:,}", f"{row['male']:,}", f"{now['male']:,}"]
            shown += 1
        else:
            assert occupation in result.output.split("never mentioned")[1]
    assert shown >= 3


def _error_line(result: Any) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_a_damaged_counts_file_is_one_line_naming_it(prepared: Path, tmp_path: Path) -> None:
    data = tmp_path / "copy"
    shutil.copytree(prepared, data)
    path = data / GROUPS_FILE
    path.write_text(path.read_text().replace('"documents": ', '"documents": 1', 1))
    with pytest.raises(DatasetError, match="damaged"):
        read_group_counts(data)
    for args in (["--groups"], ["--verify"]):
        line = _error_line(runner.invoke(app, ["inspect", str(data), *args], env=WIDE))
        assert line == (f"error: {path}: damaged (its SHA-256 differs from the one index.json "
                        "records); prepare the dataset again")
    path.unlink()
    line = _error_line(runner.invoke(app, ["inspect", str(data), "--groups"], env=WIDE))
    assert line.startswith(f"error: {path}: missing")


def test_a_dataset_without_counts_says_how_to_get_them(prepared: Path, tmp_path: Path,
                                                       raw: dict[str, Any]) -> None:
    old = tmp_path / "old"  # what an mt-data before the counts wrote: no record, no file
    shutil.copytree(prepared, old)
    index = json.loads((old / "index.json").read_text())
    del index["stats"]["groups"]
    (old / "index.json").write_text(json.dumps(index))
    (old / GROUPS_FILE).unlink()
    line = _error_line(runner.invoke(app, ["inspect", str(old), "--groups"], env=WIDE))
    assert line == (f"error: {old} has no groups.json: it was prepared before mt-data counted "
                    "group words; prepare it again (mt data prepare ... --overwrite) to count "
                    "them")
    assert runner.invoke(app, ["inspect", str(old), "--verify"], env=WIDE).exit_code == 0
    off = tmp_path / "off"
    summary = prepare([raw["path"]], off, _config(workers=1, group_counts=False))
    assert "groups" not in summary and not (off / GROUPS_FILE).exists()
    line = _error_line(runner.invoke(app, ["inspect", str(off), "--groups"], env=WIDE))
    assert "prepared with --no-group-counts" in line


def test_group_words_file_is_used_recorded_and_checked(raw: dict[str, Any],
                                                       tmp_path: Path) -> None:
    mine = {"dimensions": {"gender": {"female": ["she", "her"], "male": ["he", "him", "his"]},
                           "sea": {"whale": ["whale", "whales"], "ship": ["ship", "ships"]}},
            "occupations": ["nurse", "harpooneer"]}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine))
    out = tmp_path / "data"
    result = runner.invoke(app, ["prepare", str(raw["path"]), "-o", str(out), "--tokenizer",
                                 "tokenizer-1k", "--workers", "1", "--group-words", str(path)],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    assert "groups.json (inspect --groups)" in result.output
    stored = read_group_counts(out)
    assert stored["group_words"] == {"path": str(path), "sha256": file_sha256(path)}
    texts = [unicodedata.normalize("NFC", d["text"]) for d in raw["docs"]]
    assert stored["before"] == count_independently(texts, mine)
    assert stored["before"]["mentions"]["sea"]["whale"] > 0
    result = runner.invoke(app, ["inspect", str(out), "--groups"], env=WIDE)
    assert result.exit_code == 0 and _cells(result.output, "sea", "whale")[0] == \
        f"{stored['before']['mentions']['sea']['whale']:,}"
    # A bad list is refused before anything is written, naming the file.
    bad = tmp_path / "bad.json"
    bad.write_text('{"dimensions": {"gender": {"female": ["she"], "male": ["she"]}}}')
    result = runner.invoke(app, ["prepare", str(raw["path"]), "-o", str(tmp_path / "no"),
                                 "--tokenizer", "tokenizer-1k", "--group-words", str(bad)],
                           env=WIDE)
    assert _error_line(result) == (f"error: {bad}: 'she' names two groups of gender: female "
                                   "and male")
    assert not (tmp_path / "no").exists()
    result = runner.invoke(app, ["prepare", str(raw["path"]), "-o", str(tmp_path / "no"),
                                 "--group-words", str(tmp_path / "missing.json")], env=WIDE)
    assert _error_line(result).startswith(f"error: {tmp_path / 'missing.json'}: not a readable")
    result = runner.invoke(app, ["prepare", str(raw["path"]), "-o", str(tmp_path / "no"),
                                 "--group-words", str(path), "--no-group-counts"], env=WIDE)
    assert "contradict" in _error_line(result)
    # --overwrite never deletes the list: an output holding it is refused.
    result = runner.invoke(app, ["prepare", str(raw["path"]), "-o", str(tmp_path),
                                 "--group-words", str(path), "--overwrite"], env=WIDE)
    assert _error_line(result) and path.exists()


class Interrupt(Exception):
    pass


class StopInTokenize:
    """A progress hook that 'kills' the run after four tokenized chunks (of five: the
    duplicate's chunk is among them, so its kept documents are counted again on resuming)."""

    def __init__(self) -> None:
        self.current, self.seen = "", 0

    def stage(self, name: str, total: float | None, unit: str) -> None:
        self.current = name

    def advance(self, amount: float) -> None:
        if self.current.startswith("tokenize"):
            self.seen += 1
            if self.seen >= 4:
                raise Interrupt

    def end(self) -> None:
        pass


def test_resumed_run_counts_the_same(raw: dict[str, Any], prepared: Path,
                                     tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    with pytest.raises(Interrupt):
        prepare([raw["path"]], out, _config(workers=1), StopInTokenize())
    assert len((out / "progress.jsonl").read_text().splitlines()) == 4  # before the stop
    prepare([raw["path"]], out, _config(workers=1))
    resumed, reference = read_group_counts(out), read_group_counts(prepared)
    assert resumed["before"] == reference["before"] and resumed["after"] == reference["after"]
    # Other lists on an unfinished run are another run.
    with pytest.raises(Interrupt):
        prepare([raw["path"]], tmp_path / "again", _config(workers=1), StopInTokenize())
    mine = tmp_path / "mine.json"
    mine.write_text(GROUP_WORDS.read_text())
    with pytest.raises(PrepareError, match="unfinished run"):
        prepare([raw["path"]], tmp_path / "again", _config(workers=1, group_words=str(mine)))
