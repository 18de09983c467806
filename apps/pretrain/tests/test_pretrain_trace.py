"""--trace-collectives on a TP 2 + SP run (2 ranks, 3 micro-batches per step): every step's
collectives in the metrics (rank 0's) and in each rank's file, record by record, adding up;
the sequence-parallel all-gathers and reduce-scatters of every layer counted; and the
replicated parameters' gradients (LayerNorms, row-parallel biases, position rows) summed in
one all-reduce over TP per step, not one per parameter per micro-batch."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_pretrain

from mt_pretrain.config.load import load_config
from mt_pretrain.run.metrics import read_metrics

MICRO, STEPS = 3, 2
COMMON = {"model": "tiny", "seq_len": 32, "global_batch_size": 6, "micro_batch_size": 2,
          "tp": 2, "nproc": 2, "sequence_parallel": True, "train_steps": STEPS,
          "eval_interval": 0, "sample_tokens": 0, "progress": False, "save": "none",
          "trace_collectives": True}


def test_every_collective_of_a_step_is_traced(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_pretrain(COMMON, out, cache)
    gpt = load_config(None, {"model": "tiny", "seq_len": 32}).model.gpt_config()
    layers, hidden = gpt.n_layers, gpt.hidden
    # Per block two LayerNorms (weight, bias) and two row-parallel biases; ln_f; positions.
    replicated = (6 * layers * hidden + 2 * hidden + gpt.seq_len * hidden) * 4
    metrics = read_metrics(out / "metrics.jsonl")
    for rank in (0, 1):
        lines = [json.loads(x) for x in
                 (out / "collectives" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
        for line in lines:
            records = line["records"]
            assert line["collectives"] == len(records)
            assert line["comm_bytes"] == sum(r[2] for r in records)
            assert line["comm_exposed_s"] > 0
            kinds = line["by_kind"]
            # Every block: an all-gather before each column-parallel layer and a
            # reduce-scatter after each row-parallel one, forward and backward (reversed),
            # and in backward each column layer's input gathered again; the embedding's
            # reduce-scatter and the head's all-gather.
            per_micro = 4 * layers + 2
            assert kinds["all_gather_single tp"]["n"] == MICRO * (per_micro + 2 * layers), kinds
            assert kinds["reduce_scatter_single tp"]["n"] == MICRO * per_micro, kinds
            sums = [r for r in records if r[0] == "all_reduce" and r[1] == "tp"]
            assert [r[2] for r in sums].count(replicated) == 1, sums
            # The vocabulary-parallel loss's two per micro-batch, the replicated gradients'
            # bucket and the gradient norm's: nothing per replicated parameter.
            assert len(sums) == 2 * MICRO + 2, sums
            if rank == 0:
                metric = metrics[line["step"] - 1]
                assert metric["collectives"] == line["collectives"]
                assert metric["comm_exposed_s"] == line["comm_exposed_s"]


def test_the_bucket_size_sets_the_data_parallel_collectives(cache: Path, tmp_path: Path
                                                            ) -> None:
    """--bucket-numel reaches mt-zero: at DP 2 with ZeRO 1 each step reduces the gradients
    and gathers the updated weights (on gloo both as all-reduces) one bucket at a time."""
    import torch

    from mt_model import GPT
    from mt_zero import ZeroConfig

    assert load_config(None, {}).parallel.bucket_numel == ZeroConfig().bucket_numel
    size = 2**15
    out = tmp_path / "run"
    run_pretrain({**COMMON, "tp": 1, "sequence_parallel": False, "zero_stage": 1,
                  "global_batch_size": 8}, out, cache,
                 bucket_numel=size)
    gpt = load_config(None, {"model": "tiny", "seq_len": 32}).model.gpt_config()
    with torch.device("meta"):
        numels = [p.numel() for p in GPT(gpt).parameters()]
    total, largest = sum(numels), max(numels)
    for rank in (0, 1):
        for line in (out / "collectives" / f"rank-{rank:05d}.jsonl").read_text().splitlines():
            records = json.loads(line)["records"]
            # Beside the buckets only the loss mean and the norm's 2 numbers (8 bytes).
            bulk = [r[2] // 4 for r in records
                    if r[0] == "all_reduce" and r[1] == "dp" and r[2] > 8]
            half = len(bulk) // 2
            grads, weights = bulk[:half], bulk[half:]
            assert grads == weights, bulk  # the same buckets, reduced then gathered
            # Each bucket closes once it holds the size (padded to a multiple of dp 2), or
            # is one tensor larger than that (the embedding).
            assert all(n <= 2 * size or n <= largest + 1 for n in grads), grads
            assert total <= sum(grads) <= total + len(grads), (total, grads)
            assert len(grads) >= total // (2 * size) > 1, grads  # not one bucket of 2**22
