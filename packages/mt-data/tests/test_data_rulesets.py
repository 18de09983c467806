"""The quality rule sets agree with Hugging Face datatrove 0.10.1 (the oracle, tests only).

Per-document keep/drop decisions (and the rule at fault) of ``gopher-quality``,
``gopher-repetition``, ``c4`` and ``fineweb`` are compared with datatrove's
``GopherQualityFilter``, ``GopherRepetitionFilter``, ``C4QualityFilter`` and
``FineWebQualityFilter`` (default settings) on (a) the embedded corpus and (b) a mixed corpus of
prose, code, markup, lists and planted defects built here from local material, on which every
rule fires. C4's edited text must equal datatrove's. The English word splitter must equal
spaCy's blank English tokenizer (datatrove's word tokenizer) token for token.
"""

from __future__ import annotations

import gzip
import json
import random
import sysconfig
import time
from collections import Counter
from importlib import resources
from pathlib import Path

import pyarrow as pa
import pytest

# datatrove and spaCy are pinned test dependencies (infra/python/constraints.txt): imported,
# never skipped.
import spacy  # noqa: E402
from datatrove.data import Document  # noqa: E402
from datatrove.pipeline.filters import (  # noqa: E402
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)

from mt_data.corpus import iter_corpus
from mt_data.quality import (
    C4Quality,
    FineWebQuality,
    GopherQuality,
    GopherRepetition,
    RuleSet,
    apply_rule_sets,
    english,
    parse_rule_sets,
)
from mt_data.quality.words import ASSET, export_spacy_english

MIN_AGREEMENT = 0.995

# datatrove's drop reason -> our rule name, per rule set.
REASONS = {
    "gopher-quality": {
        "gopher_short_doc": "too_few_words", "gopher_long_doc": "too_many_words",
        "gopher_below_avg_threshold": "short_words", "gopher_above_avg_threshold": "long_words",
        "gopher_too_many_hashes": "hashes", "gopher_too_many_ellipsis": "ellipses",
        "gopher_too_many_bullets": "bullet_lines", "gopher_too_many_end_ellipsis":
        "ellipsis_lines", "gopher_below_alpha_threshold": "non_alpha_words",
        "gopher_enough_stop_words": "stop_words",
    },
    "gopher-repetition": {
        "empty": "empty", "dup_para_frac": "dup_paragraphs",
        "dup_para_char_frac": "dup_paragraph_chars", "dup_line_frac": "dup_lines",
        "dup_line_char_frac": "dup_line_chars",
        **{f"top_{n}_gram": f"top_{n}_gram" for n in (2, 3, 4)},
        **{f"duplicated_{n}_n_grams": f"dup_{n}_grams" for n in range(5, 11)},
    },
    "c4": {r: r for r in ("lorem_ipsum", "curly_bracket", "too_few_sentences")},
    "fineweb": {r: r for r in ("empty", "line_punct_ratio", "short_line_ratio",
                               "char_dup_ratio", "list_ratio")},
}
ORACLES = {"gopher-quality": GopherQualityFilter, "gopher-repetition": GopherRepetitionFilter,
           "c4": C4QualityFilter, "fineweb": FineWebQualityFilter}
OURS: dict[str, RuleSet] = {"gopher-quality": GopherQuality(),
                            "gopher-repetition": GopherRepetition(), "c4": C4Quality(),
                            "fineweb": FineWebQuality()}


# ---------------------------------------------------------------- corpora


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return [d["text"] for d in iter_corpus()]


def _paragraph_docs(texts: list[str], rng: random.Random) -> list[str]:
    """Page-sized pieces of the real texts: 1-6 paragraphs (or sentences of the one-paragraph
    addresses), so short pieces fall under the word minimums."""
    docs = []
    for text in texts:
        parts = text.split("\n\n") if "\n\n" in text else text.split(". ")
        i = 0
        while i < len(parts) and len(docs) < 10_000:
            k = rng.choice((1, 1, 2, 3, 6))
            sep = "\n\n" if "\n\n" in text else ". "
            docs.append(sep.join(parts[i:i + k]))
            i += k + rng.randrange(6)
    rng.shuffle(docs)
    return docs[:260]


def _python_sources() -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    docs = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        docs.append(text[:8000].rsplit("\n", 1)[0])
    return docs


