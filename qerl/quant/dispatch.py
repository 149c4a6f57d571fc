"""The single dispatch point for matmuls against packed FP4 weights: `choose_kernel` is the rule, and every caller
(FP4Linear, FP4LoraLinear, qerl.quant.grouped, qerl.fused_lora through FP4Linear.lora_base_ops) goes through the
public functions below.

    from qerl.quant.dispatch import fp4_matmul
    y = fp4_matmul(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, layer.bias)

fp4_matmul = x @ deq(W).T (+ bias); fp4_matmul_t = grad_out @ deq(W) (the input gradient); fp4_lora_matmul = the
inference-only x @ deq(W).T + scale * (x @ A.T) @ B.T over up to three stacked weights; small_matmul = x @ w.T for a
few rows and a narrow w (a stacked LoRA A). Each is a torch custom op (qerl::...), one opaque kernel to torch.compile
and CUDA-graph capture; their eager bodies run_fp4_matmul / run_fp4_matmul_t also take `kernel` to force one
(benchmarks and tests). The kernels live below, in qerl.quant.kernels, and never import this module.
"""
from __future__ import annotations

import functools
import math
import types
from typing import NamedTuple

import torch

from qerl.errors import QerlError
from qerl.quant import side_stream
from qerl.quant.kernels import cuda_fp4, humming_fp4
from qerl.quant.kernels.device import auto_on_off, capability, device_index, in_decode_step, pdl_mode
from qerl.quant.operands import check_operands, lora_adapter, segment_bounds, stack_bounds
from qerl.quant.reference import reference_fp4_lora_matmul, reference_fp4_matmul, reference_fp4_matmul_t

__all__ = ["AUTO_ROWS", "DENSE_MIN_ROWS", "HUMMING_MAX_ROWS", "HUMMING_MIN_ROWS", "HUMMING_TABLE_ROWS", "KERNELS",
           "SMALL_MM_MAX_ROWS", "TMA_DENSE_MIN_ROWS", "check_kernel_environment", "choose_kernel", "fp4_cuda_mode",
           "fp4_humming_mode", "fp4_lora_matmul", "fp4_matmul", "fp4_matmul_t", "lora_expand", "pdl_mode",
           "run_fp4_matmul", "run_fp4_matmul_t", "run_lora_expand", "shrink_around", "small_matmul"]

AUTO_ROWS = 8  # QERL_FP4_CUDA=auto: at 9-16 rows the two-tile CUDA kernel lost to Triton (BENCHMARKS.md)
DENSE_MIN_ROWS = 128  # grad_input, and forward before sm_90: from here dequantize + cuBLAS beats the fused kernels
# forward on sm_90+ with bf16/fp16 x: the TMA tiles (kernels.tiling.many_rows_config) up to 128 rows; at 256 rows they
# beat dequantize + cuBLAS on 7B gate/up by ~10% but lost on q/o and q|k|v (26 vs 22, 35 vs 27 us; H200)
TMA_DENSE_MIN_ROWS = 129
# small_matmul's Triton kernel: a LoRA A at decode (cuBLAS's split-K GEMM + reduction become one launch); beside
# humming's GEMM at 128 rows it made the 7B decode step 6.9 ms instead of 7.5-7.7 with cuBLAS (H200)
SMALL_MM_MAX_ROWS = 128
SMALL_MM_MAX_N = 256
EXPAND_MAX_ROWS = 512  # lora_expand's one-pass kernel; from here cuBLAS's GEMM no longer splits K
EXPAND_MAX_RANK = 128  # its dot takes all of xa's columns (segments x r) at once
# QERL_FP4_HUMMING=auto: humming-kernels' W4A16 GEMM from here (sm_90+, bf16/fp16 x); below, our few-row kernels
# win (7B stacked layer at 16 rows: x1.67 vs x1.55 bf16; at 32: x0.93 vs x1.47; H200)
HUMMING_MIN_ROWS = 17
HUMMING_MAX_ROWS = 2048  # measured to here: 7B layer x0.88 bf16 at 2048 rows vs x0.83 dequantize + cuBLAS (H200)
# the row counts whose humming kernels a rollout compiles (one nvcc build each per layer shape, cached on disk):
# the decode graphs' buckets from 17 rows (qerl.rollout.paged_graphs.bucket_sizes) and prefill chunk sizes
HUMMING_TABLE_ROWS = (32, 64, 128, 256, 384, 512, 1024, 2048)
KERNELS = ("reference", "cuda", "triton", "dense", "humming")


