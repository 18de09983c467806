"""The correctness contract in CI, shard `bf16-a` of the CI matrix (contract_shards.py): each
case trained for 10 steps against the run it must equal (one process in the same precision;
with dropout the run at the same TP degree), comparing every step's loss, gradient norm and
learning rate, the validation loss and every final parameter (mt_pretrain.contract.runner)."""

from contract_shards import floor_test, layout_test

test_noise_floor_measured_here_is_honest = floor_test("bf16")
test_layout_trains_like_its_reference = layout_test("bf16-a")