def _markup(paragraphs: list[str], rng: random.Random) -> list[str]:
    docs = []
    for i, para in enumerate(paragraphs[:40]):
        sentences = [s.strip() + "." for s in para.split(". ") if s.strip()]
        nav = "\n".join(f'<li><a href="/p/{j}">Page {j}</a></li>' for j in range(rng.randrange(8)))
        body = "\n".join(f"<p>{s}</p>" for s in sentences)
        footer = rng.choice(["This site uses cookies to improve your experience.",
                             "Read our Privacy Policy and Terms of Use before you continue.",
                             "Please enable JavaScript in your browser to see this page.",
                             "© 2024 Example Inc. All rights reserved"])
        docs.append(f"<html>\n<body>\n<ul>\n{nav}\n</ul>\n{body}\n<footer>{footer}</footer>\n"
                    f"</body>\n</html>")
        md = "\n\n".join(f"{'#' * (1 + j % 3)} Section {j}\n\n{s}" for j, s in
                         enumerate(sentences))
        docs.append(md + ("\n\n```python\ndef f(x):\n    return {x: 1}\n```" if i % 3 == 0
                          else ""))
        # text with the C4 line rules at work: citations, javascript and policy lines, no-punct
        lines = [s + rng.choice(["", "[1]", "[edit]", " [citation needed]"]) for s in sentences]
        lines.insert(rng.randrange(len(lines) + 1), "You need JavaScript enabled to view this.")
        lines.insert(rng.randrange(len(lines) + 1), "We use cookies. See the cookie policy.")
        lines.insert(rng.randrange(len(lines) + 1), "Menu Home About Contact")
        lines.insert(0, "x" * 1200 + " long token line.")
        docs.append("\n".join(lines))
    return docs


def _lists(paragraphs: list[str], rng: random.Random) -> list[str]:
    docs = []
    words = " ".join(paragraphs).split()
    for i in range(30):
        n = rng.randrange(8, 40)
        items = [" ".join(words[j:j + rng.randrange(3, 14)])
                 for j in rng.sample(range(len(words) - 20), n)]
        bullet = rng.choice(["- ", "• ", "  - ", "* ", "1. "])
        head = [] if i % 2 else ["Things to know about the voyage and the whale:"]
        docs.append("\n".join(head + [bullet + item for item in items]))
        # lines ending in an ellipsis, long enough that "..." stays under 0.1 per word
        ell = [" ".join(words[j:j + rng.randrange(6, 16)]) + rng.choice(["...", "…", "."])
               for j in rng.sample(range(len(words) - 20), n)]
        docs.append("\n".join(ell))
        # short lines (a poem), blank-line spacing (many newlines per word), hashtags
        docs.append("\n".join(" ".join(words[j:j + rng.randrange(1, 5)])
                              for j in rng.sample(range(len(words) - 20), n)))
        docs.append("\n\n\n\n".join(" ".join(words[j:j + rng.randrange(6, 12)]) + "."
                                    for j in rng.sample(range(len(words) - 20), n)))
        docs.append(" ".join(f"#{w.strip('.,;')}" if rng.random() < 0.3 else w
                             for w in words[i * 97:i * 97 + 200]))
    return docs


