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
            # reduce-scatter after each row-parallel one, forward and backward (reversed);
            # the embedding's reduce-scatter and the head's all-gather.
            per_micro = 4 * layers + 2
            assert kinds["all_gather_single tp"]["n"] == MICRO * per_micro, kinds
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
