"""Tile and split-K rules of the Triton kernels (qerl.quant.triton_fp4), kept free of triton so they can be
tested on any machine."""
from __future__ import annotations

import math

import torch


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
    """K splits of `qerl.quant.triton_fp4._small_mm_kernel`: enough programs to fill the GPU. From 32-row tiles on,
    also no more than keeps the last program's serial sum (split partials of bm x bn fp32) within what each program
    reads of x and w: split^2 <= k_tiles * bk * (bm + bn) * 2 bytes / (bm * bn * 4 bytes). H100, LoRA A of r 32 at
    64 rows: 28 -> 7 splits takes q|k|v's x @ A.T from 11.3 to 7.0 us, down's (K 18944) 50 -> 19 from 10.3 to 8.1
    us; at 16 rows the cap made some shapes slower (4.2 -> 4.5 us), so it is not applied there."""
    split = min(k_tiles, target_programs(device) // (2 * tiles), 64)
    if bm > 16:
        split = min(split, math.isqrt(k_tiles * bk * (bm + bn) * 2 // (bm * bn * 4)))
    return max(1, split)
