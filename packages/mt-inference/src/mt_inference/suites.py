"""Evaluation suites: a named list of lm-eval tasks, each with the shot counts it is
reported at, and the task files mt ships for what lm-eval lacks (``tasks/``).

``mt-nlg``: MT-NLG 530B's evaluation (Smith et al., 2022, section 6): LAMBADA, BoolQ, RACE-h,
PiQA, HellaSwag, WinoGrande, ANLI R1-R3, HANS and WiC, each at zero, one and few shots.
The few-shot counts are GPT-3's (Brown et al., 2020, appendix H, table H.1: LAMBADA 15,
BoolQ 32, RACE-h 10, PiQA 50, HellaSwag 20, WinoGrande 50, ANLI 50, WiC 32), whose setup
MT-NLG's zero/one/few-shot comparison uses; HANS is not in GPT-3's table, and 32 (the
SuperGLUE count) is mt's choice. MT-NLG's own table of counts could not be read where this
was built; a count is one number here to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SUITES", "TASK_FILES", "Suite", "suite_plot", "suite_table"]

#: lm-eval task YAMLs mt ships (added to every harness run's include path).
TASK_FILES = Path(__file__).parent / "tasks"


@dataclass(frozen=True)
class Suite:
    """Tasks (lm-eval names) and the few-shot count of each; every task also runs at zero
    and one shot."""

    name: str
    few_shot: tuple[tuple[str, int], ...]
    """(lm-eval task, examples in the few-shot setting), in the order of the report."""
    source: str

    @property
    def tasks(self) -> list[str]:
        """The suite's lm-eval tasks, in report order."""
        return [task for task, _ in self.few_shot]

    def settings(self) -> dict[str, dict[str, int]]:
        """{"0-shot" | "1-shot" | "few-shot": {task: examples}}."""
        return {"0-shot": {t: 0 for t in self.tasks}, "1-shot": {t: 1 for t in self.tasks},
                "few-shot": dict(self.few_shot)}


SUITES = {suite.name: suite for suite in (
    Suite("mt-nlg", (("lambada_openai", 15), ("boolq", 32), ("race", 10), ("piqa", 50),
                     ("hellaswag", 20), ("winogrande", 50), ("anli_r1", 50), ("anli_r2", 50),
                     ("anli_r3", 50), ("hans", 32), ("wic", 32)),
          "MT-NLG 530B (Smith et al., 2022), few-shot counts of GPT-3 (Brown et al., 2020, "
          "table H.1); HANS: 32, mt's choice"),
)}


def _accuracy(results: dict[str, Any], task: str) -> float | None:
    value = results.get("results", {}).get(task, {}).get("acc,none")
    return float(value) if isinstance(value, (int, float)) else None


def suite_table(report: dict[str, Any]) -> str:
    """The report as MT-NLG's paper lays out its results: a row per task, accuracy at zero,
    one and few shots (the examples of the few-shot column in brackets), Markdown."""
    settings = report["settings"]
    few = settings["few-shot"].get("n-shot", {})
    lines = [f"{report['suite']}: accuracy ({report['source']})", "",
             "| task | 0-shot | 1-shot | few-shot |", "| --- | ---: | ---: | ---: |"]
    for task in SUITES[report["suite"]].tasks:
        cells = []
        for setting in ("0-shot", "1-shot", "few-shot"):
            acc = _accuracy(settings[setting], task)
            cells.append("-" if acc is None else f"{100 * acc:.1f}")
        cells[2] += f" ({few.get(task, '?')})"
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def suite_plot(report: dict[str, Any], path: Path) -> Path:
    """Grouped bars, a group per task, zero / one / few shots: accuracy in %. Needs
    matplotlib (``pip install 'mt-inference[plot]'``)."""
    import matplotlib  # pants: no-infer-dep (optional: mt-inference[plot])

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt  # pants: no-infer-dep

    from mt_inference.figures import save_figure

    tasks = SUITES[report["suite"]].tasks
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(tasks)), 3.6), constrained_layout=True)
    width = 0.27
    for i, setting in enumerate(("0-shot", "1-shot", "few-shot")):
        values = [100 * (_accuracy(report["settings"][setting], t) or 0.0) for t in tasks]
        ax.bar([x + (i - 1) * width for x in range(len(tasks))], values, width, label=setting)
    ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{report['suite']}: zero-, one- and few-shot accuracy")
    ax.legend(frameon=False, ncol=3)
    save_figure(fig, path)
    plt.close(fig)
    return path
