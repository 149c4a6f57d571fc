"""LoRA's x @ A.T beside the base GEMM: launched on a second CUDA stream, so that it runs while the base matmul
(humming's W4A16 GEMM, cuBLAS over a dense copy or a bf16 weight) streams its weights, instead of before it.

    base, xa = around(lambda: gemm(x2), lambda out: torch.matmul(x2, lora_a.T, out=out), (m, r), x2)
    out = lora_expand(base, xa, ...)          # dispatch.shrink_around; the current stream has waited for xa

x @ A.T reads only x, which both already have; the base GEMM takes 11-50 us per 7B projection at 17-128 rows and
x @ A.T ~6 us (H200), which in one stream added ~0.7 ms to every decode step (112 launches). Inside a CUDA-graph
capture the fork and join become the graph's edges (two branches, no host work at replay). `xa` is allocated on
the current stream before the fork, so its memory follows that stream (and the graph's pool) as any output does;
the side stream is one per device, made at the first call (a rollout's eager warm-up, before any capture).
QERL_LORA_OVERLAP: "auto" (default) or "1" run it beside on CUDA; "0" runs it in line (A/B measurements).
x @ A.T is launched first; the GEMM launched first, or x @ A.T on a high-priority stream, made no difference (H200,
7B FP4 decode step at 1-128 rows, graph ms within 0.05: BENCHMARKS.md).
"""
from __future__ import annotations

import functools

import torch

from qerl.quant.kernels.device import auto_on_off, device_index


def overlap_mode(environ=None) -> str:
    """QERL_LORA_OVERLAP: "auto" (default), "1" or "0"."""
    return auto_on_off("QERL_LORA_OVERLAP", environ)


@functools.cache
def _stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def around(gemm, compute, shape: tuple[int, int], like: torch.Tensor):
    """gemm() on the current stream and compute(out) (writing out, a new `shape` tensor of like's dtype and device)
    beside it on the device's side stream, both after everything queued so far; returns (gemm's result, out) with
    the current stream waiting for the side stream. Off CUDA, or with QERL_LORA_OVERLAP=0: compute, then gemm, in
    line."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    if not like.is_cuda or overlap_mode() == "0":
        compute(out)
        return gemm(), out
    current = torch.cuda.current_stream(like.device)
    side = _stream(device_index(like.device))
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            compute(out)
        result = gemm()
    finally:  # out's memory goes back to the current stream only once the side stream is done with it
        current.wait_stream(side)
    return result, out
