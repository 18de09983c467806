"""The correctness contract in CI, shard `fp32-a` of the CI matrix (contract_shards.py): each
case trained for 10 steps against the run it must equal (one process in the same precision;
with dropout the run at the same TP degree), comparing every step's loss, gradient norm and
learning rate, the validation loss and every final parameter (mt_pretrain.contract.runner)."""

from contract_shards import layout_test

test_layout_trains_like_its_reference = layout_test("fp32-a")
