"""mt as a model of lm-evaluation-harness: lm-eval's own tasks (Python hooks, multiple-input
tasks, filters, ``process_results``, its metrics and results JSON) scored by mt at any
TP x PP x DP layout (``generate_until``: mt's cached decoding at the same layout).

:class:`MTLM` is registered in lm-eval's model registry as ``mt``. Every process of the
layout runs the harness the same way (lm-eval builds the same requests on each, in the same
order); the requests reach mt's stage scorer on every rank, whose data-parallel replicas share
the batches out and all-reduce the scores, so each process holds every score. The model
therefore tells lm-eval it is rank 0 of 1 (lm-eval's convention for tensor-parallel
launchers: it writes results where its rank and ``LOCAL_RANK`` are 0), and lm-eval never
shards documents itself.

Two ways in: ``mt eval CHECKPOINT --task NAME`` (local processes, or one rank under a
launcher), and lm-eval's own command line with mt registered,
``python -m mt_inference.lm_eval --model mt --model_args checkpoint=DIR,tp=2,pp=2 ...``
(under ``torchrun --nproc_per_node N`` for N processes).
"""

from __future__ import annotations

import atexit
import functools
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM  # pants: no-infer-dep (the harness extra)
from lm_eval.api.registry import register_model  # pants: no-infer-dep (the harness extra)

from mt_dist import LaunchInfo
from mt_eval import Request, TaskError, batches_by_length, encode_pair, rolling_windows
from mt_inference.placement import Placement
from mt_inference.rank import EvalSpec
from mt_inference.session import ScoringSession
from mt_inference.suites import SUITES, TASK_FILES

# lm-eval registers its own models only while its registry is empty: first theirs, then mt.
importlib.import_module("lm_eval.models")

__all__ = ["MTLM", "harness_rank", "include_paths", "local_task", "task_config",
           "task_files_version", "task_manager"]

#: Where lm-eval reads a task's documents, by split: its config keys.
_SPLITS = ("test_split", "validation_split", "training_split", "fewshot_split")
_FORMATS = {"jsonl": "json", "json": "json", "parquet": "parquet"}


def _instances_progress(show: bool, total: int, what: str) -> Callable[[int], None]:
    """An ``advance(n)`` for the scorer: lm-eval's tqdm-style count on rank 0, or nothing."""
    if not show:
        return lambda _n: None
    from tqdm import tqdm  # pants: no-infer-dep (lm-eval's own progress bars)

    bar = tqdm(total=total, desc=f"mt: {what}")

    def advance(n: int) -> None:
        bar.update(min(n, total - bar.n))
        if bar.n >= total:
            bar.close()

    return advance


def _device(asked: str | None) -> str:
    """mt's device for lm-eval's ``--device`` (its default is cuda:0 on any machine): cpu
    when asked, else cuda when there is one (each rank its LOCAL_RANK's GPU)."""
    return "cpu" if asked == "cpu" else "auto"


