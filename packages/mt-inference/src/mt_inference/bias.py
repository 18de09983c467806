"""`mt bias`: the biases a checkpoint picked up, measured as the MT-NLG paper (Smith et al.,
2022, section 7) and GPT-3 (Brown et al., 2020, section 6.2) did, at any TP x PP x DP layout,
the model read once:

- likelihood probes: lm-evaluation-harness's own CrowS-Pairs (``crows_pairs_english``:
  ``likelihood_diff``, ``pct_stereotype``) and Winogender (``winogender_all``) tasks, from
  local copies of their data, scored by mt as in `mt eval` (every item logged);
- generation probes (mt-eval's :mod:`mt_eval.bias`): each prompt sampled N times through
  `mt generate`'s decoder, every sample with a seed of its own (the same samples at any
  layout), and the statistics computed from the logged samples alone.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mt_data.groups import GROUP_WORDS, load_group_words
from mt_dist import LaunchInfo
from mt_eval.bias import (
    LEXICON,
    PROBES,
    STOPWORDS,
    Probes,
    group_stats,
    load_lexicon,
    load_probes,
    load_stopwords,
    occupation_stats,
    sample_seed,
)
from mt_inference.placement import Placement
from mt_inference.rank import EvalSpec
from mt_inference.session import ScoringSession
from mt_model import Sampling

__all__ = ["LIKELIHOOD_TASKS", "BiasSpec", "bias_probes", "bias_rank", "bias_report",
           "bias_samples"]

#: lm-eval's tasks of the likelihood probes.
LIKELIHOOD_TASKS = ("crows_pairs_english", "winogender_all")


@dataclass(frozen=True)
class BiasSpec:
    """One `mt bias` run (the command's options)."""

    placement: Placement
    data_dir: str | None = None
    """Local copies of CrowS-Pairs' and Winogender's data (`mt eval --data-dir`'s layout)."""
    likelihood: bool = True
    generation: bool = True
    probes: str | None = None
    group_words: str | None = None
    samples: int = 10
    """Continuations sampled per prompt."""
    seed: int = 0
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 0
    limit: int | None = None
    """Score the first N items of each likelihood task."""
    batch_size: int = 32
    """Likelihood requests per forward pass; sequences decoded together."""
    progress: bool = True

    def eval_spec(self) -> EvalSpec:
        """The likelihood probes as an evaluation (its placement, the harness's options)."""
        return EvalSpec(self.placement, LIKELIHOOD_TASKS, 0, 1234, self.batch_size,
                        self.limit, self.progress, engine="harness", data_dir=self.data_dir,
                        log_samples=True)


def bias_probes(spec: BiasSpec) -> Probes:
    """The prompts of the generation probes (``spec``'s files, checked): a TaskError /
    ValueError names a bad probes or lists file."""
    return load_probes(load_group_words(spec.group_words), spec.probes)


def bias_samples(spec: BiasSpec) -> list[dict[str, Any]]:
    """Every sample to draw, in order, without its completion: the probe, group, template,
    prompt, index and seed. Raises TaskError / ValueError naming a bad probes or lists file."""
    probes = bias_probes(spec)
    return [{"kind": p.kind, "dimension": p.dimension, "group": p.group,
             "template": p.template, "prompt": p.prompt, "index": k,
             "seed": sample_seed(spec.seed, p.prompt, k)}
            for p in probes.prompts for k in range(spec.samples)]


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _likelihood(spec: BiasSpec, session: ScoringSession) -> dict[str, Any]:
    """lm-eval's CrowS-Pairs and Winogender on local data: metrics, and every item with its
    log-likelihoods."""
    import lm_eval  # pants: no-infer-dep (the harness extra)
    from lm_eval.tasks import get_task_dict  # pants: no-infer-dep

    from mt_eval import TaskError
    from mt_inference.harness import MTLM, task_config, task_manager

    manager = task_manager()
    tasks = [task_config(t, manager, spec.data_dir) for t in LIKELIHOOD_TASKS]
    try:  # lm-eval's own loading of the local rows: one line if it fails
        get_task_dict(tasks, manager)
    except Exception as err:  # noqa: BLE001 - whatever lm-eval raises, said once
        raise TaskError(f"--data-dir {spec.data_dir}: lm-evaluation-harness cannot load "
                        f"{', '.join(LIKELIHOOD_TASKS)} from it: {type(err).__name__}: "
                        f"{err}") from None
    model = MTLM(session=session, batch_size=spec.batch_size)
    results = lm_eval.simple_evaluate(model=model, tasks=tasks, limit=spec.limit,
                                      log_samples=True, task_manager=manager)
    if results is None:  # lm-eval reports on its rank 0 only; mt's model is rank 0 of 1
        raise RuntimeError("lm-evaluation-harness returned no results")
    items = {}
    for task in LIKELIHOOD_TASKS:
        items[task] = [
            {"doc_id": s["doc_id"], "doc": s["doc"],
             "loglikelihoods": [float(r[0][0]) for r in s["resps"]],
             **{m: float(s[m]) for m in ("likelihood_diff", "pct_stereotype", "acc")
                if m in s}}
            for s in results["samples"][task]]
    return {"results": {t: {k: v for k, v in results["results"][t].items()
                            if isinstance(v, (int, float, str))} for t in LIKELIHOOD_TASKS},
            "items": items, "lm_eval_version": lm_eval.__version__}


def _generate(spec: BiasSpec, session: ScoringSession, todo: list[dict[str, Any]]
              ) -> list[dict[str, Any]] | None:
    """Every sample's completion (rank 0; None elsewhere): DP replica ``r`` decodes samples
    ``r, r + dp, ...`` in batches of ``spec.batch_size``."""
    import torch.distributed as dist

    from mt_inference.decoder import StageDecoder
    from mt_inference.generation import Generator
    from mt_inference.rank import progress_bar

    tok = session.tokenizer
    generator = Generator(StageDecoder(session), tok)
    groups = session.groups
    mine = list(range(groups.dp_rank, len(todo), groups.dp_size))
    encoded = {p: tok.encode(p) for p in {todo[i]["prompt"] for i in mine}}
    done: list[tuple[int, str]] = []
    with progress_bar(spec.progress and session.is_main) as progress:
        for start in range(0, len(mine), spec.batch_size):
            chunk = mine[start:start + spec.batch_size]
            rules = [Sampling(spec.max_new_tokens, spec.temperature, spec.top_k, spec.top_p,
                              todo[i]["seed"], (tok.eod_id,)) for i in chunk]
            rows = generator.complete_ids([encoded[todo[i]["prompt"]] for i in chunk], rules,
                                          [()] * len(chunk))
            done += [(i, row["completion"]) for i, row in zip(chunk, rows, strict=True)]
            if progress is not None:
                progress(start + len(chunk), len(mine))
    everyone: list[Any] = [None] * groups.topology.world_size
    dist.all_gather_object(everyone, done if groups.is_last_stage and groups.tp_rank == 0
                           else [])
    if not session.is_main:
        return None
    completions = dict(pair for part in everyone for pair in part)
    return [{**row, "completion": completions[i]} for i, row in enumerate(todo)]


def bias_rank(spec: BiasSpec, info: LaunchInfo) -> dict[str, Any] | None:
    """This rank's part of ``spec``; the report on rank 0 (None elsewhere): ``config``,
    ``likelihood`` (lm-eval's metrics and every item), ``occupation`` and ``groups`` (the
    statistics) and ``samples`` (every sample, with its seed and completion)."""
    todo = bias_samples(spec) if spec.generation else []
    session = ScoringSession(spec.placement, info)
    completed = False
    seconds: dict[str, float] = {}
    try:
        likelihood = samples = None
        if spec.likelihood:
            start = time.perf_counter()
            likelihood = _likelihood(spec, session)
            seconds["likelihood"] = time.perf_counter() - start
        if spec.generation:
            start = time.perf_counter()
            samples = _generate(spec, session, todo)
            seconds["generation"] = time.perf_counter() - start
        completed = True
    finally:
        session.close(completed)
    if not session.is_main:
        return None
    return bias_report(spec, likelihood, samples, seconds)


def bias_report(spec: BiasSpec, likelihood: dict[str, Any] | None,
                samples: list[dict[str, Any]] | None, seconds: dict[str, float]
                ) -> dict[str, Any]:
    """The report of a run: its configuration (seeds, sampling, the data files and their
    SHA-256), the likelihood probes' results, the generation probes' statistics and every
    sample."""
    lists = load_group_words(spec.group_words)
    files = {"probes": spec.probes or str(PROBES), "group_words": spec.group_words or
             str(GROUP_WORDS), "lexicon": str(LEXICON), "stopwords": str(STOPWORDS)}
    config = {
        "seed": spec.seed, "samples": spec.samples,
        "sampling": {"max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature,
                     "top_p": spec.top_p, "top_k": spec.top_k},
        "files": {k: {"path": v, "sha256": _sha256(v)} for k, v in files.items()},
        "layout": {"tp": spec.placement.tp, "pp": spec.placement.pp,
                   "nproc": spec.placement.nproc, "precision": spec.placement.precision,
                   "device": spec.placement.device},
        "likelihood": spec.likelihood, "generation": spec.generation,
        "data_dir": spec.data_dir, "limit": spec.limit, "batch_size": spec.batch_size,
        "tokenizer": spec.placement.tokenizer,
    }
    report: dict[str, Any] = {"suite": "bias", "checkpoint": spec.placement.checkpoint,
                              "config": config, "seconds": seconds, "likelihood": likelihood}
    if samples is not None:
        report["occupation"] = occupation_stats(samples, lists)
        report["groups"] = group_stats(samples, lists, load_lexicon(), load_stopwords())
        report["samples"] = samples
    return report
