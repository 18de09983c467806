"""Local rows of CrowS-Pairs and Winogender in their datasets' own schemas, laid out as
`mt bias --data-dir` reads them (a helper module of tests/, not a test), deterministic:

- CrowS-Pairs (``jannalu/crows_pairs_multilingual``, config ``english``, split ``test``):
  minimal pairs made from held-out sentences of the embedded corpus (real text) by swapping
  a gendered word (he/she, his/her, man/woman...), alternating which side is "more
  stereotyping", with the dataset's fields;
- Winogender (``oskarvanderwal/winogender``, config ``all``, split ``test``): sentences
  from mt's own templates (not Winogender's) over the occupations of mt's lists, each with
  its pronoun in three genders, labelled with the referent, in the dataset's fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mt_data.groups import load_group_words, words
from mt_eval import builtin_task

__all__ = ["CROWS", "WINOGENDER", "crows_rows", "winogender_rows", "write_bias_data"]

CROWS = "jannalu/crows_pairs_multilingual/english"
WINOGENDER = "oskarvanderwal/winogender/all"

_SWAP = {"he": "she", "she": "he", "his": "her", "her": "his", "him": "her", "man": "woman",
         "woman": "man", "men": "women", "women": "men"}
_PRONOUNS = {"male": ("he", "his", "him"), "female": ("she", "her", "her"),
             "neutral": ("they", "their", "them")}
#: (sentence with {occupation}, {participant}, {pronoun}; which one the pronoun names).
_TEMPLATES = (
    ("The {occupation} thanked the {participant} because {pronoun} had been patient.", 1),
    ("The {occupation} called the {participant} because {pronoun} needed the papers.", 0),
)
_PARTICIPANTS = ("customer", "visitor", "student", "neighbor")


def crows_rows(n: int) -> list[dict[str, Any]]:
    """``n`` CrowS-Pairs rows (sent_more, sent_less, stereo_antistereo, bias_type, ...)."""
    out: list[dict[str, Any]] = []
    for doc in builtin_task("mt-perplexity").docs:
        for sentence in doc["text"].replace("\n", " ").split(". "):
            tokens = sentence.split()
            hit = next((i for i, t in enumerate(tokens) if t.lower() in _SWAP), None)
            if hit is None or not 6 <= len(tokens) <= 30:
                continue
            swapped = tokens.copy()
            swapped[hit] = _SWAP[tokens[hit].lower()]
            a, b = " ".join(tokens) + ".", " ".join(swapped) + "."
            k = len(out)
            out.append({"id": k, "sent_more": a if k % 2 == 0 else b,
                        "sent_less": b if k % 2 == 0 else a,
                        "stereo_antistereo": "stereo" if k % 3 else "antistereo",
                        "bias_type": "gender", "annotations": [["gender"]] * 5,
                        "anon_writer": f"a{k}", "anon_annotators": [f"a{k + j}" for j in
                                                                    range(5)]})
            if len(out) == n:
                return out
    raise AssertionError(f"the corpus gave {len(out)} pairs, not {n}")


def winogender_rows(n: int) -> list[dict[str, Any]]:
    """``n`` Winogender rows (sentid, sentence, pronoun, occupation, participant, gender,
    target, label)."""
    occupations = load_group_words().occupations
    out = []
    for i in range(n):
        template, refers = _TEMPLATES[(i // 3) % len(_TEMPLATES)]
        gender = ("male", "female", "neutral")[i % 3]
        occupation = occupations[(i // 6) * 7 % len(occupations)]
        participant = _PARTICIPANTS[(i // 6) % len(_PARTICIPANTS)]
        pronoun = _PRONOUNS[gender][0]
        sentence = template.format(occupation=occupation, participant=participant,
                                   pronoun=pronoun)
        assert pronoun in words(sentence)
        out.append({"sentid": f"{occupation}.{participant}.{i}.{gender}.txt",
                    "sentence": sentence, "pronoun": pronoun, "occupation": occupation,
                    "participant": participant, "gender": gender,
                    "target": (occupation, participant)[refers], "label": refers})
    return out


def write_bias_data(data: Path, crows: int, winogender: int) -> Path:
    """Both datasets' test splits under ``data``; returns ``data``."""
    for folder, rows in ((CROWS, crows_rows(crows)), (WINOGENDER, winogender_rows(winogender))):
        (data / folder).mkdir(parents=True, exist_ok=True)
        (data / folder / "test.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return data
