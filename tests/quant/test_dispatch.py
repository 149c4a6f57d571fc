"""qerl.quant.dispatch.choose_kernel, the one rule that picks the FP4 kernel, pinned as a table (no GPU needed)."""
from __future__ import annotations

import functools

import pytest
import torch

from qerl.errors import QerlError
from qerl.quant import dispatch
from qerl.quant.dispatch import (AUTO_ROWS, DENSE_MIN_ROWS, EXPAND_MAX_RANK, EXPAND_MAX_ROWS, HUMMING_MAX_ROWS,
                                 HUMMING_MIN_ROWS, SMALL_MM_MAX_ROWS, TMA_DENSE_MIN_ROWS, choose_kernel)
from qerl.quant.format import quantize_nvfp4
from qerl.quant.kernels.cuda_fp4 import MAX_ROWS
from qerl.quant.reference import reference_fp4_matmul, reference_fp4_matmul_t

H100, ADA, A100 = (9, 0), (8, 9), (8, 0)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (op, device, capability, rows, facts, QERL_FP4_CUDA or None for unset, kernel)
TABLE = [
    ("forward", "cpu", (0, 0), 1, {}, None, "reference"),
    ("forward", "cpu", (0, 0), 1, {}, "1", "reference"),
    ("backward", "cpu", (0, 0), 300, {}, None, "reference"),
    ("forward", "cuda", H100, 1, {"triton": False}, None, "reference"),
    ("forward", "cuda", H100, 1, {"nvfp4": False}, None, "reference"),  # MXFP4
    ("backward", "cuda", H100, 1, {"nvfp4": False}, None, "reference"),
    ("forward", "cuda", A100, 1, {}, None, "reference"),
    ("backward", "cuda", A100, 300, {}, None, "reference"),
    # the hand-written CUDA kernel: auto = up to AUTO_ROWS on sm_90+, "1" = up to MAX_ROWS from sm_89
    ("forward", "cuda", H100, 1, {}, None, "cuda"),
    ("forward", "cuda", H100, AUTO_ROWS, {}, "auto", "cuda"),
    ("forward", "cuda", H100, AUTO_ROWS + 1, {}, None, "triton"),
    ("forward", "cuda", H100, AUTO_ROWS + 1, {}, "1", "cuda"),
    ("forward", "cuda", H100, MAX_ROWS, {}, "1", "cuda"),
    ("forward", "cuda", H100, MAX_ROWS + 1, {}, "1", "triton"),
    ("forward", "cuda", ADA, 1, {}, None, "triton"),
    ("forward", "cuda", ADA, 1, {}, "1", "cuda"),
    ("forward", "cuda", H100, 1, {}, "0", "triton"),
    ("forward", "cuda", H100, 1, {"dtype": FP16}, None, "triton"),
    ("forward", "cuda", H100, 1, {"dtype": FP32}, "1", "triton"),
    ("forward", "cuda", H100, 1, {"cuda_fits": False}, None, "triton"),
    ("forward", "cuda", H100, 1, {"cuda_fits": False}, "1", "triton"),
    ("forward", "cuda", H100, 1, {"cuda_builds": False}, None, "triton"),  # auto: no compiler -> Triton
    ("forward", "cuda", H100, 1, {"cuda_builds": False}, "1", "cuda"),  # "1": the build error raises later
    # Triton's fused kernel; on sm_90+ with bf16/fp16 x its TMA tiles up to TMA_DENSE_MIN_ROWS - 1 rows,
    # elsewhere up to DENSE_MIN_ROWS - 1; then dequantize + cuBLAS
    ("forward", "cuda", H100, 64, {}, None, "triton"),
    ("forward", "cuda", H100, 128, {}, None, "triton"),
    ("forward", "cuda", H100, 128, {"dtype": FP16}, None, "triton"),
    ("forward", "cuda", H100, TMA_DENSE_MIN_ROWS - 1, {}, None, "triton"),
    ("forward", "cuda", H100, TMA_DENSE_MIN_ROWS, {}, None, "dense"),
    ("forward", "cuda", H100, DENSE_MIN_ROWS - 1, {"dtype": FP32}, None, "triton"),
    ("forward", "cuda", H100, DENSE_MIN_ROWS, {"dtype": FP32}, None, "dense"),
    ("forward", "cuda", ADA, DENSE_MIN_ROWS - 1, {}, None, "triton"),
    ("forward", "cuda", ADA, DENSE_MIN_ROWS, {}, None, "dense"),
    ("forward", "cuda", ADA, 4096, {"dtype": FP32}, "0", "dense"),
    ("backward", "cuda", H100, 1, {}, None, "triton"),
    ("backward", "cuda", H100, 1, {}, "1", "triton"),  # no CUDA kernel for grad_input
    ("backward", "cuda", H100, DENSE_MIN_ROWS - 1, {}, None, "triton"),
    ("backward", "cuda", H100, DENSE_MIN_ROWS, {}, None, "dense"),
    ("backward", "cuda", H100, 1, {"k_ok": False}, None, "dense"),  # K % 64: the fused grad_input's tile
    # x @ A.T: Triton for few rows and a narrow w in bf16/fp16, on any CUDA GPU
    ("small", "cuda", A100, 1, {"n": 96}, None, "triton"),
    ("small", "cuda", H100, SMALL_MM_MAX_ROWS, {"n": 256, "dtype": FP16}, None, "triton"),
    ("small", "cuda", H100, SMALL_MM_MAX_ROWS + 1, {"n": 96}, None, "reference"),
    ("small", "cuda", H100, 8, {"n": 257}, None, "reference"),
    ("small", "cuda", H100, 8, {"n": 96, "dtype": FP32}, None, "reference"),
    ("small", "cuda", H100, 8, {"n": 96, "w_dtype": FP32}, None, "reference"),
    ("small", "cuda", H100, 8, {"n": 96, "triton": False}, None, "reference"),
    ("small", "cpu", (0, 0), 8, {"n": 96}, None, "reference"),
    # LoRA's B product (n: xa's columns, segments x r): one Triton pass up to EXPAND_MAX_ROWS, any CUDA GPU
    ("expand", "cuda", A100, 1, {"n": 96}, None, "triton"),
    ("expand", "cuda", H100, EXPAND_MAX_ROWS, {"n": EXPAND_MAX_RANK, "dtype": FP16}, None, "triton"),
    ("expand", "cuda", H100, EXPAND_MAX_ROWS + 1, {"n": 96}, None, "reference"),
    ("expand", "cuda", H100, 64, {"n": EXPAND_MAX_RANK + 1}, None, "reference"),
    ("expand", "cuda", H100, 64, {"n": 96, "dtype": FP32}, None, "reference"),
    ("expand", "cuda", H100, 64, {"n": 96, "w_dtype": FP32}, None, "reference"),
    ("expand", "cuda", H100, 64, {"n": 96, "triton": False}, None, "reference"),
    ("expand", "cpu", (0, 0), 64, {"n": 96}, None, "reference"),
]


