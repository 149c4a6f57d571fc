"""Triton grouped-query attention for one-token decode steps over a static KV cache (the CUDA path of
`qerl.rollout.attention.decode_attention`).

One program per (row, KV head, split of the cache): the query heads of a KV head are the rows of one tensor-core
tile, K and V are read once in blocks of BL positions with an online softmax (flash-decoding). Each program first
finds its row's last kept position in the mask and reads no block after it: the static cache is as long as the
longest call needs and is masked past the current token, so decode steps read only the filled part, and the
splits share out that part. Splits keep every SM busy at small batches; a second kernel combines their partial
(max, sum, output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.quant.kernels.tiling import target_programs
from qerl.quant.kernels.triton_fp4 import grid_dependency, pdl_options


@triton.jit
def _gqa_decode_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, pm_ptr, pl_ptr, pacc_ptr, L, scale,
                       sqb, sqh, skb, skh, skl, svb, svh, svl, smb, sob, soh,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
                       SPLIT: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    # the row's last kept cache position: blocks after it (the unfilled static cache) are never read, and the
    # splits share out only the blocks before it
    last = -1
    for c in range(0, L, SCAN):
        offs = c + tl.arange(0, SCAN)
        kept = tl.load(m_ptr + b * smb + offs, mask=offs < L, other=0) != 0
        last = tl.maximum(last, tl.max(tl.where(kept, offs, -1), 0))
    n_blocks = last // BL + 1
    per_split = tl.cdiv(n_blocks, SPLIT)
    blk0 = sp * per_split
    blk1 = tl.minimum(blk0 + per_split, n_blocks)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, BL)
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
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
    if SPLIT == 1:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * sob + heads[:, None] * soh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=offs_g[:, None] < G)
    else:
        row = (b * tl.num_programs(1) + kvh) * SPLIT + sp
        tl.store(pm_ptr + row * GP + offs_g, m_i)
        tl.store(pl_ptr + row * GP + offs_g, l_i)
        tl.store(pacc_ptr + (row * GP + offs_g[:, None]) * D + offs_d[None, :], acc)


@triton.jit
def _gqa_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, o_ptr, sob, soh,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                        PDL: tl.constexpr = False):
    """out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp(m_s - max m): the splits of one (row, KV head)."""
    grid_dependency(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    base = (b * tl.num_programs(1) + kvh) * SPLIT
    top = tl.full((GP,), float("-inf"), tl.float32)
    for s in range(SPLIT):
        top = tl.maximum(top, tl.load(pm_ptr + (base + s) * GP + offs_g))
    num = tl.zeros((GP, D), tl.float32)
    den = tl.zeros((GP,), tl.float32)
    for s in range(SPLIT):
        w = tl.exp(tl.load(pm_ptr + (base + s) * GP + offs_g) - top)  # 0 for a split that kept nothing
        den += w * tl.load(pl_ptr + (base + s) * GP + offs_g)
        num += w[:, None] * tl.load(pacc_ptr + ((base + s) * GP + offs_g[:, None]) * D + offs_d[None, :])
    out = num / den[:, None]
    heads = kvh * G + offs_g
    tl.store(o_ptr + b * sob + heads[:, None] * soh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=offs_g[:, None] < G)


BLOCK_L = 64
SCAN_BLOCK = 1024


def gqa_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
                         scale: float, split: int | None = None) -> torch.Tensor:
    """query (B, H, 1, D), key/value (B, Hkv, L, D), keep (B, L) bool (True = attend) -> (B, 1, H, D) in the
    query's dtype. D a power of two; H a multiple of Hkv; rows without any kept position give NaN (as softmax)."""
    b, h, _, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    g = h // kv
    gp = max(16, triton.next_power_of_2(g))
    n_blocks = triton.cdiv(length, BLOCK_L)
    if split is None:
        split = max(1, min(n_blocks, triton.cdiv(target_programs(query.device), b * kv)))
    split = max(1, min(split, n_blocks))
    out = torch.empty(b, 1, h, d, dtype=query.dtype, device=query.device)
    if split > 1:
        pm = torch.empty(b, kv, split, gp, dtype=torch.float32, device=query.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(b, kv, split, gp, d, dtype=torch.float32, device=query.device)
    else:
        pm = pl = pacc = out
    keep = keep.view(torch.uint8) if keep.dtype == torch.bool else keep
    pdl = pdl_options(query.device)  # programmatic dependent launch (QERL_PDL)
    _gqa_decode_kernel[(b, kv, split)](
        query, key, value, keep, out, pm, pl, pacc, length, float(scale),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), keep.stride(0), out.stride(0), out.stride(2),
        G=g, GP=gp, D=d, BL=BLOCK_L, SPLIT=split, SCAN=SCAN_BLOCK, num_warps=4, num_stages=3, **pdl)
    if split > 1:
        _gqa_combine_kernel[(b, kv)](pm, pl, pacc, out, out.stride(0), out.stride(2), G=g, GP=gp, D=d, SPLIT=split,
                                     num_warps=4, **pdl)
    return out
