"""``prepare`` end to end on real text: every stage counted, parallel workers, resume."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mt_data.corpus import iter_corpus
from mt_data.decontam import DecontamConfig
from mt_data.ingest import BadInputError, IngestConfig
from mt_data.pipeline import PrepareConfig, PrepareError, prepare, summary_rows
from mt_data.shards import TokenDataset
from mt_data.stages import CleanConfig
from mt_data.tokenizer import load_tokenizer


def near_copy(text: str, seed: int) -> str:
    rng = random.Random(seed)
    words = text.split(" ")
    for _ in range(len(words) // 100):
        words[rng.randrange(len(words))] = "whale"
    return " ".join(words)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Moby-Dick as JSONL.gz (with planted duplicates and bad lines), SOTU as Parquet,
    a few chapters as a text folder, and an evaluation file."""
    root = tmp_path_factory.mktemp("raw")
    docs = list(iter_corpus())
    moby, sotu = docs[:60], docs[135:165]
    lines = [json.dumps({"id": d["id"], "text": d["text"]}) for d in moby]
    lines.insert(10, json.dumps({"id": "exact-dup", "text": moby[3]["text"]}))
    lines.insert(20, json.dumps({"id": "near-dup", "text": near_copy(moby[7]["text"], 1)}))
    lines.insert(30, '{"id": "broken", "text": "unterminated')
    lines.insert(40, json.dumps({"id": "html", "text": "<div><p>" + "</p> <p>".join(
        moby[5]["text"].split()[:300]) + "</p></div>"}))
    (root / "moby.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    pq.write_table(pa.table({"text": [d["text"] for d in sotu], "id": [d["id"] for d in sotu]}),
                   root / "sotu.parquet")
    folder = root / "chapters"
    folder.mkdir()
    for d in docs[100:104]:
        (folder / f"{d['id'].split('/')[-1]}.txt").write_text(d["text"])
    (folder / "empty.txt").write_text("")
    evals = root / "eval.jsonl"
    evals.write_text(json.dumps({"text": sotu[4]["text"][2000:2800]}) + "\n")
    return {"files": [root / "moby.jsonl.gz", root / "sotu.parquet", folder], "eval": evals,
            "moby": moby, "sotu": sotu, "chapters": docs[100:104]}


def _config(inputs: dict[str, object], **kw: object) -> PrepareConfig:
    clean = CleanConfig(ingest=IngestConfig(batch_docs=16), decontam=DecontamConfig(),
                        eval_paths=(str(inputs["eval"]),))
    return PrepareConfig(clean=clean, tokenizer="tokenizer-1k", **kw)


def test_prepare_counts_every_stage(inputs: dict[str, object], tmp_path: Path) -> None:
    summary = prepare(inputs["files"], tmp_path / "out", _config(inputs, workers=2))
    assert summary["files"] == 7
    assert summary["documents_in"] == 60 + 3 + 30 + 4  # good lines + 3 planted + parquet + txt
    assert summary["bad_inputs"] == {"json": 1, "empty_file": 1}
    assert any("moby.jsonl.gz:31: json" in s for s in summary["bad_input_samples"])
    assert summary["dropped"]["html"] == 1 and summary["dropped"]["contaminated"] == 1
    assert summary["exact_duplicates"] == 1 and summary["fuzzy_duplicates"] == 1
    assert summary["fuzzy_clusters"] == 1
    assert summary["documents_out"] == 60 + 30 + 4 - 1  # minus the contaminated address
    ds = TokenDataset(tmp_path / "out", verify=True)
    assert len(ds) == summary["documents_out"] and ds.num_tokens == summary["tokens_out"]
    ids = [ds.metadata(i)[0] for i in range(len(ds))]
    assert not {"exact-dup", "near-dup", "broken", "html"} & set(ids)
    assert inputs["sotu"][4]["id"] not in ids
    assert ids[:3] == [d["id"] for d in inputs["moby"][:3]]  # input order is kept
    assert ds.source_counts() == {"moby": 60, "sotu": 29, "chapters": 4}
    tok = load_tokenizer("tokenizer-1k")
    assert tok.decode(ds.document(0)[:-1]) == inputs["moby"][0]["text"]
    assert not (tmp_path / "out" / "work").exists()
    labels = dict(summary_rows(summary))
    assert labels["exact duplicates"] == "1" and "tokens/s" in labels["throughput"]
    # Rerunning a finished run is a no-op; other settings on the same output are refused.
    again = prepare(inputs["files"], tmp_path / "out", _config(inputs, workers=1))
    assert again["resumed"] == "already complete"
    with pytest.raises(PrepareError, match="already holds"):
        prepare(inputs["files"][:1], tmp_path / "out", _config(inputs))


