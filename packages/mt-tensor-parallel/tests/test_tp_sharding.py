"""Pure slicing maths: divisibility errors, vocabulary padding, shard / merge round trips."""

from __future__ import annotations

import pytest
import torch

from mt_tensor_parallel import (
    PARAM_STYLES,
    check_divisibility,
    merge_shards,
    padded_vocab_size,
    shard_tensor,
    vocab_range,
)


def test_tp_check_divisibility_names_the_numbers() -> None:
    with pytest.raises(ValueError, match="n_heads 6 is not divisible by tp 4"):
        check_divisibility(tp=4, n_heads=6, hidden=96, ffn_hidden=384)
    with pytest.raises(ValueError) as info:
        check_divisibility(tp=4, n_heads=6, hidden=90, ffn_hidden=362, seq_len=10,
                           sequence_parallel=True)
    message = str(info.value)
    for text in ("n_heads 6", "hidden 90", "ffn_hidden 362", "seq_len 10", "tp 4"):
        assert text in message
    check_divisibility(tp=4, n_heads=8, hidden=96, ffn_hidden=384, seq_len=10)  # no SP: ok
    with pytest.raises(ValueError, match="tp must be a positive int"):
        check_divisibility(tp=0, n_heads=8, hidden=96)


def test_tp_padded_vocab_size() -> None:
    assert padded_vocab_size(50257, 8) == 51200  # MT-NLG's padded GPT-2 vocabulary
    assert padded_vocab_size(1001, 1) == 1024
    assert padded_vocab_size(1001, 4) == 1024
    assert padded_vocab_size(1025, 4) == 1536
    assert padded_vocab_size(1000, 2, pad_multiple=1) == 1000
    assert vocab_range(1024, 3, 4) == (768, 1024)
    with pytest.raises(ValueError, match="vocab_size 0"):
        padded_vocab_size(0, 2)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("style", PARAM_STYLES)
def test_tp_shard_merge_round_trip(style: str, tp: int) -> None:
    full = torch.randn(1001 if style == "vocab" else 24, 16)
    shards = [shard_tensor(style, full, r, tp) for r in range(tp)]
    merged = merge_shards(style, shards, vocab_size=1001 if style == "vocab" else None)
    torch.testing.assert_close(merged, full, rtol=0, atol=0)
    assert all(s.data_ptr() != full.data_ptr() for s in shards)  # copies, not views


def test_tp_column_qkv_layout() -> None:
    # rows 0..11 = [q (0-3); k (4-7); v (8-11)]; rank r of 2 holds [q_r; k_r; v_r].
    full = torch.arange(12.0).unsqueeze(1)
    local = shard_tensor("column_qkv", full, 1, 2).squeeze(1).tolist()
    assert local == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    bias = shard_tensor("column_qkv", torch.arange(12.0), 0, 2).tolist()
    assert bias == [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]


def test_tp_vocab_shards_pad_with_zero_rows() -> None:
    full = torch.ones(1001, 4)
    last = shard_tensor("vocab", full, 3, 4)
    assert last.shape == (256, 4)
    assert last[: 1001 - 768].eq(1).all() and last[1001 - 768:].eq(0).all()


def test_tp_row_and_meta_shapes() -> None:
    meta = torch.empty(48, 96, device="meta")
    assert shard_tensor("row", meta, 1, 4).shape == (48, 24)
    assert shard_tensor("row", meta, 1, 4).is_meta
    assert shard_tensor("column_qkv", meta, 0, 4).shape == (12, 96)
    assert shard_tensor("vocab", torch.empty(1001, 8, device="meta"), 0, 2).shape == (512, 8)


def test_tp_shard_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match="size 10 .* not divisible by tp 4"):
        shard_tensor("column", torch.zeros(10, 3), 0, 4)
    with pytest.raises(ValueError, match="tp_rank 4 is not in"):
        shard_tensor("row", torch.zeros(8, 8), 4, 4)
    with pytest.raises(ValueError, match="unknown parameter style 'diagonal'"):
        shard_tensor("diagonal", torch.zeros(8, 8), 0, 2)
