"""Local rows of MT-NLG's tasks in each dataset's own schema, laid out as `mt eval
--data-dir` reads them (a helper module of tests/, not a test): made from held-out sentences
of the embedded corpus (real text), deterministic."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mt_eval import builtin_task

__all__ = ["LAYOUT", "SUITE_LAYOUT", "rows", "write_data"]


def _sentences() -> list[list[str]]:
    """Word lists of held-out sentences of the embedded corpus (real text)."""
    out = []
    for doc in builtin_task("mt-perplexity").docs:
        for sentence in doc["text"].replace("\n", " ").split(". "):
            words = sentence.split()
            if 8 <= len(words) <= 30:
                out.append(words)
    return out


def rows(task: str, n: int, offset: int) -> list[dict[str, Any]]:
    """``n`` rows of ``task`` in its dataset's own schema (fields and types as on the hub)."""
    s = _sentences()
    pick = lambda i: s[(offset * 7 + i * 3) % len(s)]  # noqa: E731
    text = lambda i: " ".join(pick(i))  # noqa: E731
    rows: list[dict[str, Any]] = []
    for i in range(n):
        w = pick(i)
        if task == "lambada_openai":
            rows.append({"text": text(i)})
        elif task == "boolq":
            rows.append({"question": " ".join(w[:6]).lower(), "passage": text(i + 1) + ". " +
                         text(i + 2), "idx": i, "label": (i + offset) % 2})
        elif task == "race":
            problems = [{"question": " ".join(pick(i + k)[:5]) + "?", "answer": "ABCD"[k % 4],
                         "options": [" ".join(pick(i + k + j)[-3:]) for j in range(4)]}
                        for k in range(2)]
            rows.append({"example_id": f"high{i}.txt", "article": text(i + 1) + ". " +
                         text(i + 3), "problems": str(problems)})
        elif task == "piqa":
            rows.append({"goal": " ".join(w[:7]), "sol1": " ".join(pick(i + 1)[:6]),
                         "sol2": " ".join(pick(i + 2)[:6]), "label": (i + offset) % 2})
        elif task == "hellaswag":
            rows.append({"ind": i, "activity_label": w[0].capitalize(),
                         "ctx_a": " ".join(w[1:8]), "ctx_b": " ".join(w[8:11]),
                         "ctx": " ".join(w[1:11]), "endings": [" ".join(pick(i + j)[-5:])
                                                              for j in range(4)],
                         "source_id": f"corpus~{i}", "split": "val", "split_type": "indomain",
                         "label": str((i + offset) % 4)})
        elif task == "winogrande":
            rows.append({"sentence": " ".join(w[:4]) + " _ " + " ".join(w[4:10]),
                         "option1": pick(i + 1)[0], "option2": pick(i + 2)[0],
                         "answer": str(1 + (i + offset) % 2)})
        elif task == "hans":
            rows.append({"premise": text(i), "hypothesis": " ".join(pick(i + 1)[:7]),
                         "label": (i + offset) % 2, "parse_premise": "", "parse_hypothesis": "",
                         "binary_parse_premise": "", "binary_parse_hypothesis": "",
                         "heuristic": "lexical_overlap", "subcase": "ln_subject/object_swap",
                         "template": f"temp{i % 3}"})
        elif task.startswith("anli_r"):
            rows.append({"uid": f"u{offset}-{i}", "premise": text(i), "hypothesis":
                         " ".join(pick(i + 1)[:8]), "label": (i + offset) % 3, "reason": ""})
        elif task == "wic":
            a, b = text(i), text(i + 1)
            word = w[2]
            start = a.index(word)
            rows.append({"word": word, "sentence1": a, "sentence2": b, "start1": start,
                         "end1": start + len(word), "start2": 0, "end2": len(b.split()[0]),
                         "idx": i, "label": (i + offset) % 2})
    return rows


#: (dataset folder under DATA_DIR, splits) of each task: lm-eval's dataset_path/dataset_name.
LAYOUT = {
    "lambada_openai": ("EleutherAI/lambada_openai/default", ("test",)),
    "boolq": ("aps/super_glue/boolq", ("train", "validation")),
    "race": ("EleutherAI/race/high", ("test",)),
    "piqa": ("baber/piqa", ("train", "validation")),
    "hellaswag": ("Rowan/hellaswag", ("train", "validation")),
    "winogrande": ("allenai/winogrande/winogrande_xl", ("train", "validation")),
    "anli_r1": ("facebook/anli", ("train_r1", "test_r1")),
    "wic": ("aps/super_glue/wic", ("train", "validation")),
}
#: The rest of MT-NLG's tasks (`mt eval --suite mt-nlg`).
SUITE_LAYOUT = {
    **LAYOUT,
    "anli_r2": ("facebook/anli", ("train_r2", "test_r2")),
    "anli_r3": ("facebook/anli", ("train_r3", "test_r3")),
    "hans": ("jhu-cogsci/hans", ("train", "validation")),
}


def write_data(data: Path, layout: dict[str, tuple[str, tuple[str, ...]]],
                rows_of: Callable[[str], int]) -> None:
    """Every task's splits under ``data`` (``rows_of(split)``: how many rows a split gets)."""
    for task, (folder, splits) in layout.items():
        (data / folder).mkdir(parents=True, exist_ok=True)
        for k, split in enumerate(splits):
            part = rows(task, rows_of(split), offset=10 * k + 1 if "train" in split else 0)
            (data / folder / f"{split}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