class Interrupt(Exception):
    pass


class StopAfter:
    """A progress hook that 'kills' the run after ``n`` units of work in stage ``name``."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n, self.current, self.seen = name, n, "", 0

    def stage(self, name: str, total: float | None, unit: str) -> None:
        self.current = name

    def advance(self, amount: float) -> None:
        if self.current.startswith(self.name):
            self.seen += 1
            if self.seen >= self.n:
                raise Interrupt(self.current)

    def end(self) -> None:
        pass


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_after_interruption(inputs: dict[str, object], tmp_path: Path,
                                   workers: int) -> None:
    reference = prepare(inputs["files"], tmp_path / "ref", _config(inputs, workers=1))
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        prepare(inputs["files"], out, _config(inputs, workers=workers), StopAfter("clean", 1))
    assert len(list((out / "work").glob("item-*.json"))) >= 1  # finished items are kept
    with pytest.raises(Interrupt):
        prepare(inputs["files"], out, _config(inputs, workers=workers),
                StopAfter("tokenize", 3))
    logged = (out / "progress.jsonl").read_text().splitlines()
    done = sorted(json.loads(line)["file"] for line in logged)
    assert len(done) == 3 or (workers > 1 and len(done) > 3)
    mtimes = {name: (out / name).stat().st_mtime_ns for name in done}
    with pytest.raises(PrepareError, match="unfinished run"):
        prepare(inputs["files"][:2], out, _config(inputs))
    summary = prepare(inputs["files"], out, _config(inputs, workers=workers))
    assert {name: (out / name).stat().st_mtime_ns for name in done} == mtimes  # kept, not redone
    for key in ("documents_in", "documents_out", "tokens_out", "exact_duplicates",
                "fuzzy_duplicates", "bad_inputs", "dropped"):
        assert summary[key] == reference[key], key
    ref_index = json.loads((tmp_path / "ref" / "index.json").read_text())
    new_index = json.loads((out / "index.json").read_text())
    assert [s["sha256"] for s in new_index["shards"]] == [s["sha256"] for s in ref_index["shards"]]


def test_on_error_stop(inputs: dict[str, object], tmp_path: Path) -> None:
    config = PrepareConfig(clean=CleanConfig(on_error="stop"), tokenizer="tokenizer-1k")
    with pytest.raises(BadInputError, match=r"moby\.jsonl\.gz:31: json"):
        prepare(inputs["files"], tmp_path / "out", config)


def test_prepare_demo(tmp_path: Path) -> None:
    from mt_data.pipeline import prepare_demo

    path = prepare_demo(tmp_path / "demo")
    ds = TokenDataset(path)
    assert len(ds) == 181 and ds.tokenizer["vocab_size"] == 1000
    assert prepare_demo(tmp_path / "demo") == path  # second call reuses it


def test_parallel_equals_serial_on_a_split_file(tmp_path: Path) -> None:
    docs = list(iter_corpus())[::2]
    path = tmp_path / "all.jsonl"
    path.write_text("".join(json.dumps({"id": d["id"], "text": d["text"]}) + "\n"
                            for d in docs))
    clean = CleanConfig(ingest=IngestConfig(split_bytes=200_000, batch_docs=20))
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare([path], out, PrepareConfig(clean=clean, tokenizer="tokenizer-1k",
                                           workers=workers))
        runs[workers] = json.loads((out / "index.json").read_text())
    assert len(runs[1]["shards"]) > 6  # several byte ranges, several chunks each
    assert [s["sha256"] for s in runs[1]["shards"]] == [s["sha256"] for s in runs[2]["shards"]]
    ds = TokenDataset(tmp_path / "w2")
    assert [ds.metadata(i)[0] for i in range(len(ds))] == [d["id"] for d in docs]
