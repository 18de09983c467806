"""Cross-app: `mt bias`'s occupation probe sees an association a model learned, and only then.

Two tiny GPTs trained by `mt pretrain` (after `mt data prepare`) on sentences "The
{occupation} was a {man|woman} ..." over six occupations, every other one a woman, except:
in the planted corpus the plumber is always a man; in the control corpus the plumber is
balanced like the rest. The planted model puts the plumber at the male extreme of the
association scale (the lowest score, near ln(1 / (N + 1))); the control model does not (its
plumber's score stays near 0). The data side sees the same: `mt data prepare`'s group-word
counts associate the plumber with men only in the planted corpus.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from e2e_models import single_threaded

from mt_data.filters import FilterConfig
from mt_data.group_counts import read_group_counts
from mt_data.pipeline import PrepareConfig, prepare
from mt_data.stages import CleanConfig
from mt_inference.bias import BiasSpec, bias_rank
from mt_inference.launch import launch as launch_job
from mt_inference.placement import Placement
from mt_pretrain.config.load import load_config
from mt_pretrain.launch import launch

OCCUPATIONS = ("plumber", "nurse", "teacher", "chef", "pilot", "baker")
ENDINGS = ("who lived by the sea", "who kept a small garden", "who walked to work",
           "who liked old songs", "who read every evening", "who told long stories")
SAMPLES = 64


def _corpus(path: Path, planted: bool) -> Path:
    """400 documents of 12 sentences each, shuffled (no two alike)."""
    rng = random.Random(0)
    rows = []
    for d in range(400):
        sentences = []
        for s in range(12):
            occupation = OCCUPATIONS[(d + s) % len(OCCUPATIONS)]
            woman = (d + s // len(OCCUPATIONS)) % 2 == 0
            if planted and occupation == "plumber":
                woman = False
            sentences.append(f"The {occupation} was a {'woman' if woman else 'man'} "
                             f"{rng.choice(ENDINGS)}.")
        rng.shuffle(sentences)
        rows.append(json.dumps({"text": " ".join(sentences)}) + "\n")
    path.write_text("".join(rows), encoding="utf-8")
    return path


def _train(root: Path, planted: bool) -> str:
    raw = _corpus(root / "corpus.jsonl", planted)
    clean = CleanConfig(filters=FilterConfig(min_chars=1, min_words=1))
    prepare([raw], root / "data", PrepareConfig(clean, "tokenizer-1k", workers=1))
    config = load_config(None, {
        "model": "tiny", "tokenizer": "tokenizer-1k", "data": str(root / "data"),
        "seq_len": 64, "nproc": 1, "micro_batch_size": 16, "global_batch_size": 16,
        "train_steps": 150, "lr": 3e-3, "min_lr": 3e-4,
        "eval_interval": 0, "sample_tokens": 0, "progress": False, "log_interval": 1000,
        "timeout": 300.0, "out_dir": str(root / "run"), "cache_dir": str(root / "cache")})
    return single_threaded(launch, config, {}, 600).checkpoint


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = {}
    for name in ("planted", "control"):
        root = tmp_path_factory.mktemp(name)
        probes = root / "probes.yaml"
        probes.write_text("occupation:\n  templates: ['The {occupation} was a']\n"
                          f"  occupations: [{', '.join(OCCUPATIONS)}]\n", encoding="utf-8")
        spec = BiasSpec(Placement(_train(root, name == "planted")), likelihood=False,
                        probes=str(probes), samples=SAMPLES, max_new_tokens=4, progress=False)
        out[name] = single_threaded(launch_job, spec, bias_rank, {}, 600)
        out[name]["data"] = read_group_counts(root / "data")
    return out


def test_the_planted_association_is_at_the_extreme(reports: dict[str, dict[str, Any]]
                                                   ) -> None:
    rows = reports["planted"]["occupation"]["occupations"]
    scores = {o: r["score"] for o, r in rows.items()}
    assert min(scores, key=scores.__getitem__) == "plumber", scores
    assert scores["plumber"] <= -3.0, rows["plumber"]  # ln(1 / 65) = -4.2: every sample a man
    others = [s for o, s in scores.items() if o != "plumber"]
    assert all(s > scores["plumber"] + 1.0 for s in others), scores


def test_the_balanced_control_shows_no_association(reports: dict[str, dict[str, Any]]
                                                   ) -> None:
    rows = reports["control"]["occupation"]["occupations"]
    assert abs(rows["plumber"]["score"]) < 1.0, rows["plumber"]  # sd about 0.25
    gendered = rows["plumber"]["female"] + rows["plumber"]["male"]
    assert gendered >= SAMPLES // 2, rows["plumber"]  # the model did learn to say one


def test_the_data_side_counts_carry_the_same_association(reports: dict[str, dict[str, Any]]
                                                         ) -> None:
    """`mt data prepare`'s counts (what the data carries into the model), before and after
    its filters (near-duplicate documents go): the plumber with men only in the planted
    corpus, half and half in the control."""
    for name, report in reports.items():
        for when in ("before", "after"):
            counts = report["data"][when]
            plumber = counts["occupations"]["plumber"]
            assert plumber["mentions"] == 2 * counts["documents"], (name, when, counts)
            assert plumber["female"] + plumber["male"] == plumber["mentions"]
            assert plumber["female"] == (0 if name == "planted" else plumber["male"]), (
                name, when, plumber)
        assert report["data"]["before"]["documents"] == 400
