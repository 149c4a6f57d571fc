"""What the two Triton decode-attention kernels share (static cache: qerl.rollout.triton_attention, paged pool:
qerl.rollout.triton_paged): one program per (row, KV head, split), the query heads of a KV head as the rows of one
tensor-core tile, an online softmax over the split's keys, and, with several splits, the merge of their partial (max,
sum, output): a second kernel (per query head in chunks of splits from COMBINE_CHUNKED_FROM splits, per KV head's
heads one split at a time below), or, up to MERGE_MAX_SPLITS splits (the paged kernel), the last split of each (row,
KV head) to finish, in the same launch (an arrival counter; a decode step's 28 combine launches fewer at 7B).

    q, b, kvh, sp, m_i, l_i, acc = program_start(q_ptr, sqb, sqh, G, GP, D)   # in a kernel, before its key loop
    program_end(o_ptr, pm_ptr, pl_ptr, pacc_ptr, b, kvh, sp, m_i, l_i, acc, sob, soh, G, GP, D, SPLIT)
    g, gp = head_tile(heads, kv_heads); pm, pl, pacc = partials(out, rows, kv_heads, split, gp, head_dim)
    combine(pm, pl, pacc, out, out_stride_row, out_stride_head, g, gp, head_dim, split)   # after the kernel
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.quant.kernels.device import auto_on_off
from qerl.quant.kernels.triton_fp4 import grid_dependency, last_arrival, rearm
from qerl.quant.kernels.workspace import scratch

COMBINE_CHUNK = 32  # splits per load in the combine: a (32, head_dim) fp32 tile, 32 registers a thread at 4 warps
COMBINE_CHUNKED_FROM = 8  # splits from which the chunked combine (one program per query head) wins
# up to here the decode kernel's last split merges (merge_in_kernel); beyond, the combine launch, whose chunked loads
# beat the merge's one load per split: H200, 7B FP4 decode step, 9 splits (1-8 rows of the qwen7b recipe's 4,608-key
# table) 2.85 / 3.48 ms merged vs 2.81 / 3.40 ms; 5 / 3 / 2 splits (16 / 32 / 64 rows) 3.71 / 4.44 / 5.45 vs 3.79 /
# 4.47 / 5.46
MERGE_MAX_SPLITS = 8
ARRIVALS = "attention.arrivals"  # the merge's counters (kernels.workspace)


@triton.jit
def program_start(q_ptr, sqb, sqh, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """This program's row, KV head and split, its (GP, D) query tile (rows past the G heads are 0) and the online
    softmax state (running max, sum, output accumulator)."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    return q, b, kvh, sp, m_i, l_i, acc


