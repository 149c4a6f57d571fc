"""bench.kernels: which forward kernel a row ran, in the table; the environment helper."""
from __future__ import annotations

import os

import pytest
import torch

from bench import kernels


def test_kernel_names_follow_the_dispatch():
    # the GPU rows of the rule are pinned in tests/quant/test_dispatch.py; a CPU tensor takes the torch reference
    w = torch.zeros(32, 128, dtype=torch.uint8)
    for rows in (4, 128):
        assert kernels.fp4_kernel(torch.zeros(rows, 256, dtype=torch.bfloat16), w, 32, 256) == "reference"


def test_markdown_names_the_kernel_of_each_row():
    row = {"model": "7B", "layer": "down", "N": 3584, "K": 18944, "M": 8, "bf16_us": 55.0, "fp4_us": 23.0,
           "fp4_floor_us": 12.6, "speedup": 55.0 / 23.0, "fp4_GBps": 1660.0, "fp4_pct_peak_bw": 55.0,
           "bwd_bf16_us": 50.0, "bwd_fp4_us": 60.0, "bwd_speedup": 50.0 / 60.0, "fp4_kernel": "cuda"}
    result = {"device": "H100", "date": "2026-11-22", "ceilings": {"copy_GBps": 3000.0, "bf16_tflops": 700.0},
              "rows": [row, {**row, "M": 64, "fp4_kernel": "triton"}, {k: v for k, v in row.items()
                                                                        if k != "fp4_kernel"}],
              "layer_totals": []}
    lines = kernels.markdown(result).splitlines()
    assert "| 23.0 (cuda) |" in lines[4] and "| 23.0 (triton) |" in lines[5]
    assert "| 23.0 (triton) |" in lines[6]  # rows from before the column: the Triton kernel
    assert "| 55.0 | - | 23.0 (cuda) |" in lines[4] and "nan" not in "\n".join(lines)  # --no-naive: "-"
    timed = {**row, "naive_us": 690.0, "speedup_vs_naive": 30.0}
    assert "| 55.0 | 690.0 | 23.0 (cuda) |" in kernels.markdown({**result, "rows": [timed]}).splitlines()[4]


def test_env_var_is_set_inside_and_restored_after(monkeypatch):
    monkeypatch.delenv("QERL_FP4_CUDA", raising=False)
    with kernels.env_var("QERL_FP4_CUDA", "1"):
        assert os.environ["QERL_FP4_CUDA"] == "1"
    assert "QERL_FP4_CUDA" not in os.environ
    monkeypatch.setenv("QERL_FP4_CUDA", "0")
    with pytest.raises(RuntimeError), kernels.env_var("QERL_FP4_CUDA", "1"):
        raise RuntimeError("inside")
    assert os.environ["QERL_FP4_CUDA"] == "0"
