"""Task files for mt-eval's tests (a uniquely named helper module: apps/pretrain/tests has a
conftest too): the built-in tasks' first documents written as JSONL, and
lm-eval task YAMLs over them (the kinds `mt eval` reads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mt_eval import builtin_task

# lm-eval (a pinned test dependency, never skipped) and the datasets library it loads must
# not look for a hub: set before either is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

#: name -> (built-in source, documents, YAML body after the dataset lines)
TASKS = {
    "t_choice": ("mt-choice", 12, "output_type: multiple_choice\nfewshot_split: test\n"
                 "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label\n"),
    # Templates (the description's too: lm-eval renders it per document), and examples
    # drawn from the evaluated split without leaving the document out (no fewshot_split:
    # lm-eval's fallback to the test docs).
    "t_choice_tpl": ("mt-choice", 12, "output_type: multiple_choice\n"
                     "description: \"Pick the word after '{{context.split(' ')[-1]}}'."
                     "\\n\\n\"\n"
                     "doc_to_text: \"Passage: {{context}}\\nAnswer:\"\n"
                     "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\n"),
    "t_cloze": ("mt-cloze", 12, "output_type: loglikelihood\nfewshot_split: test\n"
                "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
                "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\ntarget_delimiter: \"\"\n"),
    "t_ppl": ("mt-perplexity", 3, "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
              "doc_to_target: text\n"),
}


def write_tasks(folder: Path) -> Path:
    """Write every task of :data:`TASKS` (JSONL + YAML) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (source, n, body) in TASKS.items():
        rows = builtin_task(source).docs[:n]
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{body}", encoding="utf-8")
    return folder