def fp4_cuda_mode(environ=None) -> str:
    """QERL_FP4_CUDA: "auto" (default), "1" or "0" (see choose_kernel)."""
    return auto_on_off("QERL_FP4_CUDA", environ)


def fp4_humming_mode(environ=None) -> str:
    """QERL_FP4_HUMMING: "auto" (default), "1" or "0" (see choose_kernel)."""
    return auto_on_off("QERL_FP4_HUMMING", environ)


def check_kernel_environment(environ=None) -> None:
    """The kernel switches (QERL_FP4_CUDA, QERL_FP4_HUMMING, QERL_PDL, QERL_LORA_OVERLAP, QERL_ATTN_MERGE) read at
    every launch, checked once before a stage starts: a bad value is one line naming the variable, not a traceback."""
    for name in ("QERL_FP4_CUDA", "QERL_FP4_HUMMING", "QERL_PDL", "QERL_LORA_OVERLAP", "QERL_ATTN_MERGE"):
        try:
            auto_on_off(name, environ)
        except ValueError as err:
            raise QerlError(str(err)) from None


def _fact(value) -> bool:
    """A fact of choose_kernel: a bool, or a callable asked only when the rule gets to it (a build, an import)."""
    return bool(value() if callable(value) else value)


def choose_kernel(op: str, device_type: str, capability: tuple[int, int], rows: int, *,
                  dtype: torch.dtype = torch.bfloat16, w_dtype: torch.dtype | None = None, n: int = 0,
                  nvfp4: bool = True, triton=True, cuda_fits=True, cuda_builds=True, k_ok: bool = True,
                  humming=False, environ=None) -> str:
    """Which kernel computes `op` ("forward", "backward", "small" or "expand"), top row first:

    op        | condition                                                        | rows M                | kernel
    ----------|------------------------------------------------------------------|-----------------------|----------
    all       | not CUDA, or Triton does not import (CPU images)                 | any                   | reference
    fwd, bwd  | MXFP4 (scales not FP8), or sm < 8.9 (Triton's FP8 convert)       | any                   | reference
    forward   | QERL_FP4_CUDA=auto (default): sm_90+, bf16 x, fits, and the      | 1 .. AUTO_ROWS (8)    | cuda
              | module builds (else one warning, then the rows below)            |                       |
    forward   | QERL_FP4_CUDA=1: bf16 x, fits (build errors raise)               | 1 .. MAX_ROWS (16)    | cuda
    forward   | QERL_FP4_HUMMING=auto (default): sm_90+, bf16/fp16 x, `humming`  | HUMMING_MIN_ROWS (17) | humming
              | (humming-kernels imports, N % 64, K % 128, the weight holds its  |  .. HUMMING_MAX_ROWS  |
              | repacked copy: quant.humming_copies; "1" builds it on first use) |   (2048)              |
    forward   | QERL_FP4_HUMMING=1: sm_80+, bf16/fp16 x, `humming`               | any not taken above   | humming
    forward   | otherwise (QERL_FP4_CUDA=0, fp16/fp32 x, outside `fits`):        |                       |
              | sm_90+ and bf16/fp16 x (TMA tiles from 33 rows)                  | < TMA_DENSE_MIN_ROWS  | triton
              |                                                                  |   (129)               |
              | sm_90+ and bf16/fp16 x                                           | >= TMA_DENSE_MIN_ROWS | dense
              | sm_89, or fp32 x                                                 | < DENSE_MIN_ROWS (128)| triton
              | sm_89, or fp32 x                                                 | >= DENSE_MIN_ROWS     | dense
    backward  | K % 64 == 0                                                      | < DENSE_MIN_ROWS      | triton
    backward  | K % 64 != 0 (the fused grad_input's tile)                        | any                   | dense
    backward  |                                                                  | >= DENSE_MIN_ROWS     | dense
    small     | N <= 256, x and w both bf16 or both fp16 (any sm)                | <= SMALL_MM_MAX_ROWS  | triton
    small     | otherwise                                                        | any                   | reference
    expand    | xa has <= 128 columns, base/xa/B all bf16 or all fp16 (any sm)   | <= EXPAND_MAX_ROWS    | triton
    expand    | otherwise                                                        |   (512)               | reference

    "fits" (cuda_fp4.fits): K % 128, N and segment bounds % 16, 16-byte aligned rows. reference = plain torch
    (qerl.quant.reference; x @ w.T for small), cuda = kernels.cuda_fp4, triton = kernels.triton_fp4's fused kernels
    (tiles: kernels.tiling.forward_config / backward_config; small_matmul for small), dense =
    kernels.triton_dequant (chunked dequantize + cuBLAS), expand = kernels.lora_expand (torch addmm for
    reference). M = 0 launches nothing. A bad QERL_FP4_CUDA is a
    ValueError on every CUDA forward. Launches of the cuda and triton kernels also read QERL_PDL
    (kernels.device.use_pdl: programmatic dependent launch, by default on sm_90+ inside CUDA-graph capture).

    humming = kernels.humming_fp4 (humming-kernels' JIT W4A16 GEMMs over a repacked copy of the weight).

    triton, cuda_fits, cuda_builds and humming may be callables, asked only when the rule reaches them, in that
    order."""
    if device_type != "cuda" or not _fact(triton):
        return "reference"
    if op == "small":
        small_dtypes = dtype in (torch.bfloat16, torch.float16) and (w_dtype or dtype) == dtype
        return "triton" if rows <= SMALL_MM_MAX_ROWS and n <= SMALL_MM_MAX_N and small_dtypes else "reference"
    if op == "expand":
        same = dtype in (torch.bfloat16, torch.float16) and (w_dtype or dtype) == dtype
        return "triton" if rows <= EXPAND_MAX_ROWS and n <= EXPAND_MAX_RANK and same else "reference"
    if op not in ("forward", "backward"):
        raise ValueError(f"op: expected forward, backward, small or expand, got {op!r}")
    if not nvfp4 or tuple(capability) < (8, 9):
        return "reference"
    if op == "forward" and _cuda_takes(capability, rows, dtype, cuda_fits, cuda_builds, environ):
        return "cuda"
    if op == "backward":
        return "dense" if rows >= DENSE_MIN_ROWS or not k_ok else "triton"
    if _humming_takes(capability, rows, dtype, humming, environ):
        return "humming"
    tma_tiles = tuple(capability) >= (9, 0) and dtype in (torch.bfloat16, torch.float16)
    return "dense" if rows >= (TMA_DENSE_MIN_ROWS if tma_tiles else DENSE_MIN_ROWS) else "triton"