@triton.jit
def program_end(o_ptr, pm_ptr, pl_ptr, pacc_ptr, b, kvh, sp, m_i, l_i, acc, sob, soh,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                cnt_ptr=None, MERGE: tl.constexpr = False):
    """One split: the output of its G heads. Several: the split's partial (max, sum, accumulator) for `combine`; an
    empty split stores (-inf, 0, 0), which the combine weighs 0. MERGE: the last of the (row, KV head)'s splits to
    store its partial (an arrival count in cnt_ptr, left at 0 for the next launch) merges them here instead."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    if SPLIT == 1:
        heads = kvh * G + offs_g
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * sob + heads[:, None] * soh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=offs_g[:, None] < G)
    else:
        slot = b * tl.num_programs(1) + kvh
        row = slot * SPLIT + sp
        tl.store(pm_ptr + row * GP + offs_g, m_i)
        tl.store(pl_ptr + row * GP + offs_g, l_i)
        tl.store(pacc_ptr + (row * GP + offs_g[:, None]) * D + offs_d[None, :], acc)
        if MERGE:
            if last_arrival(cnt_ptr, slot, SPLIT):
                merge_heads(pm_ptr, pl_ptr, pacc_ptr, o_ptr, b, kvh, slot * SPLIT, sob, soh, G, GP, D, SPLIT)
                rearm(cnt_ptr, slot)


@triton.jit
def merge_heads(pm_ptr, pl_ptr, pacc_ptr, o_ptr, b, kvh, base, sob, soh,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp(m_s - max m), for the G heads of one (row, KV head) whose
    SPLIT partials start at row `base`, one split per load, in split order (.cg: partials other programs stored
    in this launch are read from L2, not from a stale L1 line)."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    top = tl.full((GP,), float("-inf"), tl.float32)
    for s in range(SPLIT):
        top = tl.maximum(top, tl.load(pm_ptr + (base + s) * GP + offs_g, cache_modifier=".cg"))
    num = tl.zeros((GP, D), tl.float32)
    den = tl.zeros((GP,), tl.float32)
    for s in range(SPLIT):
        w = tl.exp(tl.load(pm_ptr + (base + s) * GP + offs_g, cache_modifier=".cg") - top)  # 0: kept nothing
        den += w * tl.load(pl_ptr + (base + s) * GP + offs_g, cache_modifier=".cg")
        num += w[:, None] * tl.load(pacc_ptr + ((base + s) * GP + offs_g[:, None]) * D + offs_d[None, :],
                                    cache_modifier=".cg")
    out = num / den[:, None]
    heads = kvh * G + offs_g
    tl.store(o_ptr + b * sob + heads[:, None] * soh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=offs_g[:, None] < G)


@triton.jit
def _combine_kernel(pm_ptr, pl_ptr, pacc_ptr, o_ptr, sob, soh,
                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, SC: tl.constexpr,
                    PDL: tl.constexpr = False):
    """out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp(m_s - max m): the splits of one (row, query head), SC splits
    per load, so the loads of a chunk are in flight together (a loop of one split per load waited a memory latency
    per split: H200, 7B heads, one attention call with its decode kernel at 1 / 2 / 4 / 8 rows and 66 / 33 / 17 / 9
    splits: 20.7 / 12.9 / 10.5 / 12.1 us that way, 8.6 / 8.1 / 7.6 / 11.6 us this way)."""
    grid_dependency(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.program_id(2)
    offs_s = tl.arange(0, SC)
    offs_d = tl.arange(0, D)
    first = (b * tl.num_programs(1) + kvh) * SPLIT  # this (row, KV head)'s split 0 in the partials
    top = tl.full((SC,), float("-inf"), tl.float32)
    for s0 in range(0, SPLIT, SC):
        split = s0 + offs_s
        top = tl.maximum(top, tl.load(pm_ptr + (first + split) * GP + g, mask=split < SPLIT, other=float("-inf")))
    best = tl.max(top, axis=0)
    num = tl.zeros((D,), tl.float32)
    den = tl.zeros((SC,), tl.float32)
    for s0 in range(0, SPLIT, SC):
        split = s0 + offs_s
        live = split < SPLIT
        w = tl.exp(tl.load(pm_ptr + (first + split) * GP + g, mask=live, other=float("-inf")) - best)  # 0: empty
        den += w * tl.load(pl_ptr + (first + split) * GP + g, mask=live, other=0.0)
        acc = tl.load(pacc_ptr + ((first + split[:, None]) * GP + g) * D + offs_d[None, :], mask=live[:, None],
                      other=0.0)
        num += tl.sum(w[:, None] * acc, axis=0)
    out = num / tl.sum(den, axis=0)
    tl.store(o_ptr + b * sob + (kvh * G + g) * soh + offs_d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _combine_heads_kernel(pm_ptr, pl_ptr, pacc_ptr, o_ptr, sob, soh,
                          G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                          PDL: tl.constexpr = False):
    """The same merge for all query heads of one (row, KV head), one split per load: faster than
    _combine_kernel below COMBINE_CHUNKED_FROM splits (H200, 7B heads: 16 rows x 5 splits 17.6 vs 20.3 us per
    attention call, decode kernel included)."""
    grid_dependency(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    merge_heads(pm_ptr, pl_ptr, pacc_ptr, o_ptr, b, kvh, (b * tl.num_programs(1) + kvh) * SPLIT, sob, soh, G, GP, D,
                SPLIT)


def head_tile(heads: int, kv_heads: int) -> tuple[int, int]:
    """(G, GP): query heads per KV head, and the tile rows they fill (a power of two, at least 16 for tl.dot)."""
    g = heads // kv_heads
    return g, max(16, triton.next_power_of_2(g))


def partials(out: torch.Tensor, rows: int, kv_heads: int, split: int, gp: int, head_dim: int):
    """The (max, sum, accumulator) buffers of `split` > 1 splits; with one split the kernel writes `out` itself and
    never touches them, so `out` stands in."""
    if split == 1:
        return out, out, out
    pm = torch.empty(rows, kv_heads, split, gp, dtype=torch.float32, device=out.device)
    pacc = torch.empty(rows, kv_heads, split, gp, head_dim, dtype=torch.float32, device=out.device)
    return pm, torch.empty_like(pm), pacc


def merge_in_kernel(split: int, environ=None) -> bool:
    """Whether the decode kernel merges its `split` partials itself (QERL_ATTN_MERGE: auto (default) for 2 to
    MERGE_MAX_SPLITS splits, 1: from 2 splits at any count, 0: always the combine launch) - a launch less per
    attention call."""
    how = auto_on_off("QERL_ATTN_MERGE", environ)
    return split > 1 and (how == "1" or (how == "auto" and split <= MERGE_MAX_SPLITS))


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 arrival counts at 0 (every merging launch leaves them at 0), per (device, stream), kept for graphs
    captured over them (kernels.workspace)."""
    return scratch(ARRIVALS, device, n, torch.int32, zeroed=True)


def combine(pm, pl, pacc, out: torch.Tensor, sob: int, soh: int, g: int, gp: int, head_dim: int, split: int,
            pdl: dict) -> None:
    """Merge the splits' partials into `out` (nothing to do with one split)."""
    if split >= COMBINE_CHUNKED_FROM:
        sc = min(COMBINE_CHUNK, triton.next_power_of_2(split))
        _combine_kernel[(pm.shape[0], pm.shape[1], g)](pm, pl, pacc, out, sob, soh, G=g, GP=gp, D=head_dim,
                                                       SPLIT=split, SC=sc, num_warps=4, **pdl)
    elif split > 1:
        _combine_heads_kernel[(pm.shape[0], pm.shape[1])](pm, pl, pacc, out, sob, soh, G=g, GP=gp, D=head_dim,
                                                          SPLIT=split, num_warps=4, **pdl)
