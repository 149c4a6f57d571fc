"""Triton grouped-query attention for one-token decode rows over the paged KV pool (the CUDA path of
`qerl.rollout.paged_attention`), the block-table version of `qerl.rollout.triton_attention`'s static-cache kernel.

    out = paged_decode(q, k_cache, v_cache, block_table, context_lens, scale)   # q (B, H, D) -> (B, H, D)

One program per (row, KV head, split): the query heads of a KV head are the rows of one tensor-core tile; the row's
keys are read in tiles of BLOCK_L positions, each position's block looked up in the row's block table (a tile may
span several small blocks or part of a large one), with an online softmax. The row's length is given, so nothing
past it is read and no mask is scanned; the splits share out the row's tiles, and the last of them to finish merges
their partial (max, sum, output) (qerl.rollout.triton_split: up to MERGE_MAX_SPLITS splits, beyond them its combine
kernel, as for the static kernel). Rows padded for a CUDA graph point at the null block with length 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.quant.kernels.tiling import target_programs
from qerl.quant.kernels.triton_fp4 import grid_dependency, pdl_options
from qerl.rollout.triton_split import (arrival_counters, combine, head_tile, merge_in_kernel, partials,
                                       program_end, program_start)

BLOCK_L = 64  # key positions per tile
# splits at most max(SPLIT_CAP, width / SPLIT_KEYS): the combine's cost grows with the splits, and at 1-4 rows a
# 4,368-key table's 66 / 33 / 17 splits lost to 8 (H200, 7B heads, per layer: 10.5 -> 8.4 us at 1 row of 900 keys,
# 9.6 -> 5.8 us at 260 keys; `bench.attention --paged --splits`); wider tables keep >= 512 keys of width a split
SPLIT_CAP, SPLIT_KEYS = 8, 512
# below the cap, splits enough for 3 programs per SM: 2 left 16 / 32 rows at 5 / 3 splits, 8 / 4 were faster (H200,
# 7B heads, us per layer, rows of 1,178 / 1,474 keys: 22.0 -> 18.6, 40.4 -> 36.1; of 578 / 874: 15.6 -> 14.5,
# 30.3 -> 26.1); 64 rows flat from 2 to 8 splits, 128 rows keep 1 (4 lost 35% on short rows)
PROGRAMS_PER_SM = 3


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, o_ptr, pm_ptr, pl_ptr, pacc_ptr, scale,
                         sqb, sqh, skn, skp, skh, svn, svp, svh, stb, sob, soh,
                         kn_ptr, vn_ptr, sknb, sknh, svnb, svnh, cnt_ptr,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         BL: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                         WRITE: tl.constexpr = False, MERGE: tl.constexpr = False, PDL: tl.constexpr = False):
    grid_dependency(PDL)
    q, b, kvh, sp, m_i, l_i, acc = program_start(q_ptr, sqb, sqh, G, GP, D)
    length = tl.load(lens_ptr + b)
    n_tiles = tl.cdiv(length, BL)
    per_split = tl.cdiv(n_tiles, SPLIT)
    t0 = sp * per_split
    t1 = tl.minimum(t0 + per_split, n_tiles)
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, BL)
    k_head = k_ptr + kvh * skh
    v_head = v_ptr + kvh * svh
    if WRITE:  # this step's key and value (position length - 1): the one program whose tiles hold it stores them
        k_new = tl.load(kn_ptr + b * sknb + kvh * sknh + offs_d)
        v_new = tl.load(vn_ptr + b * svnb + kvh * svnh + offs_d)
        if (t0 <= n_tiles - 1) & (n_tiles - 1 < t1):
            last = length - 1
            blk_last = tl.load(table_ptr + b * stb + last // BS).to(tl.int64)
            pos_last = (last % BS).to(tl.int64)
            tl.store(k_head + blk_last * skn + pos_last * skp + offs_d, k_new)
            tl.store(v_head + blk_last * svn + pos_last * svp + offs_d, v_new)
    for t in range(t0, t1):  # every tile before n_tiles holds key t * BL < length, so m_i becomes finite at once
        offs_l = t * BL + offs_b
        inside = offs_l < length
        blk = tl.load(table_ptr + b * stb + offs_l // BS, mask=inside, other=0).to(tl.int64)
        pos = (offs_l % BS).to(tl.int64)
        k = tl.load(k_head + (blk * skn + pos * skp)[:, None] + offs_d[None, :], mask=inside[:, None], other=0.0)
        if WRITE:  # the store above may not be visible to this program's own loads: use the registers
            k = tl.where((offs_l == length - 1)[:, None], k_new[None, :], k)
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (blk * svn + pos * svp)[:, None] + offs_d[None, :], mask=inside[:, None], other=0.0)
        if WRITE:
            v = tl.where((offs_l == length - 1)[:, None], v_new[None, :], v)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    program_end(o_ptr, pm_ptr, pl_ptr, pacc_ptr, b, kvh, sp, m_i, l_i, acc, sob, soh, G, GP, D, SPLIT, cnt_ptr, MERGE)


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel's conditions: CUDA tensors, head_dim a power of two >= 16, query heads a multiple of KV heads."""
    d = q.shape[-1]
    return (q.is_cuda and k_cache.is_cuda and d >= 16 and d & (d - 1) == 0
            and q.shape[1] % k_cache.shape[2] == 0)


