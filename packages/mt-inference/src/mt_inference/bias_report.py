"""`mt bias`'s report as a person reads it: a Markdown summary and two plots (the
association of each occupation, the sentiment of each group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["bias_plots", "bias_table"]


def _likelihood_lines(likelihood: dict[str, Any]) -> list[str]:
    lines = ["## Likelihood probes (lm-evaluation-harness tasks)", "",
             "| task | metric | value | stderr |", "| --- | --- | ---: | ---: |"]
    for task, metrics in likelihood["results"].items():
        for key, value in metrics.items():
            name, _, _filter = key.partition(",")
            if name.endswith("_stderr") or not isinstance(value, (int, float)) or \
                    name == "alias":
                continue
            err = metrics.get(f"{name}_stderr,{_filter}")
            err_text = f"{err:.4f}" if isinstance(err, (int, float)) else "-"
            lines.append(f"| {task} | {name} | {value:.4f} | {err_text} |")
    return lines + [""]


def _occupation_lines(stats: dict[str, Any]) -> list[str]:
    rows = sorted(stats["occupations"].items(), key=lambda kv: (kv[1]["score"], kv[0]))
    lines = ["## Occupations and gender", "",
             "Score: ln((female + 1) / (male + 1)) over an occupation's continuations "
             "(negative: leans male).", "",
             f"- average score: {stats['average_score']:.3f} over {len(rows)} occupations",
             f"- male-leaning: {100 * stats['male_leaning']:.1f}% of occupations; "
             f"female-leaning: {100 * stats['female_leaning']:.1f}%"]
    lines += [f"- template \"{t}\": average {row['average_score']:.3f}"
              for t, row in stats["templates"].items()]
    fmt = lambda kv: f"{kv[0]} ({kv[1]['score']:.2f})"  # noqa: E731
    male = [kv for kv in rows if kv[1]["score"] < 0][:5]
    female = [kv for kv in rows[::-1] if kv[1]["score"] > 0][:5]
    lines += [f"- most male-leaning: {', '.join(map(fmt, male)) or '-'}",
              f"- most female-leaning: {', '.join(map(fmt, female)) or '-'}", ""]
    return lines


def _group_lines(stats: dict[str, Any]) -> list[str]:
    lines = ["## Groups: sentiment and descriptive words", ""]
    for dimension, groups in stats.items():
        lines += [f"### {dimension}", "",
                  "| group | continuations | sentiment (mean ± stderr) | most frequent | "
                  "most distinctive |", "| --- | ---: | ---: | --- | --- |"]
        for group, row in groups.items():
            s = row["sentiment"]
            frequent = ", ".join(w for w, _ in row["top_words"][:6]) or "-"
            distinct = ", ".join(w for w, _, _ in row["distinctive_words"][:6]) or "-"
            lines.append(f"| {group} | {row['continuations']} | {s['mean']:+.3f} ± "
                         f"{s['stderr']:.3f} | {frequent} | {distinct} |")
        lines.append("")
    return lines


def bias_table(report: dict[str, Any]) -> str:
    """The report's figures as Markdown."""
    config = report["config"]
    lines = [f"# Bias report: {report['checkpoint']}", "",
             f"seed {config['seed']}, {config['samples']} samples per prompt, "
             f"temperature {config['sampling']['temperature']}, top-p "
             f"{config['sampling']['top_p']}, {config['sampling']['max_new_tokens']} new "
             "tokens at most", ""]
    if report.get("likelihood"):
        lines += _likelihood_lines(report["likelihood"])
    if report.get("occupation"):
        lines += _occupation_lines(report["occupation"])
    if report.get("groups"):
        lines += _group_lines(report["groups"])
    return "\n".join(lines)


def bias_plots(report: dict[str, Any], folder: Path) -> list[Path]:
    """occupation.png (each occupation's score, sorted) and sentiment.png (each group's mean
    sentiment with its standard error, a panel per dimension), those the report has data
    for. Needs matplotlib."""
    import matplotlib  # pants: no-infer-dep (optional: mt-inference[plot])

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt  # pants: no-infer-dep

    from mt_inference.figures import save_figure

    written = []
    occupation = report.get("occupation")
    if occupation and occupation["occupations"]:
        rows = sorted(occupation["occupations"].items(), key=lambda kv: kv[1]["score"])
        fig, ax = plt.subplots(figsize=(6.5, max(3.0, 0.18 * len(rows) + 1.2)),
                               constrained_layout=True)
        scores = [r["score"] for _, r in rows]
        ax.barh(range(len(rows)), scores,
                color=["tab:blue" if s < 0 else "tab:red" for s in scores])
        ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=7)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.axvline(occupation["average_score"], color="grey", linestyle="--", linewidth=0.8,
                   label=f"average {occupation['average_score']:.2f}")
        ax.set_xlabel("ln((female + 1) / (male + 1))   <- male | female ->")
        ax.set_title("Gender association per occupation")
        ax.legend(frameon=False, loc="lower right")
        save_figure(fig, folder / "occupation.png", dpi=110)
        plt.close(fig)
        written.append(folder / "occupation.png")
    groups = report.get("groups")
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(4.0 * len(groups), 3.4),
                                 constrained_layout=True, squeeze=False)
        for ax, (dimension, by_group) in zip(axes[0], groups.items(), strict=True):
            names = list(by_group)
            means = [by_group[g]["sentiment"]["mean"] for g in names]
            errs = [by_group[g]["sentiment"]["stderr"] for g in names]
            ax.bar(range(len(names)), means, yerr=errs, capsize=3,
                   color=["tab:green" if m >= 0 else "tab:red" for m in means])
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
            ax.axhline(0, color="black", linewidth=0.8)
            ax.set_title(dimension)
            ax.set_ylabel("mean sentiment (lexicon valence)")
        fig.suptitle("Sentiment of continuations per group")
        save_figure(fig, folder / "sentiment.png", dpi=110)
        plt.close(fig)
        written.append(folder / "sentiment.png")
    return written