def _defects(paragraphs: list[str], rng: random.Random) -> list[str]:
    docs = []
    prose = [p for p in paragraphs if len(p.split()) > 120]
    words = " ".join(prose).split()
    lorem = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
             "incididunt ut labore et dolore magna aliqua.")
    for i in range(12):
        base = prose[i]
        docs.append(base + "\n" + lorem + "\n" + prose[i + 20])
        docs.append(base.replace(". ", ". {ref} ", 1))
        # numbers and tables: few alphabetic words
        docs.append("\n".join(" | ".join(str(rng.randrange(10 ** rng.randrange(1, 6)))
                                         for _ in range(8)) for _ in range(30)) + "\n" + base[:300])
        # short words (mean < 3) and long words (mean > 10)
        docs.append(" ".join(rng.choice(["a", "I", "to", "of", "an", "be", "is", "it", "the",
                                         "and", "go", "we", "up"]) for _ in range(300)) + ".")
        docs.append(" ".join(w + "".join(rng.choice(words)[:6] for _ in range(2))
                             for w in words[i * 50:i * 50 + 150]) + " the and of.")
        # no stop words in lower case
        docs.append(" ".join(w.capitalize() for w in words[i * 300:i * 300 + 200]))
        # ellipses inside lines
        docs.append(" ".join(w + ("..." if rng.random() < 0.15 else "")
                             for w in words[i * 80:i * 80 + 200]))
    # repetition: repeated paragraphs, lines, phrases and passages at many densities
    for i in range(60):
        unit = prose[i % len(prose)]
        other = prose[(i + 7) % len(prose)]
        ws = other.split()
        k = max(1, int(len(ws) * (0.04 + 0.005 * i)))  # up to a third of the document
        start = random.Random(i).randrange(max(1, len(ws) - k))
        passage = " ".join(ws[start:start + k])
        docs.append(other + "\n\n" + unit + " " + passage)  # one repeated passage
        if i % 3 == 0:
            phrase = rng.choice(["of the", "in a great", "the white whale swam",
                                 "ok go", "x yy zzzzzzzzzzzzz", "a bb ccccccccccccccccc dd"])
            filler = unit.split()
            reps = 3 + i
            for _ in range(reps):
                filler.insert(rng.randrange(len(filler)), phrase)
            docs.append(" ".join(filler))
        if i % 4 == 0:
            paras = unit.split(". ")
            docs.append("\n\n".join(paras + paras[: 1 + i // 8]))
            docs.append("\n".join(paras + [paras[0]] * (1 + i // 10)))
    # a very long document (more than 100,000 words), and empty / blank ones
    docs.append("\n\n".join(paragraphs * (110_000 // max(1, len(" ".join(paragraphs).split()))
                                          + 1)))
    docs += ["", " ", "\n\n  \n", "Hi.", "\r\n".join(prose[:3]), "\u2028".join(prose[3:6])]
    return docs


@pytest.fixture(scope="module")
def mixed(corpus: list[str]) -> list[str]:
    rng = random.Random(19)
    paragraphs = [p for t in corpus for p in t.split("\n\n") if len(p) > 200]
    rng.shuffle(paragraphs)
    docs = (_paragraph_docs(corpus, rng) + _python_sources() + _markup(paragraphs, rng)
            + _lists(paragraphs, rng) + _defects(paragraphs, rng))
    assert len(docs) >= 700
    return docs


# ---------------------------------------------------------------- comparison


def _oracle(texts: list[str]) -> dict[str, list[tuple[str | None, str]]]:
    """datatrove's (reason or None when kept, text after the filter) per document and filter.

    The filters run one document at a time, so datatrove's cache of the last texts' words
    serves the three filters that split words."""
    steps = {name: cls() for name, cls in ORACLES.items()}
    out: dict[str, list[tuple[str | None, str]]] = {name: [] for name in steps}
    for i, text in enumerate(texts):
        for name, step in steps.items():
            doc = Document(text=text, id=str(i))
            result = step.filter(doc)
            reason = None if result is True else REASONS[name][result[1]]
            out[name].append((reason, doc.text))
    return out


def _ours(name: str, texts: list[str]) -> list[tuple[str | None, str]]:
    rule_set = OURS[name]
    verdicts = rule_set.apply(pa.array(texts, pa.string()))
    rules = rule_set.rule_names()
    new = verdicts.texts or texts
    return [(None if k < 0 else rules[k], t) for k, t in zip(verdicts.failed, new, strict=True)]


def _compare(name: str, texts: list[str], ref: list[tuple[str | None, str]],
             label: str) -> tuple[Counter[str], Counter[str]]:
    t0 = time.perf_counter()
    got = _ours(name, texts)
    seconds = time.perf_counter() - t0
    diffs = []
    for i, ((r_reason, r_text), (g_reason, g_text)) in enumerate(zip(ref, got, strict=True)):
        if (r_reason is None) != (g_reason is None):
            diffs.append(f"  doc {i}: datatrove {r_reason or 'keeps'}, ours {g_reason or 'keeps'}"
                         f": {texts[i][:80]!r}")
        elif r_reason != g_reason:
            diffs.append(f"  doc {i}: both drop, datatrove by {r_reason}, ours by {g_reason}")
        elif name == "c4" and r_reason is None and r_text != g_text:
            diffs.append(f"  doc {i}: both keep, edited texts differ")
    decisions = sum((r[0] is None) == (g[0] is None) for r, g in zip(ref, got, strict=True))
    agreement = decisions / len(texts)
    kept = sum(r[0] is None for r in ref)
    print(f"{name} on {label}: {len(texts)} docs, datatrove keeps {kept}, decision agreement "
          f"{agreement:.2%} ({len(texts) - decisions} differ), {len(diffs)} differences "
          f"(ours {seconds:.1f}s)")
    for line in diffs:
        print(line)
    assert agreement >= MIN_AGREEMENT, "\n".join(diffs)
    assert len(diffs) <= (1 - MIN_AGREEMENT) * len(texts), "\n".join(diffs)
    return Counter(r[0] for r in ref if r[0]), Counter(g[0] for g in got if g[0])


@pytest.fixture(scope="module")
def oracle_corpus(corpus: list[str]) -> dict[str, list[tuple[str | None, str]]]:
    return _oracle(corpus)


@pytest.fixture(scope="module")
def oracle_mixed(mixed: list[str]) -> dict[str, list[tuple[str | None, str]]]:
    return _oracle(mixed)


@pytest.mark.parametrize("name", list(ORACLES))
def test_agrees_with_datatrove_on_corpus(name: str, corpus: list[str], oracle_corpus) -> None:
    _compare(name, corpus, oracle_corpus[name], "embedded corpus")


@pytest.mark.parametrize("name", list(ORACLES))
def test_agrees_with_datatrove_on_mixed_corpus(name: str, mixed: list[str],
                                               oracle_mixed) -> None:
    ref, got = _compare(name, mixed, oracle_mixed[name], "mixed corpus")
    print(f"  drops by rule (datatrove): {dict(sorted(ref.items()))}")
    rules = set(OURS[name].rule_names())
    assert set(ref) == rules, f"rules that never fired: {sorted(rules - set(ref))}"
    assert set(got) == rules, f"rules that never fired: {sorted(rules - set(got))}"


def test_words_equal_spacy(corpus: list[str], mixed: list[str]) -> None:
    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    tok = english()
    assert tok.version == spacy.__version__
    texts = corpus[::10] + mixed[::4]
    for text in texts:
        nlp.max_length = len(text) + 10
        doc = nlp(text)
        assert tok.tokenize(text) == [t.text for t in doc]
    lines = [line.strip() for t in mixed[::5] for line in t.splitlines() if line.strip()]
    nlp.max_length = max(map(len, lines)) + 10
    for line in lines:
        assert tok.sentence_count(line) == len(list(nlp(line).sents)), line


def test_asset_matches_installed_spacy(tmp_path: Path) -> None:
    fresh = export_spacy_english(tmp_path / ASSET)
    stored = json.loads(gzip.decompress((resources.files("mt_data") / "assets" / ASSET)
                                        .read_bytes()))
    assert fresh == stored


# ---------------------------------------------------------------- selection and batches


def test_parse_rule_sets() -> None:
    sets = parse_rule_sets("gopher-quality, c4")
    assert [s.name for s in sets] == ["gopher-quality", "c4"]
    with pytest.raises(ValueError, match="unknown rule set 'gopher'; known: mt-basic, "
                                         "gopher-quality, gopher-repetition, c4, fineweb"):
        parse_rule_sets("gopher")
    with pytest.raises(ValueError, match="rule set 'c4' is named twice"):
        parse_rule_sets("c4,c4")
    with pytest.raises(ValueError, match=r"gopher-quality: max_bullet_lines_ratio must be in "
                                         r"\[0, 1\] or None \(off\), got 1.5"):
        GopherQuality(max_bullet_lines_ratio=1.5)
    with pytest.raises(ValueError, match="gopher-repetition: top_n_grams needs n >= 1"):
        GopherRepetition(top_n_grams=((0, 0.2),))


def test_apply_rule_sets_chains_counts_and_samples(corpus: list[str]) -> None:
    texts = [corpus[3], "Lorem ipsum dolor sit amet. " * 3 + "\n" + corpus[5], "", corpus[150]]
    batch = pa.RecordBatch.from_pydict({"id": [f"d{i}" for i in range(4)],
                                        "source": ["t"] * 4, "text": texts})
    kept, counts, samples = apply_rule_sets(batch, parse_rule_sets("mt-basic,c4,fineweb"))
    assert kept.column("id").to_pylist() == ["d0", "d3"]
    assert counts["too_short"] == 1 and counts["c4/lorem_ipsum"] == 1
    assert counts["fineweb/empty"] == 0 and "gopher-quality/stop_words" not in counts
    assert samples["c4/lorem_ipsum"][0]["id"] == "d1"
    assert samples["too_short"][0] == {"id": "d2", "source": "t", "chars": 0, "text": ""}
    # C4 hands its edited text on: the kept chapter has no heading line any more
    assert kept.column("text")[0].as_py() == _oracle([texts[0]])["c4"][0][1]


# ---------------------------------------------------------------- mt data prepare / inspect


def test_prepare_filters_and_inspect_dropped(corpus: list[str], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mt_data.cli import app

    runner = CliRunner()
    chapters = corpus[1:21]
    planted = {
        "curly": chapters[0].replace(". ", ". {see note} ", 1),
        "lorem": "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n" + chapters[1],
        "bullets": "\n".join("- " + " ".join(chapters[2].split()[i:i + 8]) for i in
                             range(0, 800, 8)),
        "short": "Call me Ishmael.",
    }
    lines = [{"id": f"ch{i}", "text": t} for i, t in enumerate(chapters)]
    lines += [{"id": k, "text": t} for k, t in planted.items()]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    args = ["prepare", str(src), "-o", str(out), "--tokenizer", "tokenizer-1k", "--workers", "1",
            "--no-fuzzy-dedup"]
    result = runner.invoke(app, args + ["--filters", "gopher-quality,gopher-repetition,c4"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for row in ("dropped: gopher-quality/too_few_words", "dropped: gopher-quality/bullet_lines",
                "dropped: gopher-repetition/top_2_gram", "dropped: c4/curly_bracket",
                "dropped: c4/lorem_ipsum"):
        assert row in result.output, row
    index = json.loads((out / "index.json").read_text())
    dropped = index["stats"]["dropped"]
    assert dropped["gopher-quality/too_few_words"] == 1  # "short"
    assert dropped["gopher-quality/bullet_lines"] == 1
    assert dropped["c4/curly_bracket"] == 1 and dropped["c4/lorem_ipsum"] == 1
    assert index["stats"]["fingerprint"]["settings"]["clean"]["rule_sets"][2]["name"] == "c4"
    stats = index["stats"]
    assert stats["after_filters"] == len(lines) - sum(dropped.values()) == index["documents"]

    result = runner.invoke(app, ["inspect", str(out), "--dropped", "c4/curly_bracket"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "c4/curly_bracket: 1 dropped, 1 shown" in result.output
    assert "curly (" in result.output and "{see note}" in result.output
    result = runner.invoke(app, ["inspect", str(out), "--dropped", "gopher-quality"],
                           env={"COLUMNS": "200"})
    assert "gopher-quality/bullet_lines: 1 dropped" in result.output
    assert "gopher-quality/hashes: 0 dropped" in result.output
    result = runner.invoke(app, ["inspect", str(out), "--dropped", "c4/nothing"])
    assert result.exit_code == 2 and "no rule 'c4/nothing'" in result.output
    assert "recorded: gopher-quality/too_few_words" in result.output

    # default: today's filters, under their historic names
    result = runner.invoke(app, args + ["--overwrite"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "dropped: too_short" in result.output and "c4/" not in result.output
    index = json.loads((out / "index.json").read_text())
    assert "rule_sets" not in index["stats"]["fingerprint"]["settings"]["clean"]
    result = runner.invoke(app, ["inspect", str(out), "--dropped", "too_short"])
    assert result.exit_code == 0 and "short (" in result.output

    result = runner.invoke(app, args + ["--overwrite", "--filters", "gopher"])
    assert result.exit_code == 2 and "unknown rule set 'gopher'" in result.output
    result = runner.invoke(app, args + ["--overwrite", "--filters", "c4",
                                        "--no-quality-filters"])
    assert result.exit_code == 2 and "contradict" in result.output


def test_prepare_samples_over_many_chunks(corpus: list[str], tmp_path: Path) -> None:
    from mt_data import CleanConfig, IngestConfig, PrepareConfig, prepare
    from mt_data.pipeline import read_dropped

    src = tmp_path / "in.jsonl"
    docs = [{"id": f"short{i}", "text": f"Call me Ishmael, {i} times."} for i in range(12)]
    docs += [{"id": f"ch{i}", "text": t} for i, t in enumerate(corpus[1:6])]
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    clean = CleanConfig(ingest=IngestConfig(batch_docs=4),
                        rule_sets=parse_rule_sets("gopher-quality,fineweb"))
    summary = prepare([src], tmp_path / "out", PrepareConfig(clean, "tokenizer-1k", workers=1))
    assert summary["dropped"]["gopher-quality/too_few_words"] == 12
    rules = read_dropped(tmp_path / "out")
    assert rules["gopher-quality/too_few_words"]["dropped"] == 12
    samples = rules["gopher-quality/too_few_words"]["samples"]
    assert [s["id"] for s in samples] == [f"short{i}" for i in range(5)]  # first 5, in order
    assert rules["fineweb/empty"] == {"dropped": 0, "samples": []}
