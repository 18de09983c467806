"""The rules ``ds_to_universal`` reads to join mt's tensor-parallel slices
(``mt_zero.deepspeed_universal``): each shard style to DeepSpeed's category, one exact
pattern per parameter; a style DeepSpeed cannot express refused. The rules at work, on a
TP 2 x PP 2 checkpoint converted by DeepSpeed's own tool:
tests/test_e2e_convert_deepspeed_pretrain.py."""

from __future__ import annotations

import re

import pytest

from mt_zero.deepspeed_universal import universal_checkpoint_info


def test_each_style_has_its_rule() -> None:
    styles = {"3.ln1.weight": "replicate", "3.attn.qkv.weight": "column_qkv",
              "3.attn.qkv.bias": "column_qkv", "3.attn.proj.weight": "row",
              "3.mlp.fc.weight": "column_pair", "3.mlp.up.weight": "column",
              "tied_modules.embed.inner.tokens.weight": "vocab"}
    shapes = {name: (8, 4) if name.endswith("weight") else (8,) for name in styles}
    info = universal_checkpoint_info(styles, shapes, vocab_size=1000, padded_vocab_size=1024)
    assert info["tp_replicated_parameter_patterns"] == [r"3\.ln1\.weight$"]
    assert info["parameter_with_row_parallelism_patterns"] == [r"3\.attn\.proj\.weight$"]
    assert info["parameter_with_2_sub_params_cat_dim_0"] == [r"3\.mlp\.fc\.weight$"]
    assert info["vocabulary_parameter_patterns"] == [
        r"tied_modules\.embed\.inner\.tokens\.weight$"]
    assert info["parameter_with_sub_params"] == [
        {"patterns": [r"3\.attn\.qkv\.bias$"], "shape": (3,), "partition_dim": 0},
        {"patterns": [r"3\.attn\.qkv\.weight$"], "shape": (3, -1), "partition_dim": 0}]
    assert (info["original_vocab_size"], info["padded_vocab_size"]) == (1000, 1024)
    everything = [p for key, value in info.items() if key.endswith("patterns")
                  or key.endswith("cat_dim_0") for p in value]
    # Exact patterns: block 3's rule never matches block 13's parameter (re.match anchors
    # the start, the pattern the end).
    assert not any(re.match(p, "13.ln1.weight") for p in everything)


def test_a_style_deepspeed_cannot_join_is_refused() -> None:
    with pytest.raises(ValueError, match=r"3\.attn\.kv\.weight: shard style 'kv_replicated'"):
        universal_checkpoint_info({"3.attn.kv.weight": "kv_replicated"}, {"3.attn.kv.weight":
                                  (8, 4)}, 1000, 1024)
