"""The fused forward kernels (swapped `_fp4_mv_kernel` with and without DEINT, and `_fp4_mm_kernel`) in Triton's
CPU interpreter vs a float64 reference: tile indexing, masking, split-K and bias without a GPU (plain-Triton decode).

TRITON_INTERPRET is read when `triton.jit` decorates a kernel, so the kernels run in a child process (this file as
a script): setting it here would turn every GPU test collected in the same session into interpreter runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# (N, K, bk): K-tiles 3 (split 2 -> 2 + 1) and N = 96 wraps the second 64-row weight tile; K = 176 has a masked tail.
SHAPES = [(96, 192, 64), (64, 176, 128)]
ROWS = (1, 5, 16, 20)  # 20: two x tiles of 16, the second masked
CASES = [  # (kernel, N, K, bk, M, split, dtype, bias)
    *[(kern, n, k, bk, m, split, dt, True) for kern in ("swap", "swap_deint") for n, k, bk in SHAPES
      for m in ROWS for split in (1, 2) for dt in ("fp32", "bf16")],
    *[(kern, 96, 192, 64, 5, split, "fp32", False) for kern in ("swap", "swap_deint", "mm") for split in (1, 2)],
    *[("mm", n, k, bk, m, split, dt, True) for n, k, bk in SHAPES for m in (1, 20) for split in (1, 2)
      for dt in ("fp32", "bf16")],
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _case_id(case) -> str:
    kern, n, k, bk, m, split, dt, bias = case
    return f"{kern}-{n}x{k}-bk{bk}-M{m}-split{split}-{dt}{'-bias' if bias else ''}"


def _patch_interpreter():
    """Two Triton 3.6 interpreter bugs: int() of a 1-element array fails with numpy >= 2.4 (range() over scalar
    tensors; triton-lang/triton#9171), and tl.dot multiplies bf16 operands as their raw uint16 bits."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    patch_tensor = ti._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    ti._patch_lang_tensor = _patch_lang_tensor
    dot = ti.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *rest):
        a, b = (self.cast_impl(t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
        return dot(self, a, b, d, *rest)

    ti.InterpreterBuilder.create_dot = create_dot


def _run_cases() -> dict:
    """Child process: relative errors (Frobenius, max) per case, or the error message."""
    _patch_interpreter()
    from qerl.quant import triton_fp4 as tf
    from qerl.quant.format import dequantize_nvfp4, quantize_nvfp4

    out = {}
    for case in CASES:
        kern, n, k, bk, m, split, dt, bias = case
        g = torch.Generator().manual_seed(n * 1000 + k)
        w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[torch.randperm(n, generator=g)].unsqueeze(1)
        packed, scale, gs = quantize_nvfp4(w)
        x = torch.randn(m, k, generator=g).to(DTYPES[dt])
        b = torch.randn(n, generator=g).to(DTYPES[dt]) if bias else None
        ref = x.double() @ dequantize_nvfp4(packed, scale, gs, torch.float64).T
        if bias:
            ref += b.double()
        cfg = tf.KernelConfig(16, 64, bk, split, swap=kern != "mm", deint=kern == "swap_deint")
        try:
            y = tf.fp4_matmul_triton(x, packed, scale, gs, b, config=cfg, use_asm=False).double()
            out[_case_id(case)] = [((y - ref).norm() / ref.norm()).item(),
                                   ((y - ref).abs().amax() / ref.abs().amax()).item()]
        except Exception as exc:  # recorded, so that one broken case does not hide the others
            out[_case_id(case)] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_forward_kernels_in_interpreter_match_float64(interpreted, case):
    res = interpreted[_case_id(case)]
    assert not isinstance(res, str), res
    frob, worst = res
    # the interpreter truncates fp32 -> bf16 (up to 1 ulp, GPUs round to nearest); fp32 is exact up to the sums
    tol = (8e-3, 2e-2) if case[6] == "bf16" else (1e-5, 1e-5)
    assert frob < tol[0] and worst < tol[1], f"rel err {frob:.2e}, max {worst:.2e}"


def test_swap_config_checks():
    pytest.importorskip("triton")
    from qerl.errors import QerlError
    from qerl.quant import triton_fp4 as tf

    x = torch.zeros(2, 64)
    w = (torch.zeros(32, 32, dtype=torch.uint8), torch.zeros(32, 4, dtype=torch.float8_e4m3fn), torch.ones(1))
    with pytest.raises(QerlError, match="config.deint: needs config.swap"):
        tf.fp4_matmul_triton(x, *w, config=tf.KernelConfig(16, 64, 64, deint=True))
    with pytest.raises(QerlError, match="config.bm: 8 < 16 with swap"):
        tf.fp4_matmul_triton(x, *w, config=tf.KernelConfig(8, 64, 64, swap=True))
    with pytest.raises(QerlError, match="forward only"):
        tf.fp4_matmul_t_triton(torch.zeros(2, 32), *w, config=tf.KernelConfig(16, 64, 64, swap=True))


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