def _cuda_takes(capability, rows, dtype, cuda_fits, cuda_builds, environ) -> bool:
    how = fp4_cuda_mode(environ)
    if how == "0" or dtype != torch.bfloat16:
        return False
    if not (0 < rows <= (AUTO_ROWS if how == "auto" else cuda_fp4.MAX_ROWS) and _fact(cuda_fits)):
        return False
    return how == "1" or (tuple(capability) >= (9, 0) and _fact(cuda_builds))


def _humming_takes(capability, rows, dtype, humming, environ) -> bool:
    how = fp4_humming_mode(environ)
    if how == "0" or dtype not in (torch.bfloat16, torch.float16) or rows <= 0:
        return False
    if how == "1":
        return tuple(capability) >= (8, 0) and _fact(humming)
    return tuple(capability) >= (9, 0) and HUMMING_MIN_ROWS <= rows <= HUMMING_MAX_ROWS and _fact(humming)


def _humming_fits(x: torch.Tensor, weight_packed: torch.Tensor) -> bool:
    """humming's tiles: N a multiple of 64, K of 128 (every Qwen2.5 projection); the package imports here; and
    (QERL_FP4_HUMMING=auto) the weight already holds its repacked copy: an engine builds the copies when memory
    allows (qerl.quant.humming_copies), so a forward never allocates one behind the memory plan's back. A copy
    whose kernels still compile in the background is skipped, except in a decode step (its warm-up and capture
    must pick the same kernels), which waits for them."""
    if not humming_fp4.fits(weight_packed) or not humming_fp4.available(x.device):
        return False
    if humming_fp4.has_copy(weight_packed):
        return humming_fp4.copy_ready(weight_packed) or in_decode_step()
    return fp4_humming_mode() == "1"


