"""qerl.quant.kernels.humming_fp4: humming-kernels reading our packed NVFP4 tensors (GPU tests; skipped without
CUDA or without the humming-kernels package)."""
from __future__ import annotations

import pytest
import torch

from qerl.quant.dispatch import run_fp4_matmul
from qerl.quant.format import dequantize_nvfp4, quantize_nvfp4
from qerl.quant.grouped import block_diagonal
from qerl.quant.reference import reference_fp4_lora_matmul

pytestmark = pytest.mark.gpu


def _humming():
    from qerl.quant.kernels import humming_fp4

    if not torch.cuda.is_available() or not humming_fp4.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU (sm_80+) and humming-kernels")
    return humming_fp4


def _weights(sizes, k, seed=0, shared_scale=False):
    """Stacked NVFP4 weights: one quantized tensor per segment (its own global scale unless shared_scale)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dense = [torch.randn(n, k, device="cuda", generator=g) * (1 + i) for i, n in enumerate(sizes)]
    gs = None
    if shared_scale:  # as llmcompressor's fused q/k/v and gate/up global scales
        gs = quantize_nvfp4(torch.cat(dense))[2]
    parts = [quantize_nvfp4(w, gs) for w in dense]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
            torch.cat([p[2].reshape(1) for p in parts]))


def test_codes_and_group_scales_are_read_bit_for_bit():
    """With global scale 1 humming's dequantized weight is ours exactly; with a real one, within one float32 ulp
    (humming multiplies by the reciprocal, we divide)."""
    hf = _humming()
    wp, ws, gs = _weights([256], 512, seed=1)
    one = torch.ones_like(gs)
    assert torch.equal(hf.dequantize_humming(wp, ws, one), dequantize_nvfp4(wp, ws, one, dtype=torch.float32))
    hf.clear()
    ours = dequantize_nvfp4(wp, ws, gs, dtype=torch.float32)
    torch.testing.assert_close(hf.dequantize_humming(wp, ws, gs), ours, rtol=5e-7, atol=0)
    hf.clear()


@pytest.mark.parametrize("rows", [17, 64, 200, 512])
@pytest.mark.parametrize("case", ["one", "stacked-shared", "stacked-own", "lora-bias", "stacked-lora-diag"])
def test_forward_matches_float64_reference(rows, case):
    """stacked-lora-diag: q|k|v-like segments with their own global scales, LoRA A stacked per segment and B given
    block-diagonally too (one cuBLAS GEMM adds every segment's product)."""
    hf = _humming()
    sizes = [512] if case in ("one", "lora-bias") else [512, 128, 128]
    k = 1024
    wp, ws, gs = _weights(sizes, k, seed=rows, shared_scale=case == "stacked-shared")
    if len(sizes) == 1:
        gs = gs[:1]
    n = sum(sizes)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = lora_a = lora_b = diag = None
    if case in ("lora-bias", "stacked-lora-diag"):
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        lora_a = torch.randn(8 * len(sizes), k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        lora_b = torch.randn(n, 8, device="cuda", dtype=torch.bfloat16)
    if case == "stacked-lora-diag":
        diag = block_diagonal(lora_b, sizes)
    segments = sizes if len(sizes) > 1 else None
    out = run_fp4_matmul(x, wp, ws, gs, bias, lora_a, lora_b, 0.5, segments=segments, kernel="humming",
                         lora_b_diag=diag)
    if lora_a is not None:
        ref = reference_fp4_lora_matmul(x.double(), wp, ws, gs, bias.double(), lora_a.double(), lora_b.double(), 0.5,
                                        segments)
    else:  # each segment dequantized with its own global scale
        ref = x.double() @ torch.cat([dequantize_nvfp4(wp[a:b], ws[a:b], gs.reshape(-1)[i], dtype=torch.float64)
                                      for i, (a, b) in enumerate(_bounds(sizes))]).T
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # bf16 rounding of the output and of the LoRA term (2^-8 each) plus, for stacked weights with their own global scales, the reciprocal scales
    # held per channel in bf16 (another 2^-9)
    tol = 1.6e-2 if case in ("stacked-own", "stacked-lora-diag") else 1.2e-2
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < tol, err
    hf.clear()


def _bounds(sizes):
    start = 0
    for s in sizes:
        yield start, start + s
        start += s


def _close(out, ref):
    """Two bf16 GEMMs of the same weights: within a few bf16 roundings of the output's scale."""
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < 2e-2, err


def test_auto_uses_only_prebuilt_copies_and_the_engine_builds_them(monkeypatch):
    """QERL_FP4_HUMMING=auto never allocates a copy inside a forward: without one the rows go to our kernels;
    attach_humming_copies gives every FP4 layer (and group) its copy, after which the same call runs on humming."""
    hf = _humming()
    from qerl.quant import dispatch
    from qerl.quant.humming_copies import attach_humming_copies, humming_copy_bytes
    from qerl.quant.linear import FP4Linear

    monkeypatch.delenv("QERL_FP4_HUMMING", raising=False)
    layer = FP4Linear.from_linear(torch.nn.Linear(1024, 768, bias=False).cuda())
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(hf, "fp4_matmul_humming", lambda *a, **k: calls.append(1))
    dispatch.run_fp4_matmul(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    assert not calls and not hf.has_copy(layer.weight_packed) and hf.copies_nbytes() == 0
    model = torch.nn.Sequential(layer)
    need = humming_copy_bytes(model)
    assert attach_humming_copies(model) >= need * 0.9 and hf.has_copy(layer.weight_packed)
    dispatch.run_fp4_matmul(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    assert calls == [1]
    hf.clear()


def test_background_compile_prefill_on_our_kernels_decode_steps_wait_for_humming(monkeypatch):
    """attach_humming_copies(background=True) returns before humming's kernels are compiled: a forward outside a
    decode step takes our kernels meanwhile, one inside a decode step's warm-up waits and runs humming (what a
    synchronously attached copy gives); wait_pending leaves nothing compiling."""
    hf = _humming()
    import threading

    from qerl.quant import dispatch
    from qerl.quant.humming_copies import attach_humming_copies
    from qerl.quant.kernels.device import decode_step_launches
    from qerl.quant.linear import FP4Linear

    monkeypatch.delenv("QERL_FP4_HUMMING", raising=False)
    layer = FP4Linear.from_linear(torch.nn.Linear(1024, 768, bias=False).cuda())
    ops = (layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    attach_humming_copies(torch.nn.Sequential(layer))
    want = dispatch.run_fp4_matmul(x, *ops, kernel="humming")
    hf.clear()
    gate = threading.Event()
    real = hf.HummingWeight.prepare

    def held(self, background=False):  # "compiling" until the decode step below has started waiting
        gate.wait(30)
        return real(self, background)

    monkeypatch.setattr(hf.HummingWeight, "prepare", held)
    monkeypatch.setattr(hf, "_JOBS_DONE", set())  # as in a fresh process: the compile goes to the background
    attach_humming_copies(torch.nn.Sequential(layer), background=True)
    assert hf.has_copy(layer.weight_packed) and not hf.copy_ready(layer.weight_packed)
    kernels = []
    launch = dispatch._launch_forward
    monkeypatch.setattr(dispatch, "_launch_forward", lambda kernel, *a: kernels.append(kernel) or launch(kernel, *a))
    prefill = dispatch.run_fp4_matmul(x, *ops)
    threading.Timer(0.2, gate.set).start()
    with decode_step_launches():
        decode = dispatch.run_fp4_matmul(x, *ops)
    assert kernels == ["triton", "humming"] and hf.copy_ready(layer.weight_packed) and not hf._PENDING
    _close(decode, want)  # not bit for bit: two calls of the same copy differed by ~1e-3 relative (H200)
    _close(prefill, want)
    hf.clear()


def test_graph_replay_and_in_place_weight_updates():
    """A captured humming matmul replays with new inputs; a weight changed in place is seen after refresh_stale
    (the engines call it before each rollout), through the same addresses."""
    hf = _humming()
    wp, ws, gs = _weights([768], 1024, seed=3)
    gs = gs[:1]
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    run_fp4_matmul(x, wp, ws, gs, kernel="humming")  # builds the copy and compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_fp4_matmul(x, wp, ws, gs, kernel="humming")
    x.copy_(torch.randn_like(x))
    graph.replay()
    _close(out, run_fp4_matmul(x, wp, ws, gs, kernel="triton"))
    wp2, ws2, _ = _weights([768], 1024, seed=4)
    wp.copy_(wp2)
    ws.copy_(ws2)
    assert hf.refresh_stale() == 1 and hf.refresh_stale() == 0
    graph.replay()
    _close(out, run_fp4_matmul(x, wp, ws, gs, kernel="triton"))
    assert hf.copies_nbytes() > 0
    hf.clear()
    assert hf.copies_nbytes() == 0