@register_model("mt")
class MTLM(LM):
    """An mt checkpoint (any format mt reads) as an lm-eval model.

    Args (``--model_args`` keys):
        checkpoint: an mt pretrain checkpoint folder, or any folder mt convert reads.
        tp, pp: the layout (dp is the processes left: world size / (tp x pp)).
        precision: fp32, bf16 or fp16 weights.
        tokenizer: instead of the checkpoint's.
        batch_size: distinct inputs per forward pass ("auto": 16).
        device: lm-eval's --device: cpu, else a GPU when there is one.
    """

    def __init__(self, checkpoint: str | None = None, tp: int = 1, pp: int = 1,
                 precision: str = "fp32", tokenizer: str | None = None,
                 batch_size: int | str = 16, device: str | None = None,
                 session: ScoringSession | None = None, **_unused: Any) -> None:
        super().__init__()
        if session is None:
            if checkpoint is None:
                raise ValueError("--model_args needs checkpoint=DIR (an mt checkpoint, or a "
                                 "folder mt convert reads)")
            session = ScoringSession.open_here(Placement(
                checkpoint, tp=int(tp), pp=int(pp), precision=precision, tokenizer=tokenizer,
                device=_device(device)))
            atexit.register(session.close)  # lm-eval's command line keeps the model to the end
        self.session = session
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")

    # lm-eval shards documents by (rank, world_size); mt shares out batches itself.
    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def tokenizer_name(self) -> str:
        return self.session.tokenizer_name

    def _score(self, requests: list[Request], what: str) -> dict[tuple[int, int], tuple]:
        batches = batches_by_length(requests, self.batch_size)
        advance = _instances_progress(self.session.is_main, len(requests), what)
        scores = self.session.scorer(batches, advance)
        return {(r.doc_id, r.index): s for batch, scored in zip(batches, scores, strict=True)
                for r, s in zip(batch, scored, strict=True)}

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False
                      ) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether it is the greedy one) per request,
        tokenised as lm-eval's HF backend tokenises (:func:`mt_eval.encode_pair`)."""
        s = self.session
        ours = []
        for i, instance in enumerate(requests):
            context, continuation = instance.args[:2]
            ctx, cont = encode_pair(s.encode, s.prefix, context, continuation)
            if len(cont) > s.max_length:
                raise TaskError(f"request {i}: the continuation has {len(cont)} tokens, more "
                                f"than the model's {s.max_length} positions")
            ours.append(Request(i, 0, tuple((ctx + cont)[-(s.max_length + 1):]), len(cont)))
        scores = self._score(ours, "loglikelihood")
        out = []
        for i, instance in enumerate(requests):
            ll, greedy = scores[(i, 0)]
            self.cache_hook.add_partial("loglikelihood", instance.args, (ll, greedy))
            out.append((ll, greedy))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """The whole text's log-likelihood in disjoint windows of the model's length (lm-eval's
        rolling windows, :func:`mt_eval.rolling_windows`)."""
        s = self.session
        ours, windows = [], []
        for i, instance in enumerate(requests):
            parts = rolling_windows(s.encode(instance.args[0]), s.prefix, s.max_length)
            windows.append(len(parts))
            ours += [Request(i, w, tuple(ctx + pred), len(pred))
                     for w, (ctx, pred) in enumerate(parts)]
        scores = self._score(ours, "loglikelihood_rolling")
        out = []
        for i, instance in enumerate(requests):
            total = sum(scores[(i, w)][0] for w in range(windows[i]))
            self.cache_hook.add_partial("loglikelihood_rolling", instance.args, total)
            out.append(total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, as lm-eval's HF backend makes it: its generation
        kwargs normalised by lm-eval (``until`` plus end-of-text, ``max_gen_toks``, greedy
        unless ``do_sample``), the context cut from the left to leave room for the new
        tokens, the text cut at the first ``until`` string. Decoded at the session's layout
        (:class:`~mt_inference.decoder.StageDecoder`): DP replica ``r`` completes
        requests ``r, r + dp, ...`` in batches, and every rank receives every text."""
        import torch.distributed as dist
        from lm_eval.models import utils as lm_utils  # pants: no-infer-dep

        from mt_inference.decoder import StageDecoder
        from mt_inference.generation import Generator
        from mt_model import Sampling

        s = self.session
        eos = s.decode([s.prefix])
        prompts, rules, stops = [], [], []
        for instance in requests:
            context, gen_kwargs = instance.args[:2]
            kwargs = lm_utils.normalize_gen_kwargs(dict(gen_kwargs), 256)
            stops.append(lm_utils.handle_stop_sequences(kwargs.pop("until", None), eos=eos))
            budget = int(kwargs.pop("max_gen_toks"))
            if budget >= s.max_length:
                raise TaskError(f"max_gen_toks {budget} leaves no room for a context in the "
                                f"model's {s.max_length} positions")
            prompts.append(s.encode(context)[-(s.max_length - budget):] or [s.prefix])
            sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0)) > 0
            rules.append(Sampling(budget, float(kwargs["temperature"]) if sampled else 0.0,
                                  int(kwargs.get("top_k") or 0),
                                  float(kwargs.get("top_p") or 1.0), seed=1234,
                                  stop_ids=(s.prefix,)))
        generator = Generator(StageDecoder(s), s.tokenizer)
        groups = s.groups
        mine = list(range(groups.dp_rank, len(requests), groups.dp_size))
        texts: dict[int, str] = {}
        for start in range(0, len(mine), self.batch_size):
            chunk = mine[start:start + self.batch_size]
            rows = generator.complete_ids([prompts[i] for i in chunk], [rules[i] for i in chunk],
                                          [stops[i] for i in chunk])
            texts.update((i, row["completion"]) for i, row in zip(chunk, rows, strict=True))
        if groups.dp_size > 1:
            everyone: list[Any] = [None] * groups.topology.world_size
            dist.all_gather_object(everyone, texts)
            for part in everyone:
                texts.update(part)
        out = []
        for i, instance in enumerate(requests):
            self.cache_hook.add_partial("generate_until", tuple(instance.args[:2]), texts[i])
            out.append(texts[i])
        return out


def _needed_splits(config: dict[str, Any], shots: int) -> set[str]:
    """The splits lm-eval reads: the evaluated one (test, else validation) and, with
    examples, where they come from (the few-shot split, else training, else validation)."""
    evaluated = config.get("test_split") or config.get("validation_split")
    needed = {evaluated} if evaluated else set()
    if shots:
        source = (config.get("fewshot_split") or config.get("training_split")
                  or config.get("validation_split"))
        needed.add(source)
    return {s for s in needed if s}


def task_config(name: str, manager: Any, data_dir: str | Path | None = None, shots: int = 0,
                num_fewshot: int | None = None) -> str | dict[str, Any]:
    """What lm-eval is handed for task ``name``: the name itself, or, to read local data
    (``data_dir``) or to fix its examples (``num_fewshot``), its whole config with those
    changed (:func:`local_task`)."""
    if data_dir is None and num_fewshot is None:
        return name
    from lm_eval.tasks._yaml_loader import load_yaml  # pants: no-infer-dep

    config = (local_task(name, data_dir, manager, shots) if data_dir is not None
              else load_yaml(_entry(name, manager).yaml_path, resolve_func=True))
    return config if num_fewshot is None else {**config, "num_fewshot": num_fewshot}


def _entry(name: str, manager: Any) -> Any:
    """lm-eval's index entry of one task (by name or YAML path), or a TaskError."""
    from lm_eval.tasks._index import Kind, TaskIndex  # pants: no-infer-dep

    entry = manager.task_index.get(name) or TaskIndex.entry_from_path(Path(name))
    if entry is None:
        raise TaskError(f"task {name}: not an lm-eval task name nor a task YAML file "
                        "(`lm_eval ls tasks` lists the names; --include-path adds a folder)")
    if entry.kind is not Kind.TASK or entry.yaml_path is None:
        raise TaskError(f"task {name}: an lm-eval {entry.kind.name.lower()}, not one task; "
                        "name its tasks one by one")
    return entry


def local_task(name: str, data_dir: str | Path, manager: Any, shots: int = 0
               ) -> dict[str, Any]:
    """lm-eval task ``name`` (or a task YAML file) reading its documents from local copies:
    ``DATA_DIR/<dataset_path>/<dataset_name>/<split>.jsonl`` (or ``.json``, ``.parquet``),
    rows in the dataset's own schema, e.g. ``DATA/aps/super_glue/boolq/validation.jsonl``
    for ``boolq``. Raises :class:`~mt_eval.TaskError` naming the file expected."""
    from lm_eval.tasks._yaml_loader import load_yaml  # pants: no-infer-dep

    entry = _entry(name, manager)
    config = load_yaml(entry.yaml_path, resolve_func=False)
    if not config.get("dataset_path"):
        raise TaskError(f"task {name} ({entry.yaml_path}): no dataset_path to find a local "
                        "copy of")
    folder = Path(data_dir) / config["dataset_path"] / (config.get("dataset_name") or "")
    files, missing, overrides = {}, [], {}
    needed = _needed_splits(config, shots)
    for key in _SPLITS:
        split = config.get(key)
        if not split or split in files:
            continue
        found = [folder / f"{split}.{ext}" for ext in _FORMATS
                 if (folder / f"{split}.{ext}").is_file()]
        if found:
            files[split] = found[0]
        elif split in needed:
            missing.append(str(folder / f"{split}.jsonl"))
        else:
            overrides[key] = None  # a split this evaluation does not read
    if missing:
        raise TaskError(f"task {name}: no local copy of {', '.join(missing)} (or .json, "
                        f".parquet beside it): rows in {config['dataset_path']}'s own schema")
    builders = {_FORMATS[path.suffix[1:]] for path in files.values()}
    if len(builders) > 1:
        raise TaskError(f"task {name}: its splits in {folder} mix JSON and Parquet files; "
                        "give them all in one format")
    # The whole config (hooks resolved, as lm-eval loads it) with the data source replaced.
    full = load_yaml(entry.yaml_path, resolve_func=True)
    return {**full, **overrides, "dataset_path": builders.pop(), "dataset_name": None,
            "dataset_kwargs": {"data_files": {k: str(v) for k, v in files.items()}}}


def task_manager(include_path: tuple[str, ...] = ()) -> Any:
    """lm-eval's ``TaskManager`` of its own tasks, mt's task files and ``include_path``.
    It reads every task YAML lm-eval ships (seconds on a small machine) and holds only their
    index, so a process builds it once per version of ``include_path``'s task files (one
    added, removed or edited since is indexed again: :func:`task_files_version`); the
    launcher builds it before the ranks fork, and they share it."""
    return _task_manager(include_path, task_files_version(include_path))


def task_files_version(include_path: tuple[str, ...]) -> tuple[tuple[str, int, int], ...]:
    """(path, size, modified time) of every task YAML under the ``include_path`` folders."""
    found = []
    for folder in include_path:
        for path in sorted(Path(folder).rglob("*")) if Path(folder).is_dir() else ():
            if path.suffix in (".yaml", ".yml") and path.is_file():
                status = path.stat()
                found.append((str(path), status.st_size, status.st_mtime_ns))
    return tuple(found)


@functools.lru_cache(maxsize=2)  # a folder edited again and again keeps two indexes at most
def _task_manager(include_path: tuple[str, ...], version: tuple[Any, ...]) -> Any:
    from lm_eval.tasks import TaskManager  # pants: no-infer-dep

    return TaskManager(include_path=[str(TASK_FILES), *include_path])


def include_paths(spec: EvalSpec) -> tuple[str, ...]:
    """The task folders ``spec`` adds to lm-eval's (``--include-path``)."""
    return (spec.include_path,) if spec.include_path else ()


def harness_rank(spec: EvalSpec, info: LaunchInfo) -> dict[str, Any] | None:
    """Evaluate ``spec.tasks`` (or ``spec.suite``: each of its settings) with lm-eval as rank
    ``info.rank`` (every rank runs the harness; mt's scorer shares the batches out); on rank
    0 lm-eval's results (a suite: ``{"suite", "source", "settings": {setting: results}}``),
    else None. The model is loaded once."""
    import lm_eval  # pants: no-infer-dep
    from lm_eval.tasks import get_task_dict  # pants: no-infer-dep

    manager = task_manager(include_paths(spec))
    suite = SUITES[spec.suite] if spec.suite else None
    names = suite.tasks if suite else list(spec.tasks)
    unknown = [t for t in names if t not in manager.task_index and not Path(t).is_file()]
    if unknown:
        raise TaskError(f"--task {', '.join(unknown)}: not an lm-eval task, group or tag name "
                        "nor a task YAML file (`lm_eval ls tasks` lists the names; "
                        "--include-path adds a folder of task YAMLs)")
    if suite is not None:
        runs = {setting: [task_config(t, manager, spec.data_dir, k, num_fewshot=k)
                          for t, k in shots.items()]
                for setting, shots in suite.settings().items()}
    else:
        runs = {"": [task_config(t, manager, spec.data_dir, spec.shots or 0) for t in names]}
    for tasks in runs.values():  # lm-eval's own loading (hooks, data): one line if it fails
        try:
            get_task_dict(tasks, manager)
        except Exception as err:  # noqa: BLE001 - whatever lm-eval raises, said once
            raise TaskError(f"--task {', '.join(names)}: lm-evaluation-harness cannot load "
                            f"it: {type(err).__name__}: {err}") from None
    session = ScoringSession(spec.placement, info)
    completed = False
    try:
        model = MTLM(session=session, batch_size=spec.batch_size)
        results = {setting: lm_eval.simple_evaluate(
            model=model, tasks=tasks, num_fewshot=None if suite else spec.shots,
            limit=spec.limit, fewshot_random_seed=spec.fewshot_seed,
            log_samples=spec.log_samples, task_manager=manager)
            for setting, tasks in runs.items()}
        completed = True
    finally:
        session.close(completed)
    if not session.is_main:
        return None
    if suite is None:
        return results[""]
    return {"suite": suite.name, "source": suite.source, "settings": results}