@functools.cache
def _triton():
    """The Triton kernel modules, or None when Triton is unavailable or fails to initialise (CPU images)."""
    try:
        from qerl.quant.kernels import lora_expand, triton_dequant, triton_fp4
    except Exception:  # ImportError, or Triton failing to initialise without a driver
        return None
    return types.SimpleNamespace(fp4=triton_fp4, dequant=triton_dequant, expand=lora_expand)


def _capability(t: torch.Tensor) -> tuple[int, int]:
    return capability(device_index(t.device)) if t.is_cuda else (0, 0)


class _Prepared(NamedTuple):
    """Checked operands of one GPU forward: x as (M, K), the output (M, N), segment bounds."""
    x2: torch.Tensor
    out: torch.Tensor
    n: int
    k: int
    n1: int
    n2: int


def _prepare(x, weight_packed, weight_scale, weight_global_scale, segments) -> _Prepared:
    n, k = check_operands(x, weight_packed, weight_scale, weight_global_scale, 1, "x", segments)
    x2 = x.reshape(-1, k)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    n1, n2 = segment_bounds(segments, n, weight_global_scale) if x2.shape[0] else (n, n)
    return _Prepared(x2, out, n, k, n1, n2)


def _check_kernel(kernel) -> None:
    if kernel is not None and kernel not in KERNELS:
        raise QerlError(f"kernel: expected one of {', '.join(KERNELS)}, got {kernel!r}")


def run_fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias=None, lora_a=None, lora_b=None,
                   lora_scale: float = 1.0, *, segments=None, kernel: str | None = None, config=None,
                   use_asm: bool = True, lora_b_diag=None):
    """x (..., K) @ deq(W).T (+ bias) (+ lora_scale * (x @ lora_a.T) @ lora_b.T) -> (..., N) in x.dtype, eagerly, on
    the kernel of `choose_kernel` or the one named by `kernel`; a Triton tile `config` means kernel "triton",
    use_asm=False (Triton's plain decode) leaves the CUDA kernel out. segments: sizes along N of up to three
    weights stacked in W (one global scale each; lora_a stacks one (r, K) block per segment). lora_b_diag: the same
    B laid block-diagonally (N, segments x r), for the kernels that add the B product with cuBLAS: one GEMM for
    every segment instead of one per segment."""
    _check_kernel(kernel)
    prepared = functools.cache(lambda: _prepare(x, weight_packed, weight_scale, weight_global_scale, segments))
    if kernel is None and config is not None:
        kernel = "triton"
    if kernel is None:
        kernel = choose_kernel(
            "forward", x.device.type, _capability(x), math.prod(x.shape[:-1]), dtype=x.dtype,
            nvfp4=weight_scale.dtype == torch.float8_e4m3fn, triton=lambda: _triton() is not None,
            cuda_fits=lambda: use_asm and cuda_fp4.fits(prepared().x2, weight_packed, *prepared()[2:]),
            cuda_builds=lambda: cuda_fp4.built(device_index(x.device)),
            humming=lambda: _humming_fits(x, weight_packed))
    if kernel == "reference":
        if lora_a is None and (weight_global_scale is None or weight_global_scale.numel() == 1):
            return reference_fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias)
        return reference_fp4_lora_matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b,
                                         lora_scale, segments)
    p = prepared()
    if p.x2.shape[0]:
        _launch_forward(kernel, p, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b,
                        lora_scale, len(segments or [p.n]), config, use_asm, lora_b_diag)
    return p.out.reshape(*x.shape[:-1], p.n)