@pytest.mark.parametrize("op,device,cap,rows,facts,env,kernel", TABLE)
def test_the_rule_as_a_table(op, device, cap, rows, facts, env, kernel):
    environ = {} if env is None else {"QERL_FP4_CUDA": env}
    assert choose_kernel(op, device, cap, rows, environ=environ, **facts) == kernel


# humming-kernels (fact `humming`: it imports and the shape fits): (capability, rows, facts, QERL_FP4_HUMMING, kernel)
HUMMING_TABLE = [
    (H100, HUMMING_MIN_ROWS, {}, None, "humming"),
    (H100, HUMMING_MAX_ROWS, {}, "auto", "humming"),
    (H100, HUMMING_MIN_ROWS - 1, {}, None, "triton"),  # below: ours (few-row CUDA / Triton kernels)
    (H100, AUTO_ROWS, {}, None, "cuda"),
    (H100, HUMMING_MAX_ROWS + 1, {}, None, "dense"),  # above: dequantize + cuBLAS
    (H100, 64, {"dtype": FP16}, None, "humming"),
    (H100, 64, {"dtype": FP32}, None, "triton"),  # bf16/fp16 activations only
    (H100, 64, {}, "0", "triton"),
    (H100, 64, {"humming": False}, None, "triton"),  # not installed, or N % 64 / K % 128
    (H100, 64, {"humming": False}, "1", "triton"),
    (H100, 4096, {}, "1", "humming"),  # "1": every row count the CUDA kernel does not take
    (H100, 1, {}, "1", "cuda"),
    (A100, 64, {}, None, "reference"),  # no FP8 convert in Triton before sm_89: unchanged
    (ADA, 64, {}, None, "triton"),  # auto: only where measured (sm_90+)
    (ADA, 64, {}, "1", "humming"),
    (H100, 64, {"nvfp4": False}, "1", "reference"),  # MXFP4
]


