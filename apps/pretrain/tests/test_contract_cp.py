"""The correctness contract in CI, shard `cp` of the CI matrix (contract_shards.py): the fp32
GPT-2 context-parallel rows (CP 4; CP 2 with TP 2, SP, recomputation and ZeRO-1; CP 2 with two
pipeline stages and keyed dropout), each trained for 10 steps against the run it must equal
(one process; with dropout the run at the same CP degree), comparing every step's loss,
gradient norm and learning rate, the validation loss and every final parameter
(mt_pretrain.contract.runner)."""

from contract_shards import layout_test

test_layout_trains_like_its_reference = layout_test("cp")
