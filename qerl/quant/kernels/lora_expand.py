"""LoRA's expand at inference, in one pass: out (M, N) += scale * xa (M, S x r) @ B.T for up to three stacked
members (segments along N, member i reading xa[:, i r : (i + 1) r] and B's rows of its segment; B is (N, r)).

    y = lora_expand(base, xa, lora_b, scale, n1, n2, bias)   # n1 = n2 = N for one member; out=base: in place

cuBLAS runs this product (K = r to 3 r, 32-128) split-K at decode row counts: a GEMM plus a reduction kernel per
call, and the caller's block-diagonal B reads S x the adapter. Here each program loads its (BM, BN) tile of out,
the rows of xa and the members' B rows its columns need (masked per column by segment, so the block-diagonal
zeros are never read), does one tensor-core dot over the whole rank and writes the tile back: out is read and
written once, B read once, one launch. Used by qerl.quant.dispatch where choose_kernel("expand", ...) says so.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.errors import QerlError

MAX_RANK = 128  # S x r, the dot's whole K in one tile


@triton.jit
def _lora_expand_kernel(y_ptr, base_ptr, xa_ptr, b_ptr, bias_ptr, M, N, R, RS, n1, n2, sym, syn, sbm, sbn_, sxm, sxk,
                        swn, swk, scale, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                        HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_j = tl.arange(0, BR)
    m_ok = offs_m < M
    n_ok = offs_n < N
    xa = tl.load(xa_ptr + offs_m[:, None] * sxm + offs_j[None, :] * sxk,
                 mask=m_ok[:, None] & (offs_j[None, :] < RS), other=0.0)
    seg = (offs_n >= n1).to(tl.int32) + (offs_n >= n2).to(tl.int32)
    col = offs_j[None, :] - seg[:, None] * R  # which of B's r columns meets xa's column j in this output column
    w = tl.load(b_ptr + offs_n[:, None] * swn + col * swk, mask=n_ok[:, None] & (col >= 0) & (col < R), other=0.0)
    acc = scale * tl.dot(xa, tl.trans(w), out_dtype=tl.float32)
    mask = m_ok[:, None] & n_ok[None, :]
    acc += tl.load(base_ptr + offs_m[:, None] * sbm + offs_n[None, :] * sbn_, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :] * syn, acc.to(y_ptr.dtype.element_ty), mask=mask)


def tiles(m: int) -> tuple[int, int]:
    """(BM, BN): one row tile up to 64 rows, then 64-row tiles; wider column tiles for the 16-row tile, so that a
    program holds 4-8 K outputs."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    return bm, (256 if bm == 16 else 128)


def lora_expand(base: torch.Tensor, xa: torch.Tensor, lora_b: torch.Tensor, scale: float, n1: int, n2: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """base (M, N) (+ bias) + scale * per-segment xa @ B.T into `out` (a new tensor by default; `base` itself
    for in place). Shapes, dtypes and bounds as the module docstring says; returns out."""
    m, n = base.shape
    r = lora_b.shape[1]
    segs = 1 + (n1 < n) + (n2 < n)
    rs = xa.shape[1]
    if (xa.shape[0] != m or lora_b.shape[0] != n or rs != segs * r or rs > MAX_RANK or not 0 < n1 <= n2 <= n
            or len({base.dtype, xa.dtype, lora_b.dtype}) != 1 or (bias is not None and bias.shape != (n,))):
        raise QerlError(f"lora_expand: base {tuple(base.shape)} {base.dtype}, xa {tuple(xa.shape)} {xa.dtype}, "
                        f"B {tuple(lora_b.shape)} {lora_b.dtype} with bounds ({n1}, {n2}) do not fit (xa: "
                        f"{segs} x r columns, at most {MAX_RANK}; one dtype; bias (N,))")
    out = torch.empty_like(base) if out is None else out
    if m == 0:
        return out
    bm, bn = tiles(m)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _lora_expand_kernel[grid](out, base, xa, lora_b, base if bias is None else bias, m, n, r, rs, n1, n2,
                              out.stride(0), out.stride(1), base.stride(0), base.stride(1), xa.stride(0),
                              xa.stride(1), lora_b.stride(0), lora_b.stride(1), float(scale), BM=bm, BN=bn,
                              BR=max(16, triton.next_power_of_2(rs)), HAS_BIAS=bias is not None, num_warps=4,
                              num_stages=1)
    return out