@pytest.mark.parametrize("cap,rows,facts,env,kernel", HUMMING_TABLE)
def test_the_humming_rule_as_a_table(cap, rows, facts, env, kernel):
    environ = {} if env is None else {"QERL_FP4_HUMMING": env}
    assert choose_kernel("forward", "cuda", cap, rows, environ=environ, **{"humming": True, **facts}) == kernel


def test_humming_is_never_asked_for_the_backward_or_outside_its_rows():
    def never():
        raise AssertionError("asked")

    assert choose_kernel("backward", "cuda", H100, 64, humming=never, environ={"QERL_FP4_HUMMING": "1"}) == "triton"
    assert choose_kernel("forward", "cuda", H100, HUMMING_MAX_ROWS + 1, humming=never, environ={}) == "dense"
    assert choose_kernel("forward", "cuda", H100, 64, humming=never, environ={"QERL_FP4_HUMMING": "0"}) == "triton"
    with pytest.raises(ValueError, match="QERL_FP4_HUMMING"):
        choose_kernel("forward", "cuda", H100, 64, humming=True, environ={"QERL_FP4_HUMMING": "yes"})


def test_costly_facts_are_asked_only_when_the_rule_reaches_them():
    """No Triton import off CUDA, no CUDA build past the CUDA kernel's rows or with QERL_FP4_CUDA=1."""
    def never():
        raise AssertionError("asked")

    assert choose_kernel("forward", "cpu", (0, 0), 1, triton=never, cuda_fits=never, cuda_builds=never) == "reference"
    assert choose_kernel("forward", "cuda", H100, AUTO_ROWS + 1, cuda_fits=never, cuda_builds=never,
                         environ={}) == "triton"
    assert choose_kernel("forward", "cuda", H100, 1, cuda_fits=lambda: True, cuda_builds=never,
                         environ={"QERL_FP4_CUDA": "1"}) == "cuda"
    assert choose_kernel("forward", "cuda", H100, 0, cuda_fits=never, cuda_builds=never, environ={}) == "triton"
    assert choose_kernel("backward", "cuda", H100, 1, cuda_fits=never, cuda_builds=never,
                         environ={"QERL_FP4_CUDA": "bad"}) == "triton"  # the variable is the forward's


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="QERL_FP4_CUDA"):
        choose_kernel("forward", "cuda", H100, 200, environ={"QERL_FP4_CUDA": "yes"})
    with pytest.raises(ValueError, match="op"):
        choose_kernel("sideways", "cuda", H100, 1)


def test_the_environment_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv("QERL_FP4_CUDA", "0")
    assert choose_kernel("forward", "cuda", H100, 1) == "triton"
    monkeypatch.setenv("QERL_FP4_CUDA", "1")
    assert choose_kernel("forward", "cuda", H100, AUTO_ROWS + 1) == "cuda"


def _weight(n=48, k=64, seed=0):
    torch.manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k))


def test_cpu_calls_run_the_reference_bit_for_bit():
    packed, scale, gs = _weight()
    x, g = torch.randn(3, 5, 64), torch.randn(3, 5, 48)
    assert torch.equal(dispatch.run_fp4_matmul(x, packed, scale, gs), reference_fp4_matmul(x, packed, scale, gs))
    assert torch.equal(dispatch.fp4_matmul(x, packed, scale, gs), reference_fp4_matmul(x, packed, scale, gs))
    assert torch.equal(dispatch.fp4_matmul_t(g, packed, scale, gs), reference_fp4_matmul_t(g, packed, scale, gs))
    w = torch.randn(16, 64)
    assert torch.equal(dispatch.small_matmul(x[0], w), x[0] @ w.T)