def _launch_forward(kernel, p: _Prepared, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b,
                    lora_scale, n_segments, config, use_asm, lora_b_diag=None) -> None:
    a, b = lora_adapter(p.x2, lora_a, lora_b, p.n, p.k, n_segments)
    if kernel == "humming":
        if a is not None and lora_b_diag is not None:
            _check_block_diagonal(lora_b_diag, b, p.x2, n_segments)

        def gemm():
            humming_fp4.fp4_matmul_humming(p.x2, weight_packed, weight_scale, weight_global_scale,
                                           [p.n1, p.n2 - p.n1, p.n - p.n2][:n_segments], p.out)

        if a is not None:  # x @ A.T beside the GEMM, then bias and every segment's B product in one pass
            xa = shrink_around(p.x2, a, gemm)[1]
            run_lora_expand(p.out, xa, b, lora_scale, p.n1, p.n2, bias, lora_b_diag, out=p.out)
            return
        gemm()
        if bias is not None:
            p.out.add_(bias.to(p.out.dtype))
        return
    if kernel == "cuda":  # x @ A.T inside the same launch, up to the kernel's MAX_FUSED_RANK
        xa = None
        if a is not None and b.shape[1] > cuda_fp4.MAX_FUSED_RANK:
            xa, a = _small_matmul_eager(p.x2, a), None
        cuda_fp4.fp4_matmul_cuda(p.x2, weight_packed, weight_scale, weight_global_scale, bias, xa, b,
                                 float(lora_scale), p.n1, p.n2, out=p.out, lora_a=a)
        return
    xa = None if a is None else _small_matmul_eager(p.x2, a)
    if kernel == "dense":
        _triton().dequant.dense_fp4_lora_matmul(p.x2, weight_packed, weight_scale, weight_global_scale, bias, xa, b,
                                                lora_scale, p.n1, p.n2, p.out, use_asm)
    else:
        _triton().fp4.fp4_matmul_fused(p.x2, weight_packed, weight_scale, weight_global_scale, bias, xa, b,
                                       lora_scale, p.n1, p.n2, p.out, config, use_asm)


def run_lora_expand(base, xa, lora_b, scale: float, n1: int, n2: int, bias=None, lora_b_diag=None, out=None):
    """base (M, N) (+ bias) + scale * xa @ B.T per segment (bounds n1 <= n2 <= N; segment i reads xa's i-th r
    columns and B's rows of its segment; B (N, r)) into `out` (new by default, `base` for in place), on
    choose_kernel("expand"): the one-pass kernel, or torch's addmm (over lora_b_diag (N, segments x r) when given:
    one GEMM for every segment)."""
    kernel = choose_kernel("expand", base.device.type, (0, 0), base.shape[0], dtype=base.dtype, w_dtype=lora_b.dtype,
                           n=xa.shape[1], triton=lambda: _triton() is not None)
    if kernel == "triton" and xa.dtype == base.dtype:
        return _triton().expand.lora_expand(base, xa, lora_b, scale, n1, n2, bias, out)
    out = base.clone() if out is None else (out if out is base else out.copy_(base))
    if bias is not None:
        out.add_(bias.to(out.dtype))
    xa = xa.to(out.dtype)
    if lora_b_diag is not None and lora_b_diag.shape[1] == xa.shape[1]:
        return out.addmm_(xa, lora_b_diag.to(out.dtype).T, alpha=scale)
    n, r = lora_b.shape
    for i, (lo, hi) in enumerate(((0, n1), (n1, n2), (n2, n))):
        if hi > lo:
            out[:, lo:hi].addmm_(xa[:, i * r:(i + 1) * r], lora_b[lo:hi].to(out.dtype).T, alpha=scale)
    return out


