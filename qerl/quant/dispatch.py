"""The single dispatch point for matmuls against packed FP4 weights.

`fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias)` = x @ deq(W).T (+ bias), and
`fp4_matmul_t(grad_out, ...)` = grad_out @ deq(W) (the input gradient). On CUDA they call the Triton kernels of
`qerl.quant.triton_fp4` (`_triton_fp4_matmul`, `_triton_fp4_matmul_t`) when that module imports; everywhere else a
plain-torch reference dequantizes a block of output rows at a time, so no full dense copy of W ever exists.

    from qerl.quant.kernels import fp4_matmul
    y = fp4_matmul(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, layer.bias)
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qerl.quant.format import dequantize

# Elements of W dequantized at once by the reference path (16 MiB in float32): bounds the transient memory.
CHUNK_ELEMENTS = 1 << 22


@functools.cache
def _triton_kernel(name: str):
    """The Triton entry point `name`, or None when Triton or the kernel module is unavailable (CPU images)."""
    try:
        from qerl.quant import triton_fp4
    except Exception:  # ImportError, or Triton failing to initialise without a driver
        return None
    return getattr(triton_fp4, name, None)


@functools.cache
def _fp8_capable(device_index: int) -> bool:
    """Triton converts float8_e4m3fn scales in registers from sm_89 on (Ada, Hopper, Blackwell); an A100 (sm_80)
    cannot compile the kernels, so it takes the reference path."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _use_triton(x: torch.Tensor, weight_scale: torch.Tensor, name: str):
    """Triton only covers NVFP4 (FP8 scales) on CUDA GPUs of sm_89+; MXFP4, CPU tensors and older GPUs take the
    reference path."""
    if not x.is_cuda or weight_scale.dtype != torch.float8_e4m3fn:
        return None
    if not _fp8_capable(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return None
    return _triton_kernel(name)


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


@torch.library.custom_op("qerl::fp4_matmul", mutates_args=())
def _fp4_matmul_op(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                   weight_global_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = _use_triton(x, weight_scale, "_triton_fp4_matmul")
    if kernel is not None:
        return kernel(x, weight_packed, weight_scale, weight_global_scale, bias)
    return reference_fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias)


@_fp4_matmul_op.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale, bias):
    return x.new_empty(*x.shape[:-1], weight_packed.shape[0])


@torch.library.custom_op("qerl::fp4_matmul_t", mutates_args=())
def _fp4_matmul_t_op(grad_out: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     weight_global_scale: torch.Tensor) -> torch.Tensor:
    kernel = _use_triton(grad_out, weight_scale, "_triton_fp4_matmul_t")
    if kernel is not None:
        return kernel(grad_out, weight_packed, weight_scale, weight_global_scale)
    return reference_fp4_matmul_t(grad_out, weight_packed, weight_scale, weight_global_scale)


@_fp4_matmul_t_op.register_fake
def _(grad_out, weight_packed, weight_scale, weight_global_scale):
    return grad_out.new_empty(*grad_out.shape[:-1], weight_packed.shape[1] * 2)


def fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias=None):
    """x (..., K) @ deq(W).T -> (..., N) (+ bias): Triton on CUDA when available, the torch reference otherwise.

    A torch custom op (qerl::fp4_matmul): torch.compile and CUDA-graph capture treat it as one opaque kernel
    instead of tracing into the Triton launcher.
    """
    return _fp4_matmul_op(x, weight_packed, weight_scale, weight_global_scale, bias)


def reference_fp4_lora_matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b,
                              lora_scale: float, segments=None):
    """fp4_matmul + lora_scale * (x @ A.T) @ B.T, the LoRA part in x's dtype (as peft computes it); with
    `segments`, W / global scale / A stack one block per segment (see fp4_lora_matmul)."""
    n, r = weight_packed.shape[0], lora_b.shape[-1]
    segments = list(segments or [n])
    gs = weight_global_scale.reshape(-1)
    outs, start = [], 0
    for i, size in enumerate(segments):
        rows = slice(start, start + size)
        out = reference_fp4_matmul(x, weight_packed[rows], weight_scale[rows], gs[i:i + 1],
                                   None if bias is None else bias[rows])
        xa = x @ lora_a[i * r:(i + 1) * r].to(x.dtype).T
        outs.append(out + xa @ lora_b[rows].to(x.dtype).T * lora_scale)
        start += size
    return torch.cat(outs, dim=-1)


@torch.library.custom_op("qerl::fp4_lora_matmul", mutates_args=())
def _fp4_lora_matmul_op(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                        weight_global_scale: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                        lora_b: torch.Tensor, lora_scale: float, segments: list[int]) -> torch.Tensor:
    kernel = _use_triton(x, weight_scale, "_triton_fp4_matmul")
    if kernel is not None:
        return kernel(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b, lora_scale,
                      segments=segments)
    return reference_fp4_lora_matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b,
                                     lora_scale, segments)


@_fp4_lora_matmul_op.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b, lora_scale, segments):
    return x.new_empty(*x.shape[:-1], weight_packed.shape[0])


def fp4_lora_matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b, lora_scale,
                    segments=None):
    """Inference-only x @ deq(W).T (+ bias) + lora_scale * (x @ A.T) @ B.T as one op (qerl::fp4_lora_matmul): on
    CUDA the B product is added in the FP4 kernel's epilogue (one small GEMM for x @ A.T, no B GEMM, no add
    kernel). It has no autograd formula: training goes through FP4Linear + peft's separate adapter modules.

    segments: sizes along N of up to three layers that read the same x, stacked in W (rows), the global scale
    (one per segment), A (one (r, K) block per segment) and B (rows): q/k/v or gate/up in one launch."""
    n = weight_packed.shape[0]
    return _fp4_lora_matmul_op(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b,
                               float(lora_scale), [int(v) for v in (segments or [n])])


@torch.library.custom_op("qerl::small_matmul", mutates_args=())
def _small_matmul_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    kernel = _triton_kernel("small_matmul") if x.is_cuda else None  # plain bf16/fp16 dots: any CUDA GPU
    return kernel(x, w) if kernel is not None else x @ w.T


@_small_matmul_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def small_matmul(x, w):
    """x (M, K) @ w (N, K).T for few rows and a narrow w (a stacked LoRA A): one split-K Triton launch on CUDA
    (qerl.quant.triton_fp4.small_matmul), torch elsewhere. A custom op, so that torch.compile treats it as one
    opaque kernel instead of tracing the launcher (its workspace cache and launch grid)."""
    return _small_matmul_op(x, w)


def fp4_matmul_t(grad_out, weight_packed, weight_scale, weight_global_scale):
    """grad_out (..., N) @ deq(W) -> (..., K), the input gradient of fp4_matmul (custom op qerl::fp4_matmul_t)."""
    return _fp4_matmul_t_op(grad_out, weight_packed, weight_scale, weight_global_scale)
