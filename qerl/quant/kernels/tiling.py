"""Tile and split-K rules of the Triton kernels (kernels.triton_fp4), kept free of triton so they can be tested on
any machine."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from qerl.errors import QerlError
from qerl.quant.kernels.device import device_index, hopper


def target_programs(device: torch.device) -> int:
    """Programs that fill the GPU twice over (two per SM)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def pick_split(tiles: int, k_tiles: int, device: torch.device, min_tiles_per_split: int = 2,
               waves: int = 2) -> int:
    """Enough reduction splits that tiles * split fills `waves` programs per SM, keeping >= min_tiles_per_split
    K-tiles each."""
    want = math.ceil(waves * target_programs(device) / 2 / max(1, tiles))
    return no_empty_splits(min(want, k_tiles // min_tiles_per_split, 16), k_tiles)


def no_empty_splits(split: int, k_tiles: int) -> int:
    """The fewest splits that give each its ceil(k_tiles / split) tiles: no program without work (74 K-tiles in
    64 splits of 2 leave 27 programs empty, whose zero partials the last program would still add up)."""
    return max(1, math.ceil(k_tiles / math.ceil(k_tiles / max(1, split))))


def k_block(k: int, preferred: int) -> int:
    """The preferred K tile if it divides k, else the largest of 128/64 that does, else preferred (masked tail)."""
    for c in (preferred, 128, 64):
        if c <= preferred and k % c == 0:
            return c
    return preferred


def small_split(bm: int, bn: int, bk: int, k_tiles: int, tiles: int, device: torch.device) -> int:
    """K splits of `kernels.triton_fp4._small_mm_kernel`: enough programs to fill the GPU. From 32-row tiles on,
    also no more than keeps the last program's serial sum (split partials of bm x bn fp32) within what each program
    reads of x and w: split^2 <= k_tiles * bk * (bm + bn) * 2 bytes / (bm * bn * 4 bytes). H100, LoRA A of r 32 at
    64 rows: 28 -> 7 splits takes q|k|v's x @ A.T from 11.3 to 7.0 us, down's (K 18944) 50 -> 19 from 10.3 to 8.1
    us; at 16 rows the cap made some shapes slower (4.2 -> 4.5 us), so it is not applied there."""
    split = min(k_tiles, target_programs(device) // (2 * tiles), 64)
    if bm > 16:
        split = min(split, math.isqrt(k_tiles * bk * (bm + bn) * 2 // (bm * bn * 4)))
    return max(1, split)


class KernelConfig(NamedTuple):
    """Tile shape and launch knobs of one kernel call (bm rows of x, bn/bk as named by each kernel)."""
    bm: int
    bn: int
    bk: int
    split: int = 1
    warps: int = 4
    stages: int = 3
    group_m: int = 8
    maxnreg: int | None = None  # register cap per thread: more programs per SM, at the risk of spills
    swap_ab: bool = False  # forward: out.T = W @ x.T (see _fp4_mm_kernel)
    tma: bool = False  # forward: x tiles by a TMA descriptor (sm_90+; see _fp4_mm_kernel's X_DESC)


def forward_config(M: int, N: int, K: int, device: torch.device,
                   dtype: torch.dtype = torch.bfloat16) -> KernelConfig:
    """Fused-kernel tiles per M bucket, from `python -m bench.kernels --sweep` (H200, then H100): few rows are a
    bandwidth problem (narrow tiles; split-K to fill every SM, more of it for long reductions); from 33 rows on
    sm_90+ `many_rows_config`."""
    if M > 32 and dtype != torch.float32 and hopper(device_index(device)):
        return many_rows_config(M, N, K, device)
    if M <= 16:
        # 3 stages: 7B down 27.4 -> 25.1 us, gate/up 25.3 -> 24.7, q|k|v 11.2 -> 10.9 at M = 16 against 4 (H100)
        bm, bn, bk, warps, stages, maxnreg = 16, 32, 256, 4, 3, 128
    elif M <= 64 and N * K >= 1 << 25:
        # large weights: one 64-row tile (Hopper wgmma, each weight dequantized once) beats two 32-row tiles that
        # dequantize it twice (7B gate/up, M = 64, H100: 45.6 vs 54.3 us)
        bm, bn, bk, warps, stages, maxnreg = 64, 64, 64, 4, 4, None
    elif M <= 64:
        bm, bn, bk, warps, stages, maxnreg = 32, 64, 256, 4, 3, None
    else:
        bm, bn, bk, warps, stages, maxnreg = 64, 64, 128, 4, 4, None
    bk = k_block(K, bk)
    tiles = math.ceil(M / bm) * math.ceil(N / bn)
    split = pick_split(tiles, math.ceil(K / bk), device, waves=6 if K >= 8192 else 2) if M <= 64 else 1
    return KernelConfig(bm, bn, bk, split, warps, stages, 8, maxnreg)


def many_rows_config(M: int, N: int, K: int, device: torch.device) -> KernelConfig:
    """sm_90+ tiles from 33 rows: W decoded in registers as the wgmma A operand (swap_ab, 64 weight rows), x by TMA
    as B (bm rows = the wgmma N), so the async wgmma overlaps the next step's decode. 7B at M = 64 / 128 (H200, us,
    from the previous tiles / dense): gate/up 51.8 -> 40.0 / 94.2 -> 50.1, down 46.8 -> 43.6 / 99.8 -> 63.3, q|k|v
    21.4 -> 15.8 / 22.2 -> 22.6. 256-row tiles were faster at 256-1024 rows (gate/up at 256: 78 us) but are not
    used: stacked q|k|v with bias + LoRA at 300 rows came back non-finite once (one weight alone was right)."""
    bm, stages = (64, 3) if M <= 64 else (128, 4)
    tiles = math.ceil(M / bm) * math.ceil(N / 64)
    waves = (6 if K >= 8192 else 2) if M <= 64 else 1  # split-K only where the tiles leave SMs idle
    split = pick_split(tiles, math.ceil(K / 64), device, waves=waves)
    # bk 64: the group scales load as one int32 per row (kernels.triton_fp4._load_weight_tile)
    return KernelConfig(bm, 64, 64, split, 4, stages, 8, None, True, True)


def backward_config(M: int, N: int, K: int, device: torch.device) -> KernelConfig:
    """Same for grad_input: bn is the reduction step over N, bk the output tile along K (must divide K)."""
    bm, bn, bk, warps, stages = (16 if M <= 16 else 64), 128, 64, 4, 4
    if K % bk:
        raise QerlError(f"weight_packed: in_features {K} must be a multiple of {bk} for the fused grad_input")
    tiles = math.ceil(M / bm) * (K // bk)
    waves = 6 if N >= 8192 and M <= 16 else 2
    split = pick_split(tiles, math.ceil(N / bn), device, waves=waves) if M <= 64 else 1
    return KernelConfig(bm, bn, bk, split, warps, stages)