def test_humming_epilogue_adds_every_segments_lora_in_one_gemm_with_the_block_diagonal_b(monkeypatch):
    """Around humming's GEMM (stood in for by the reference on CPU), bias and the stacked LoRA: the
    per-segment B products and the one GEMM over the block-diagonal B give the reference's result; the block-diagonal
    path runs a single addmm; a B of the wrong layout is one line."""
    from qerl.quant.kernels import humming_fp4
    from qerl.quant.reference import reference_fp4_lora_matmul

    sizes, k, r = [32, 16, 16], 64, 4
    parts = [_weight(n, k, seed=i) for i, n in enumerate(sizes)]
    wp, ws = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    gs = torch.cat([p[2].reshape(1) for p in parts])
    torch.manual_seed(1)
    x, bias = torch.randn(5, k), torch.randn(sum(sizes))
    a, b = torch.randn(3 * r, k), torch.randn(sum(sizes), r)
    diag = torch.zeros(sum(sizes), 3 * r)
    for i, (lo, hi) in enumerate(((0, 32), (32, 48), (48, 64))):
        diag[lo:hi, i * r:(i + 1) * r] = b[lo:hi]

    def gemm(x2, packed, scale, global_scale, segments, out):  # each segment with its own global scale
        bounds = torch.tensor([0, *segments]).cumsum(0).tolist()
        return out.copy_(torch.cat([reference_fp4_matmul(x2, packed[lo:hi], scale[lo:hi], global_scale[i:i + 1])
                                    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))], dim=-1))

    monkeypatch.setattr(humming_fp4, "fp4_matmul_humming", gemm)
    ref = reference_fp4_lora_matmul(x, wp, ws, gs, bias, a, b, 0.5, sizes)
    run = functools.partial(dispatch.run_fp4_matmul, x, wp, ws, gs, bias, a, b, 0.5, segments=sizes, kernel="humming")
    torch.testing.assert_close(run(), ref)
    calls = []
    real_addmm = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda t, *args, **kw: calls.append(t.shape) or real_addmm(t, *args,
                                                                                                          **kw))
    torch.testing.assert_close(run(lora_b_diag=diag), ref)
    assert calls == [(5, sum(sizes))]  # one GEMM over the whole output
    with pytest.raises(QerlError, match="lora_b_diag must be"):
        run(lora_b_diag=diag[:, :r])


def test_a_forced_kernel_must_be_one_of_the_known_names():
    packed, scale, gs = _weight()
    with pytest.raises(QerlError, match="kernel: expected one of reference, cuda, triton, dense"):
        dispatch.run_fp4_matmul(torch.randn(2, 64), packed, scale, gs, kernel="fused")
    with pytest.raises(QerlError, match="no grad_input"):
        dispatch.run_fp4_matmul_t(torch.randn(2, 48), packed, scale, gs, kernel="cuda")


def test_tuning_table_keeps_the_configs_of_the_listed_rows_and_covers_every_m():
    """tuning_intervals: M runs the config of the smallest listed row count >= M (the largest's beyond it);
    neighbours with one config merge; None keeps humming's whole table."""
    from qerl.quant.kernels.humming_fp4 import tuning_intervals

    table = [[0, 8, "a"], [8, 16, "b"], [16, 24, "c"], [24, 32, "d"], [32, 64, "e"], [64, 128, "e2"],
             [128, 1 << 30, "f"]]
    got = tuning_intervals(table, (32, 64, 100, 4096))
    assert got == [[0, 32, "d"], [32, 64, "e"], [64, 100, "e2"], [100, 1 << 30, "f"]]

    def config(tab, m):
        return next(c for lo, hi, c in tab if lo < m <= hi)

    for m in (1, 17, 32, 33, 64, 65, 100, 101, 5000, 1 << 29):
        point = min((p for p in (32, 64, 100, 4096) if p >= m), default=4096)
        assert config(got, m) == config(table, point)
    assert tuning_intervals(table, (20, 30)) == [[0, 20, "c"], [20, 1 << 30, "d"]]
    assert tuning_intervals(table, None) == table


def test_the_decode_buckets_humming_serves_are_in_its_kernel_table():
    """Every decode-graph bucket the dispatcher sends to humming runs a kernel compiled for exactly its rows."""
    from qerl.quant.dispatch import HUMMING_MAX_ROWS, HUMMING_MIN_ROWS, HUMMING_TABLE_ROWS
    from qerl.rollout.paged_engine import _MAX_BUCKET
    from qerl.rollout.paged_graphs import bucket_sizes

    served = {b for b in bucket_sizes(_MAX_BUCKET) if HUMMING_MIN_ROWS <= b <= HUMMING_MAX_ROWS}
    assert served and served <= set(HUMMING_TABLE_ROWS) and max(HUMMING_TABLE_ROWS) == HUMMING_MAX_ROWS