def default_split(rows: int, kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Enough splits that rows x KV heads x splits make PROGRAMS_PER_SM programs per SM, never more than the widest
    row's tiles nor than max(SPLIT_CAP, max_keys // SPLIT_KEYS). It depends only on shapes (the block table's
    width, not the lengths), so a captured step keeps it."""
    tiles = max(1, triton.cdiv(max_keys, BLOCK_L))
    cap = max(SPLIT_CAP, max_keys // SPLIT_KEYS)
    programs = target_programs(device) * PROGRAMS_PER_SM // 2  # target_programs: two per SM
    return max(1, min(tiles, cap, triton.cdiv(programs, rows * kv_heads)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, split: int | None = None,
                 new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """q (B, H, D) one query token per row (any strides with unit last stride); k_cache/v_cache
    (num_blocks, block_size, Hkv, D); block_table (B, W) int32; context_lens (B,) int32, each >= 1 (keys of the
    row, the current token's included) -> (B, H, D) in q's dtype. Query head h uses KV head h // (H / Hkv).

    new_kv: this step's (key, value), each (B, Hkv, D) in the caches' dtype (unit last stride): written into the
    pool at each row's position context_lens - 1 (its slot through the block table) by the same launch, which
    attends over them as if they had been written first (the separate write was two index_copy launches a layer).
    config: (key positions per tile, warps, pipeline stages), default (BLOCK_L, 4, 3) (benchmarks try others)."""
    b, h, d = q.shape
    block_size, kv = k_cache.shape[1], k_cache.shape[2]
    g, gp = head_tile(h, kv)
    if split is None:
        split = default_split(b, kv, block_table.shape[1] * block_size, q.device)
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    pm, pl, pacc = partials(out, b, kv, split, gp, d)
    precision = "ieee" if k_cache.dtype == torch.float32 else None  # fp32 caches: no TF32 rounding
    pdl = pdl_options(q.device)
    kn, vn = new_kv if new_kv is not None else (q, q)  # unread without WRITE
    if new_kv is not None and (kn.shape != (b, kv, d) or vn.shape != (b, kv, d) or kn.dtype != k_cache.dtype
                               or vn.dtype != v_cache.dtype or kn.stride(-1) != 1 or vn.stride(-1) != 1):
        raise ValueError(f"paged_decode: new_kv must be two ({b}, {kv}, {d}) {k_cache.dtype} tensors with unit last "
                         f"stride, got {tuple(kn.shape)} {kn.dtype} / {tuple(vn.shape)} {vn.dtype}")
    block_l, warps, stages = config or (BLOCK_L, 4, 3)
    merge = merge_in_kernel(split)
    cnt = arrival_counters(q.device, b * kv) if merge else pm  # unread without MERGE
    _paged_decode_kernel[(b, kv, split)](
        q, k_cache, v_cache, block_table, context_lens, out, pm, pl, pacc, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), out.stride(0),
        out.stride(1), kn, vn, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cnt,
        G=g, GP=gp, D=d, BS=block_size, BL=block_l, SPLIT=split, PRECISION=precision, WRITE=new_kv is not None,
        MERGE=merge, num_warps=warps, num_stages=stages, **pdl)
    if not merge:
        combine(pm, pl, pacc, out, out.stride(0), out.stride(1), g, gp, d, split, pdl)
    return out