def _check_block_diagonal(diag: torch.Tensor, b: torch.Tensor, x2: torch.Tensor, n_segments: int) -> None:
    """lora_b_diag is B (N, r) laid out as (N, n_segments x r), in x's dtype and device."""
    want = (b.shape[0], n_segments * b.shape[1])
    if tuple(diag.shape) != want or diag.dtype != x2.dtype or diag.device != x2.device:
        raise QerlError(f"fp4_lora_matmul: lora_b_diag must be {want} {x2.dtype} on {x2.device} (B laid out "
                        f"block-diagonally), got {tuple(diag.shape)} {diag.dtype} on {diag.device}")


def run_fp4_matmul_t(g, weight_packed, weight_scale, weight_global_scale, *, kernel: str | None = None,
                     config=None, use_asm: bool = True):
    """g (..., N) @ deq(W) -> (..., K) in g.dtype, eagerly (the input gradient; W is never dense: the "dense"
    kernel holds at most two bounded chunks of it); kernel / config / use_asm as in run_fp4_matmul."""
    _check_kernel(kernel)
    if kernel is None and config is not None:
        kernel = "triton"
    if kernel is None:
        kernel = choose_kernel("backward", g.device.type, _capability(g), math.prod(g.shape[:-1]), dtype=g.dtype,
                               nvfp4=weight_scale.dtype == torch.float8_e4m3fn,
                               triton=lambda: _triton() is not None, k_ok=weight_packed.shape[1] * 2 % 64 == 0)
    if kernel == "reference":
        return reference_fp4_matmul_t(g, weight_packed, weight_scale, weight_global_scale)
    if kernel == "cuda":
        raise QerlError("kernel: the CUDA kernel has no grad_input; expected reference, triton or dense")
    n, k = check_operands(g, weight_packed, weight_scale, weight_global_scale, 0, "grad_out")
    g2 = g.reshape(-1, n)
    out = torch.empty(g2.shape[0], k, dtype=g.dtype, device=g.device)
    if g2.shape[0] and kernel == "dense":
        _triton().dequant.dense_fp4_matmul_t(g2, weight_packed, weight_scale, weight_global_scale, out, use_asm)
    elif g2.shape[0]:
        _triton().fp4.fp4_matmul_t_fused(g2, weight_packed, weight_scale, weight_global_scale, out, config, use_asm)
    return out.reshape(*g.shape[:-1], k)


def _small_matmul_eager(x2: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    kernel = choose_kernel("small", x2.device.type, (0, 0), x2.shape[0], dtype=x2.dtype, w_dtype=w.dtype,
                           n=w.shape[0], triton=lambda: _triton() is not None)
    if kernel == "triton":
        return _triton().fp4.small_matmul(x2, w, out=out)
    return x2 @ w.T if out is None else torch.matmul(x2, w.T, out=out)


def shrink_around(x2: torch.Tensor, w: torch.Tensor, gemm):
    """x2 @ w.T (LoRA's x @ A.T) beside gemm() (qerl.quant.side_stream.around): (gemm's result, xa)."""
    return side_stream.around(gemm, lambda out: _small_matmul_eager(x2, w, out), (x2.shape[0], w.shape[0]), x2)


@torch.library.custom_op("qerl::fp4_matmul", mutates_args=())
def _fp4_matmul_op(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                   weight_global_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return run_fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias)


@_fp4_matmul_op.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale, bias):
    return x.new_empty(*x.shape[:-1], weight_packed.shape[0])


@torch.library.custom_op("qerl::fp4_matmul_t", mutates_args=())
def _fp4_matmul_t_op(grad_out: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     weight_global_scale: torch.Tensor) -> torch.Tensor:
    return run_fp4_matmul_t(grad_out, weight_packed, weight_scale, weight_global_scale)


@_fp4_matmul_t_op.register_fake
def _(grad_out, weight_packed, weight_scale, weight_global_scale):
    return grad_out.new_empty(*grad_out.shape[:-1], weight_packed.shape[1] * 2)


@torch.library.custom_op("qerl::fp4_lora_matmul", mutates_args=())
def _fp4_lora_matmul_op(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                        weight_global_scale: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor | None,
                        lora_b: torch.Tensor | None, lora_scale: float, segments: list[int],
                        lora_b_diag: torch.Tensor | None = None) -> torch.Tensor:
    return run_fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b, lora_scale,
                          segments=segments, lora_b_diag=lora_b_diag)


