"""The plain-torch path of the FP4 matmuls (CPU, MXFP4, GPUs without the kernels): a block of W's rows is
dequantized at a time, so no full dense copy of W ever exists. qerl.quant.dispatch decides when it runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl.quant.format import dequantize

# Elements of W dequantized at once by the reference path (16 MiB in float32): bounds the transient memory.
CHUNK_ELEMENTS = 1 << 22


def _row_chunks(n_rows: int, n_cols: int):
    step = max(1, CHUNK_ELEMENTS // max(1, n_cols))
    for start in range(0, n_rows, step):
        yield start, min(n_rows, start + step)


def _dequant_rows(weight_packed, weight_scale, weight_global_scale, start, stop, dtype):
    return dequantize(weight_packed[start:stop], weight_scale[start:stop], weight_global_scale, dtype)


def reference_fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias=None):
    """x @ deq(W).T (+bias) in x.dtype, dequantizing CHUNK_ELEMENTS of W at a time; bit-identical to nn.Linear on
    the dequantized weight in x.dtype."""
    n_out, n_in = weight_packed.shape[0], weight_packed.shape[1] * 2
    out = x.new_empty(*x.shape[:-1], n_out)
    bias = None if bias is None else bias.to(x.dtype)
    for start, stop in _row_chunks(n_out, n_in):
        w = _dequant_rows(weight_packed, weight_scale, weight_global_scale, start, stop, x.dtype)
        # the bias goes into the GEMM (addmm) so the output is rounded once, as nn.Linear does
        out[..., start:stop] = F.linear(x, w, None if bias is None else bias[start:stop])
    return out


def reference_fp4_matmul_t(grad_out, weight_packed, weight_scale, weight_global_scale):
    """grad_out @ deq(W) in grad_out.dtype, accumulated over blocks of W's rows."""
    n_out, n_in = weight_packed.shape[0], weight_packed.shape[1] * 2
    grad_in = grad_out.new_zeros(*grad_out.shape[:-1], n_in)
    for start, stop in _row_chunks(n_out, n_in):
        w = _dequant_rows(weight_packed, weight_scale, weight_global_scale, start, stop, grad_out.dtype)
        grad_in += grad_out[..., start:stop] @ w
    return grad_in


def reference_fp4_lora_matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b,
                              lora_scale: float, segments=None):
    """fp4_matmul + lora_scale * (x @ A.T) @ B.T, the LoRA part in x's dtype (as peft computes it); with
    `segments`, W / global scale / A stack one block per segment (see fp4_lora_matmul); without A and B (None),
    the stacked base alone."""
    n = weight_packed.shape[0]
    segments = list(segments or [n])
    gs = weight_global_scale.reshape(-1)
    outs, start = [], 0
    for i, size in enumerate(segments):
        rows = slice(start, start + size)
        out = reference_fp4_matmul(x, weight_packed[rows], weight_scale[rows], gs[i:i + 1],
                                   None if bias is None else bias[rows])
        if lora_a is not None:
            r = lora_b.shape[-1]
            out = out + (x @ lora_a[i * r:(i + 1) * r].to(x.dtype).T) @ lora_b[rows].to(x.dtype).T * lora_scale
        outs.append(out)
        start += size
    return torch.cat(outs, dim=-1)
