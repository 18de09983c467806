"""Requests per second of `mt eval` (its own engine, and through lm-evaluation-harness)
against lm-evaluation-harness's HF backend.

One random GPT with the GPT-2 vocabulary is written twice with the `mt convert` writers: as
an mt pretrain checkpoint (what `mt eval` reads) and as a Hugging Face folder with its
tokenizer (what lm-eval's ``hf`` model reads). Both sides then score the same task (the
built-in ``mt-choice``: four requests per document, as an lm-eval YAML over the same JSONL),
zero-shot, fp32, at the same batch size, on one process, alternating ``--repeats`` times:

- **mt**: ``mt_eval.evaluate`` with ``mt pretrain``'s stage scorer (prompts, tokenization,
  length-sorted batches, the forward pass, per-token log-probabilities), model loaded once;
- **mt-harness**: mt as lm-eval's model (``MTLM.loglikelihood``, what ``mt eval --engine
  harness`` and ``python -m mt_inference.lm_eval --model mt`` run) on lm-eval's own requests of
  the task, the very list the lm-eval side scores;
- **lm-eval**: ``HFLM.loglikelihood`` on the task's requests (tokenization, its length-
  sorted batches, the forward pass, log-softmax), ``GPT2LMHeadModel`` with sdpa attention,
  model loaded once and its requests built once (not timed).

All compute the same numbers (tests/test_e2e_eval.py and tests/test_e2e_harness.py prove
per-item equality); the best
and median of each side are printed with the load average. Pinned peers: lm-eval and
transformers come from infra/python/constraints.txt; a missing one is an error, not a skip.

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/eval.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from mt_dist import LaunchInfo, free_port  # noqa: E402
from mt_eval import builtin_task, evaluate, load_task  # noqa: E402
from mt_formats import save_state_dict  # noqa: E402
from mt_formats.hf_tokenizer import write_hf_tokenizer  # noqa: E402
from mt_inference.placement import Placement  # noqa: E402
from mt_inference.session import ScoringSession  # noqa: E402
from mt_model import GPT, GPTConfig  # noqa: E402

SHAPES = {
    # name: (layers, hidden, heads, positions)
    "tiny-gpt2vocab": (4, 64, 4, 64),
    "gpt2-small-4l": (4, 768, 12, 1024),
}


def write_models(root: Path, shape: tuple[int, int, int, int]) -> tuple[Path, Path]:
    layers, hidden, heads, positions = shape
    config = GPTConfig(layers, hidden, heads, 50257, positions, gelu_approximate="tanh")
    state = GPT(config, seed=0).state_dict()
    save_state_dict(state, config, root / "mt", to="pretrain")
    save_state_dict(state, config, root / "hf", to="hf")
    write_hf_tokenizer(root / "hf", "gpt2", config)
    return root / "mt", root / "hf"


def write_task(root: Path, docs: int) -> Path:
    rows = builtin_task("mt-choice").docs[:docs]
    data = root / "choice.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    path = root / "choice.yaml"
    path.write_text(f"task: bench_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
                    "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label\n",
                    encoding="utf-8")
    return path


def mt_session(checkpoint: Path, batch: int) -> ScoringSession:
    """mt's model on this one process, as `mt eval` opens it."""
    info = LaunchInfo(0, 1, 0, 1, "127.0.0.1", free_port("127.0.0.1"), "single")
    return ScoringSession(Placement(str(checkpoint), device="cpu"), info)


def mt_side(session: ScoringSession, task_file: Path, batch: int):  # noqa: ANN201
    task = load_task(str(task_file))

    def run() -> int:
        results = evaluate([task], session.encode, session.prefix, session.scorer,
                           batch_size=batch)
        return sum(len(s["loglikelihoods"]) for s in results[0].samples)

    return run


def lm_eval_requests(task_file: Path) -> list:
    """lm-eval's own requests of the task (built once, not timed)."""
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(task_file.parent)).load(["bench_choice"])["tasks"][
        "bench_choice"]
    task.set_config(key="num_fewshot", value=0)
    task.build_all_requests(limit=None, rank=0, world_size=1)
    return list(task.instances)


def harness_side(session: ScoringSession, task_file: Path, batch: int):  # noqa: ANN201
    """mt as lm-eval's model (`mt eval --engine harness`): the same requests as HFLM's."""
    from mt_inference.harness import MTLM

    lm, requests = MTLM(session=session, batch_size=batch), lm_eval_requests(task_file)

    def run() -> int:
        lm.loglikelihood(requests, disable_tqdm=True)
        return len(requests)

    return run


def lm_eval_side(hf: Path, task_file: Path, batch: int):  # noqa: ANN201
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(hf), dtype="float32", batch_size=batch, device="cpu")
    requests = lm_eval_requests(task_file)

    def run() -> int:
        lm.loglikelihood(requests, disable_tqdm=True)
        return len(requests)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    parser.add_argument("--docs", type=int, default=60, help="mt-choice documents")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"mt eval vs lm-eval (HFLM), fp32, 1 process, {torch.get_num_threads()} threads, "
          f"{date.today()}, load {os.getloadavg()[0]:.1f}")
    for name in args.shape or list(SHAPES):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            mt_ckpt, hf = write_models(root, SHAPES[name])
            task_file = write_task(root, args.docs)
            session = mt_session(mt_ckpt, args.batch_size)
            sides = {"mt": mt_side(session, task_file, args.batch_size),
                     "mt-harness": harness_side(session, task_file, args.batch_size),
                     "lm-eval": lm_eval_side(hf, task_file, args.batch_size)}
            for run in sides.values():
                run()  # warm-up
            times: dict[str, list[float]] = {side: [] for side in sides}
            count = {}
            for repeat in range(args.repeats):
                order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
                for side in order:
                    start = time.perf_counter()
                    count[side] = sides[side]()
                    times[side].append(time.perf_counter() - start)
            session.close()
            rates = {s: count[s] / min(t) for s, t in times.items()}
            for side, t in times.items():
                print(f"{name:>15} {side:>10}: {count[side]} requests, best {min(t):.2f} s, "
                      f"median {statistics.median(t):.2f} s, {rates[side]:,.0f} requests/s")
            print(f"{name:>15} mt / lm-eval: {rates['mt'] / rates['lm-eval']:.2f}x; "
                  f"mt-harness / lm-eval: {rates['mt-harness'] / rates['lm-eval']:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