@_fp4_lora_matmul_op.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b, lora_scale, segments,
      lora_b_diag=None):
    return x.new_empty(*x.shape[:-1], weight_packed.shape[0])


@torch.library.custom_op("qerl::small_matmul", mutates_args=())
def _small_matmul_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _small_matmul_eager(x, w)


@_small_matmul_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("qerl::lora_expand", mutates_args=())
def _lora_expand_op(base: torch.Tensor, xa: torch.Tensor, lora_b: torch.Tensor, scale: float, n1: int, n2: int,
                    bias: torch.Tensor | None = None, lora_b_diag: torch.Tensor | None = None) -> torch.Tensor:
    return run_lora_expand(base, xa, lora_b, scale, n1, n2, bias, lora_b_diag)


@_lora_expand_op.register_fake
def _(base, xa, lora_b, scale, n1, n2, bias=None, lora_b_diag=None):
    return torch.empty_like(base)


def lora_expand(base, xa, lora_b, scale, sizes=None, bias=None, lora_b_diag=None):
    """base (M, N) (+ bias) + scale * xa @ B.T for up to three stacked LoRA layers (`sizes` along N; xa
    (M, segments x r) = x @ stacked A.T, B (N, r)) as one op (qerl::lora_expand): one pass over the output on CUDA
    where choose_kernel("expand") says so, torch's addmm elsewhere. Inference only (no autograd formula)."""
    n1, n2 = stack_bounds([int(v) for v in (sizes or [base.shape[1]])], base.shape[1])
    return _lora_expand_op(base, xa, lora_b, float(scale), n1, n2, bias, lora_b_diag)


def fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias=None):
    """x (..., K) @ deq(W).T -> (..., N) (+ bias) on the kernel of choose_kernel (custom op qerl::fp4_matmul)."""
    return _fp4_matmul_op(x, weight_packed, weight_scale, weight_global_scale, bias)


def fp4_matmul_t(grad_out, weight_packed, weight_scale, weight_global_scale):
    """grad_out (..., N) @ deq(W) -> (..., K), the input gradient of fp4_matmul (custom op qerl::fp4_matmul_t)."""
    return _fp4_matmul_t_op(grad_out, weight_packed, weight_scale, weight_global_scale)


def fp4_lora_matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b, lora_scale,
                    segments=None, lora_b_diag=None):
    """Inference-only x @ deq(W).T (+ bias) + lora_scale * (x @ A.T) @ B.T as one op (qerl::fp4_lora_matmul): on
    CUDA the B product is added in the FP4 kernel's epilogue (one small GEMM for x @ A.T, or none on the CUDA
    kernel, no B GEMM, no add kernel). It has no autograd formula: training goes through FP4Linear + peft's
    separate adapter modules.

    segments: sizes along N of up to three layers that read the same x, stacked in W (rows), the global scale
    (one per segment), A (one (r, K) block per segment) and B (rows): q/k/v or gate/up in one launch.
    lora_b_diag: optionally B laid out block-diagonally (N, segments x r): where the B product is a cuBLAS GEMM
    (humming's kernel) it is one GEMM instead of one per segment. lora_a = lora_b = None: the stacked base alone
    (plain projections, qerl.quant.grouped)."""
    n = weight_packed.shape[0]
    return _fp4_lora_matmul_op(x, weight_packed, weight_scale, weight_global_scale, bias, lora_a, lora_b,
                               float(lora_scale), [int(v) for v in (segments or [n])], lora_b_diag)


def small_matmul(x, w):
    """x (M, K) @ w (N, K).T for few rows and a narrow w (a stacked LoRA A): one split-K Triton launch on CUDA
    (choose_kernel's "small" rows), torch elsewhere. A custom op, so that torch.compile treats it as one opaque
    kernel instead of tracing the launcher (its workspace cache and launch grid)."""
    return _small_matmul_op(x, w)
