"""Grouped-query decode attention vs float64 attention over explicitly repeated KV heads."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from qerl.rollout.attention import attention_implementation, decode_attention
from tests.rollout.interpreted import run_interpreted


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


def _decode_case(b, heads, kv_heads, length, d, seed, dtype=torch.bfloat16):
    """A one-token decode step on CUDA: left-padded prompts, a filled prefix of varying length per row, the rest
    of the static cache masked out (whole blocks of it)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, heads, 1, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, kv_heads, length, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    keep = torch.rand(b, length, device="cuda", generator=gen) > 0.2
    filled = torch.randint(1, length + 1, (b,), device="cuda", generator=gen)
    pad = (torch.rand(b, device="cuda", generator=gen) * filled * 0.5).long()
    cols = torch.arange(length, device="cuda")
    keep &= (cols[None] < filled[:, None]) & (cols[None] >= pad[:, None])
    keep[torch.arange(b), filled - 1] = True  # the current token
    return q, k, v, keep


def test_kernel_check_is_a_constant_to_torch_compile(monkeypatch):
    """The device check of the fused path (find_spec, capability, SM count) compiles without a graph break:
    torch 2.11 cannot trace find_spec, and the break in every attention layer split the decode graph."""
    from qerl.rollout import attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _dev=None: (9, 0))
    monkeypatch.setattr(attention, "target_programs", lambda _dev: 264)
    attention._triton_ok.cache_clear()
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda x: x + attention._kernel_programs(0), fullgraph=True)
        expected = 264 if importlib.util.find_spec("triton") else 0
        assert fn(torch.zeros(2)).tolist() == [expected, expected]
    finally:
        attention._triton_ok.cache_clear()
        torch._dynamo.reset()


INTERPRETED = """
from tests.rollout.test_attention import _reference
from qerl.rollout.triton_attention import gqa_decode_attention
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(*shape, generator=gen) for shape in ((3, 4, 1, 16), (3, 2, 150, 16), (3, 2, 150, 16)))
keep = torch.rand(3, 150, generator=gen) > 0.3
keep[1, 70:] = False  # a row that ends early: its later blocks are never read
errors = [float((gqa_decode_attention(q, k, v, keep, 0.25, split=s).double()
                 - _reference(q, k, v, keep[:, None, None, :], 0.25)).abs().max()) for s in (1, 2, 5)]
print(json.dumps(errors))
"""


def test_interpreted_static_kernel_matches_float64_attention():
    """The static-cache kernel on CPU through Triton's interpreter: one split, and splits merged by the combine
    kernel, some of them empty."""
    assert max(run_interpreted(INTERPRETED)) < 1e-5


@pytest.mark.gpu
def test_triton_kernel_with_programmatic_dependent_launch(monkeypatch):
    """QERL_PDL=1: the kernels wait for the kernel that wrote q/k/v (and the combine for the splits) - the bits of
    the plain launches, directly after a torch kernel that produced the query."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs sm_90")
    from qerl.rollout.triton_attention import gqa_decode_attention

    q, k, v, keep = _decode_case(8, 28, 4, 1281, 128, seed=5)
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("QERL_PDL", pdl)
        outs[pdl] = [gqa_decode_attention(q * 1.5, k, v, keep, 0.1, split=s) for s in (1, 7)]
    for a, b in zip(outs["0"], outs["1"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,d", [(28, 4, 128), (40, 8, 128), (8, 8, 64), (12, 2, 64)])
@pytest.mark.parametrize("b,length", [(1, 37), (3, 300), (64, 1281)])
def test_triton_kernel_matches_float64(heads, kv_heads, d, b, length):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qerl.rollout.triton_attention import gqa_decode_attention

    q, k, v, keep = _decode_case(b, heads, kv_heads, length, d, seed=heads + length)
    ref = _reference(q, k, v, keep[:, None, None, :], d ** -0.5)
    def rel_err(out):  # per (row, head): outputs are averages of many values, so compare against their norm
        err = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
        return err.max().item()

    for split in (None, 1, 3, 10_000):
        out = gqa_decode_attention(q, k, v, keep, d ** -0.5, split=split)
        assert out.shape == (b, 1, heads, d) and out.dtype == q.dtype
        assert rel_err(out) < 1e-2, f"split {split}: {rel_err(out):.2e}"
    # the transformers entry point, forced onto the kernel
    os.environ["QERL_DECODE_ATTENTION"] = "triton"
    try:
        out, _ = decode_attention(None, q, k, v, keep[:, None, None, :])
    finally:
        os.environ.pop("QERL_DECODE_ATTENTION")
    assert rel_err(out) < 1e-2


@pytest.mark.gpu
def test_fused_path_is_taken_only_where_it_applies(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qerl.rollout import attention

    rows = torch.cuda.get_device_properties(0).multi_processor_count // 4  # one program per SM with 4 KV heads
    q, k, v, keep = _decode_case(rows, 28, 4, 70, 128, seed=0)
    mask = keep[:, None, None, :]
    assert attention._fused_decode(q, k, v, mask)
    assert not attention._fused_decode(q[:rows - 1], k[:rows - 1], v[:rows - 1], mask[:rows - 1])  # too few rows
    assert not attention._fused_decode(q.float(), k.float(), v.float(), mask)  # fp32: torch path
    assert not attention._fused_decode(q, k, v, torch.zeros(mask.shape, device="cuda"))  # additive mask
    monkeypatch.setenv("QERL_DECODE_ATTENTION", "torch")
    assert not attention._fused_decode(q, k, v, mask)
