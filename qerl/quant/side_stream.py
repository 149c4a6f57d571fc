"""LoRA's x @ A.T beside the base GEMM: launched on a second CUDA stream, so that it runs while the base matmul
(humming's W4A16 GEMM, cuBLAS over a dense copy or a bf16 weight) streams its weights, instead of before it.

    xa, join = beside(lambda out: torch.matmul(x2, lora_a.T, out=out), (m, r), x2)   # dispatch.shrink_beside
    base = gemm(x2)          # on the current stream, concurrently with x @ A.T
    join()                   # the current stream waits for xa
    out = lora_expand(base, xa, ...)

x @ A.T reads only x, which both already have; the base GEMM takes 11-50 us per 7B projection at 17-128 rows and
x @ A.T ~6 us (H200), which in one stream added ~0.7 ms to every decode step (112 launches). Inside a CUDA-graph
capture the fork and join become the graph's edges (two branches, no host work at replay). `xa` is allocated on
the current stream before the fork, so its memory follows that stream (and the graph's pool) as any output does;
the side stream is one per device, made at the first call (a rollout's eager warm-up, before any capture).
QERL_LORA_OVERLAP: "auto" (default) or "1" run it beside on CUDA; "0" runs it in line (A/B measurements).
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


def in_line() -> None:
    """The join of a computation that ran in line: nothing to wait for."""


def beside(compute, shape: tuple[int, int], like: torch.Tensor):
    """Run compute(out) (writing out, a new `shape` tensor of like's dtype and device) on the device's side stream
    after everything queued so far on the current one; returns (out, join). Call join() before the current stream
    reads out. Off CUDA, or with QERL_LORA_OVERLAP=0, compute runs in line and join does nothing."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    if not like.is_cuda or overlap_mode() == "0":
        compute(out)
        return out, in_line
    current = torch.cuda.current_stream(like.device)
    side = _stream(device_index(like.device))
    side.wait_stream(current)
    with torch.cuda.stream(side):
        compute(out)

    def join() -> None:
        current.wait_stream(side)

    return out, join
