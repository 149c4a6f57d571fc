"""Grouped-query decode attention vs float64 attention over explicitly repeated KV heads."""
from __future__ import annotations

import pytest
import torch

from qerl.rollout.attention import attention_implementation, decode_attention


def _reference(q, k, v, keep, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1).double(), v.repeat_interleave(g, dim=1).double()  # transformers' repeat_kv
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,t", [(28, 4, 1), (28, 4, 3), (8, 8, 1), (6, 1, 2)])
@pytest.mark.parametrize("additive", [False, True])
def test_matches_repeated_kv_reference(heads, kv_heads, t, additive):
    gen = torch.Generator().manual_seed(heads * 10 + t)
    b, length, d = 3, 37, 16
    q = torch.randn(b, heads, t, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, length, d, generator=gen) for _ in range(2))
    keep = torch.rand(b, 1, t, length, generator=gen) > 0.3
    keep[..., 0] = True  # every query attends to something
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min) if additive else keep
    out, weights = decode_attention(None, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (b, t, heads, d)
    torch.testing.assert_close(out.double(), _reference(q, k, v, keep, 0.25), rtol=1e-5, atol=1e-5)


def test_unsupported_features_and_context_restores_the_setting():
    q, kv = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(NotImplementedError, match="sliding window"):
        decode_attention(None, q, kv, kv, None, sliding_window=2)

    class Cfg:
        _attn_implementation = "sdpa"

    class Model:
        config = Cfg()

    model = Model()
    with attention_implementation(model):
        assert model.config._attn_implementation == "qerl_decode"
    assert model.config._attn_implementation == "sdpa"
