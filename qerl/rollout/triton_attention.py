"""Triton grouped-query attention for one-token decode steps over a static KV cache (the CUDA path of
`qerl.rollout.attention.decode_attention`).

One program per (row, KV head, split of the cache): the query heads of a KV head are the rows of one tensor-core
tile, K and V are read once in blocks of BL positions with an online softmax (flash-decoding). Each program first
finds its row's last kept position in the mask and reads no block after it: the static cache is as long as the
longest call needs and is masked past the current token, so decode steps read only the filled part, and the
splits share out that part. Splits keep every SM busy at small batches; a second kernel combines their partial
(max, sum, output). The program's prologue, epilogue and that combine are qerl.rollout.triton_split's, shared with
the paged kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.quant.kernels.tiling import target_programs
from qerl.quant.kernels.triton_fp4 import grid_dependency, pdl_options
from qerl.rollout.triton_split import combine, head_tile, partials, program_end, program_start


@triton.jit
def _gqa_decode_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, pm_ptr, pl_ptr, pacc_ptr, L, scale,
                       sqb, sqh, skb, skh, skl, svb, svh, svl, smb, sob, soh,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
                       SPLIT: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency(PDL)
    # the row's last kept cache position: blocks after it (the unfilled static cache) are never read, and the
    # splits share out only the blocks before it
    row = tl.program_id(0).to(tl.int64)
    last = -1
    for c in range(0, L, SCAN):
        offs = c + tl.arange(0, SCAN)
        kept = tl.load(m_ptr + row * smb + offs, mask=offs < L, other=0) != 0
        last = tl.maximum(last, tl.max(tl.where(kept, offs, -1), 0))
    q, b, kvh, sp, m_i, l_i, acc = program_start(q_ptr, sqb, sqh, G, GP, D)
    n_blocks = last // BL + 1
    per_split = tl.cdiv(n_blocks, SPLIT)
    blk0 = sp * per_split
    blk1 = tl.minimum(blk0 + per_split, n_blocks)
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, BL)
    k_base = k_ptr + b * skb + kvh * skh
    v_base = v_ptr + b * svb + kvh * svh
    for blk in range(blk0, blk1):
        offs_l = blk * BL + offs_b
        inside = offs_l < L
        keep = tl.load(m_ptr + b * smb + offs_l, mask=inside, other=0) != 0
        k = tl.load(k_base + offs_l[:, None].to(tl.int64) * skl + offs_d[None, :], mask=inside[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: weights stay 0, not NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_l[:, None].to(tl.int64) * svl + offs_d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    program_end(o_ptr, pm_ptr, pl_ptr, pacc_ptr, b, kvh, sp, m_i, l_i, acc, sob, soh, G, GP, D, SPLIT)


BLOCK_L = 64
SCAN_BLOCK = 1024


def gqa_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
                         scale: float, split: int | None = None) -> torch.Tensor:
    """query (B, H, 1, D), key/value (B, Hkv, L, D), keep (B, L) bool (True = attend) -> (B, 1, H, D) in the
    query's dtype. D a power of two; H a multiple of Hkv; rows without any kept position give NaN (as softmax)."""
    b, h, _, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    g, gp = head_tile(h, kv)
    n_blocks = triton.cdiv(length, BLOCK_L)
    if split is None:
        split = max(1, min(n_blocks, triton.cdiv(target_programs(query.device), b * kv)))
    split = max(1, min(split, n_blocks))
    out = torch.empty(b, 1, h, d, dtype=query.dtype, device=query.device)
    pm, pl, pacc = partials(out, b, kv, split, gp, d)
    keep = keep.view(torch.uint8) if keep.dtype == torch.bool else keep
    pdl = pdl_options(query.device)  # programmatic dependent launch (QERL_PDL)
    _gqa_decode_kernel[(b, kv, split)](
        query, key, value, keep, out, pm, pl, pacc, length, float(scale),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), keep.stride(0), out.stride(0), out.stride(2),
        G=g, GP=gp, D=d, BL=BLOCK_L, SPLIT=split, SCAN=SCAN_BLOCK, num_warps=4, num_stages=3, **pdl)
    combine(pm, pl, pacc, out, out.stride(0), out.stride(2), g, gp, d, split, pdl)
    return out
