"""The end-of-training sample decodes with mt-model's key/value cache and gives what a full
forward per token gives (argmax of the last position, the context cut to seq_len)."""

from __future__ import annotations

import torch

from mt_model import GPT, GPTConfig
from mt_pretrain.run.sample import greedy_generate


def _uncached(model: GPT, ids: list[int], new: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


def test_sample_equals_full_forward_argmax() -> None:
    model = GPT(GPTConfig(2, 32, 4, 97, 24), seed=1).eval()
    assert greedy_generate(model, [3, 1, 4, 1, 5], 12) == _uncached(model, [3, 1, 4, 1, 5], 12)
    long = list(range(30))  # prompt + budget past seq_len: the prompt's tail is the context
    out = greedy_generate(model, long, 10)
    assert out[:30] == long and out[30:] == _uncached(model, long[-14:], 10)[14:]
    assert len(greedy_generate(model, [], 40)) == 23  # at most seq_len - 1 new tokens
