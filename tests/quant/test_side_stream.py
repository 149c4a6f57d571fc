"""LoRA's x @ A.T beside the base GEMM (qerl.quant.side_stream): the switch, the in-line path off CUDA, and on a GPU
the same outputs as in line, eagerly and replayed from a CUDA graph after its inputs changed in place."""
from __future__ import annotations

import pytest
import torch

from qerl.errors import QerlError
from qerl.quant import side_stream
from qerl.quant.dispatch import check_kernel_environment, run_fp4_matmul
from qerl.quant.grouped import _dense_lora_op, block_diagonal


def test_the_switch_is_checked_with_the_other_kernel_switches():
    assert side_stream.overlap_mode({}) == "auto"
    assert side_stream.overlap_mode({"QERL_LORA_OVERLAP": "0"}) == "0"
    with pytest.raises(QerlError, match="QERL_LORA_OVERLAP"):
        check_kernel_environment({"QERL_LORA_OVERLAP": "sometimes"})


def test_off_cuda_it_runs_in_line():
    x = torch.randn(5, 8, dtype=torch.float64)
    w = torch.randn(3, 8, dtype=torch.float64)
    calls = []

    def compute(out):
        calls.append("shrink")
        torch.matmul(x, w.T, out=out)

    base, out = side_stream.around(lambda: calls.append("gemm") or "base", compute, (5, 3), x)
    assert calls == ["shrink", "gemm"] and base == "base"  # both done, in order, before around returned
    assert out.shape == (5, 3) and out.dtype == x.dtype
    torch.testing.assert_close(out, x @ w.T, rtol=0, atol=0)


def _dense_reference(x, w, a, b, scale, sizes):
    """float64: x @ W.T + scale * (x @ A_i.T) @ B_i.T on each member's slice of the output."""
    x, w, a, b = (t.double() for t in (x, w, a, b))
    out = x @ w.T
    r, start = b.shape[1], 0
    for i, size in enumerate(sizes):
        out[:, start:start + size] += scale * (x @ a[i * r:(i + 1) * r].T) @ b[start:start + size].T
        start += size
    return out


@pytest.mark.parametrize("rows", [3, 64, 200])
def test_dense_op_matches_float64_on_cpu(rows):
    g = torch.Generator().manual_seed(rows)
    sizes, k, r = [48, 16, 16], 64, 4
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(sum(sizes), k, generator=g) / 8
    a = torch.randn(r * len(sizes), k, generator=g) / 8
    b = torch.randn(sum(sizes), r, generator=g)
    out = _dense_lora_op(x, w, None, a, b, 0.5, 48, 64, block_diagonal(b, sizes))
    torch.testing.assert_close(out.double(), _dense_reference(x, w, a, b, 0.5, sizes), rtol=1e-5, atol=1e-5)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _close(out, ref):
    """Equal up to the base GEMM's own run-to-run differences (humming's and cuBLAS's split-K may reduce in any
    order); a missing, stale or doubled LoRA term is ~10% of the output here."""
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < 1e-2, err


def _graph(fn):
    """fn() warmed up once, then captured; returns (graph, its output)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 64, 128, 200])
def test_humming_lora_beside_equals_in_line_and_replays(rows, monkeypatch):
    """Stacked q|k|v-like weights with LoRA on humming's path (x @ A.T on our kernel to 128 rows, cuBLAS at 200):
    beside the GEMM gives the in-line result, and a captured call replays with new x and a new B."""
    from qerl.quant.kernels import humming_fp4

    _cuda()
    if not humming_fp4.available(torch.device("cuda")):
        pytest.skip("needs humming-kernels")
    from qerl.quant.format import quantize_nvfp4

    sizes, k, r = [512, 128, 128], 1024, 16
    g = torch.Generator(device="cuda").manual_seed(rows)
    dense = torch.randn(sum(sizes), k, device="cuda", generator=g)
    wp, ws, gs = quantize_nvfp4(dense)
    gs = gs.reshape(1).repeat(3)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    a = (torch.randn(3 * r, k, device="cuda", generator=g) / 16).bfloat16()
    b = torch.randn(sum(sizes), r, device="cuda", generator=g).bfloat16()

    def call():
        return run_fp4_matmul(x, wp, ws, gs, None, a, b, 0.5, segments=sizes, kernel="humming")

    monkeypatch.setenv("QERL_LORA_OVERLAP", "0")
    in_line = call()
    monkeypatch.setenv("QERL_LORA_OVERLAP", "1")
    _close(call(), in_line)
    graph, out = _graph(call)
    x.copy_(torch.randn(x.shape, device="cuda", generator=g))
    b.copy_(torch.randn(b.shape, device="cuda", generator=g))
    graph.replay()
    monkeypatch.setenv("QERL_LORA_OVERLAP", "0")
    want = call()
    _close(out, want)
    with pytest.raises(AssertionError):  # the check sees the new B
        _close(want, in_line)
    humming_fp4.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 256])
def test_dense_lora_beside_equals_in_line_and_replays(rows, monkeypatch):
    _cuda()
    sizes, k, r = [256, 64, 64], 512, 8
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(sum(sizes), k, device="cuda", generator=g) / 16).bfloat16()
    a = (torch.randn(3 * r, k, device="cuda", generator=g) / 16).bfloat16()
    b = torch.randn(sum(sizes), r, device="cuda", generator=g).bfloat16()
    diag = block_diagonal(b, sizes)

    def call():
        return _dense_lora_op(x, w, None, a, b, 0.5, 256, 320, diag)

    monkeypatch.setenv("QERL_LORA_OVERLAP", "0")
    in_line = call()
    err = (in_line.double() - _dense_reference(x, w, a, b, 0.5, sizes)).abs().max()
    assert err < 0.05 * in_line.double().abs().max()  # bf16 operands and output
    monkeypatch.setenv("QERL_LORA_OVERLAP", "1")
    _close(call(), in_line)
    graph, out = _graph(call)
    x.copy_(torch.randn(x.shape, device="cuda", generator=g))
    graph.replay()
    monkeypatch.setenv("QERL_LORA_OVERLAP", "0")
    _close(out, call())
