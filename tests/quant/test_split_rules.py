"""Split-K rules of the Triton kernels (qerl.quant.kernels.tiling: no GPU or triton needed)."""
from __future__ import annotations

import math

import pytest

from qerl.quant.kernels import tiling as tf


def test_split_counts_leave_no_program_without_work():
    """Every split of the reduction gets ceil(k_tiles / split) tiles and none is left empty."""
    for k_tiles in range(1, 160):
        for want in range(1, 70):
            split = tf.no_empty_splits(want, k_tiles)
            per = math.ceil(k_tiles / split)
            assert 1 <= split <= want and (split - 1) * per < k_tiles, (k_tiles, want, split)
    assert tf.no_empty_splits(64, 74) == 37  # 7B down_proj's x @ A.T: 74 K-tiles of 256


@pytest.mark.parametrize("sms", [78, 132])
def test_small_matmul_split_fills_the_gpu_and_bounds_the_final_sum(monkeypatch, sms):
    """From 32-row tiles the last program's sum of partials stays within what one program reads; 16-row tiles
    only fill the GPU (their measured optimum)."""
    monkeypatch.setattr(tf, "target_programs", lambda device: 2 * sms)
    for bm in (16, 32, 64):
        for bn in (16, 32, 64):
            for bk in (64, 128, 256):
                for k_tiles in range(1, 200, 7):
                    for tiles in (1, 2, 4):
                        split = tf.small_split(bm, bn, bk, k_tiles, tiles, None)
                        assert 1 <= split <= min(k_tiles, 64)
                        assert split <= max(1, sms // tiles)
                        if bm > 16:
                            assert split ** 2 * bm * bn * 4 <= k_tiles * bk * (bm + bn) * 2 or split == 1
                        else:
                            assert split == max(1, min(k_tiles, sms // tiles, 64))
