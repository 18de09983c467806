"""``decoding_layout_``: a model laid out for decoding on CPU computes what it computed before
(fp32 round-off), leaves its parameters untouched, never serves a weight it copied after
that weight changed, and trains as before (autograd never takes the packed copies).

On x86 builds of torch (oneDNN) every projection and the output head get a
:class:`PackedWeight`; elsewhere the weights are stored input-major instead. Both are checked:
the second by forcing ``PackedWeight.of`` to decline.
"""

from __future__ import annotations

import pytest
import torch

from mt_model import GPT, GPTConfig, Sampling, decoding_layout_, generate
from mt_model.gpt import Linear, PackedWeight

CONFIGS = {
    "gpt2": GPTConfig(2, 64, 4, 97, 48),
    "llama": GPTConfig(2, 64, 4, 97, 48, ffn_hidden=80, n_kv_heads=2, position="rope",
                       norm="rmsnorm", mlp="swiglu", bias=False, tied_embeddings=False),
}
PROMPTS = [[5, 9, 14], [1, 2, 3, 4, 5, 6, 7], [42, 17, 8, 90, 33]]
ONEDNN = torch.backends.mkldnn.is_available()


def _laid_out(name: str, packed: bool, monkeypatch: pytest.MonkeyPatch) -> GPT:
    model = GPT(CONFIGS[name], seed=3).eval()
    if not packed:
        monkeypatch.setattr(PackedWeight, "of", staticmethod(lambda weight: None))
    return decoding_layout_(model)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "input-major"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_tokens_are_unchanged(name: str, packed: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    plain = GPT(CONFIGS[name], seed=3).eval()
    model = _laid_out(name, packed, monkeypatch)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all((m.packed is not None) == (packed and ONEDNN) for m in linears)
    assert (model.head.packed is not None) == (packed and ONEDNN)
    for (key, want), got in zip(plain.state_dict().items(), model.state_dict().values(),
                                strict=True):
        assert torch.equal(got, want), key  # the parameters keep their values
    with torch.no_grad():
        for rows in (1, 16, 100):  # one token, a decoded batch, a prefill / scoring
            ids = torch.randint(0, 97, (rows, 7), generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(model(ids), plain(ids), rtol=1e-5, atol=1e-5)
    rule = Sampling(max_new_tokens=12)
    want_out, got_out = generate(plain, PROMPTS, rule), generate(model, PROMPTS, rule)
    assert [c.tokens for c in got_out] == [c.tokens for c in want_out]
    for got_c, want_c in zip(got_out, want_out, strict=True):
        assert got_c.logprobs == pytest.approx(want_c.logprobs, abs=1e-5)


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN: nothing is packed")
def test_a_changed_weight_is_packed_again() -> None:
    model = decoding_layout_(GPT(CONFIGS["gpt2"], seed=3).eval())
    other = GPT(CONFIGS["gpt2"], seed=4).eval()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        before = model(ids)
        model.load_state_dict(other.state_dict())  # in place: version counters move
        torch.testing.assert_close(model(ids), other(ids), rtol=1e-5, atol=1e-5)
        fc = model.blocks[0].mlp.fc
        fc.weight.data = torch.zeros_like(fc.weight)  # new storage
        other.blocks[0].mlp.fc.weight.data.zero_()
        torch.testing.assert_close(model(ids), other(ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, model(ids).detach())


def test_training_after_the_layout_takes_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = GPT(CONFIGS["llama"], seed=3)
    model = decoding_layout_(GPT(CONFIGS["llama"], seed=3))
    ids = torch.tensor([PROMPTS[1]])
    for m in (plain, model):
        m(ids[:, :-1], ids[:, 1:]).backward()
    for (key, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert b.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-6), key
