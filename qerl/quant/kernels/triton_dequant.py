"""Many-row NVFP4 matmuls: dequantize one bounded chunk of W at a time with Triton, multiply it with cuBLAS.

From a few hundred rows on, a bf16 GEMM is compute bound and cuBLAS's Hopper kernels beat any fused W4A16 Triton
kernel (there the dequantization competes with the tensor cores for issue slots). So `qerl.quant.dispatch` sends
those shapes here: W is rebuilt in chunks of at most CHUNK_ELEMENTS (two bf16 buffers, 2 x 64 MiB), each chunk
dequantized on a side stream while cuBLAS multiplies the previous one, so the dequantization (memory bound) hides
under the matmul (compute bound). A weight of at most CHUNK_ELEMENTS is one chunk, dequantized then multiplied.
No more than 128 MiB of dense weight exists at a time, and nothing dense outlives the call.

    dense_fp4_matmul(x2, weight_packed, weight_scale, weight_global_scale, bias, out)     # out = x2 @ deq(W).T
    dense_fp4_matmul_t(g2, weight_packed, weight_scale, weight_global_scale, out)        # out = g2 @ deq(W)
    dense_fp4_lora_matmul(x2, ..., xa, lora_b, lora_scale, n1, n2, out)                  # stacked weights + LoRA
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qerl.quant.kernels.triton_fp4 import DEQ_GAIN, _dequant_tile

# A weight up to this size is one chunk and one GEMM: splitting a 7B q/o (12.8 M elements) in two to overlap its
# ~10 us dequantization cost ~0.2 ms per 16,640-row call on an H100 (smaller GEMMs; a bias broadcast into
# column blocks of the output), more than the overlap saved.
CHUNK_ELEMENTS = 32 * 2**20


# Bandwidth-bound; the best tile differs between GPUs, so it is measured once per column count (autotune).
_DEQUANT_CONFIGS = [triton.Config({"BR": br, "BC": bc}, num_warps=w)
                    for br, bc, w in ((32, 256, 4), (64, 256, 8), (16, 512, 4), (128, 128, 8), (64, 512, 8))]


@triton.autotune(configs=_DEQUANT_CONFIGS, key=["C"])
@triton.jit
def _dequant_kernel(wp_ptr, ws_ptr, gs_ptr, out_ptr, R, C, swn, ssn, so,
                    BR: tl.constexpr, BC: tl.constexpr, USE_ASM: tl.constexpr):
    """out[r, c] = e2m1 * scale / global_scale for a (BR, BC) tile of a (R, C) block of W (C % 16 == 0)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_b = tl.program_id(1) * (BC // 2) + tl.arange(0, BC // 2)
    offs_g = tl.program_id(1) * (BC // 16) + tl.arange(0, BC // 16)
    rmask = rows[:, None] < R
    p = tl.load(wp_ptr + rows[:, None].to(tl.int64) * swn + offs_b[None, :],
                mask=rmask & (offs_b[None, :] < C // 2), other=0)
    s = tl.load(ws_ptr + rows[:, None].to(tl.int64) * ssn + offs_g[None, :],
                mask=rmask & (offs_g[None, :] < C // 16), other=0)
    s = s.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    w = _dequant_tile(p, s, BR, BC, USE_ASM).to(tl.float32) * (DEQ_GAIN / tl.load(gs_ptr))
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * so + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=rmask & (cols[None, :] < C))


def dequantize_into(out: torch.Tensor, weight_packed, weight_scale, weight_global_scale, use_asm: bool = True):
    """Write deq(W) of the packed block (rows x cols/2 bytes; any row stride) into out (rows, cols)."""
    r, c = out.shape
    scale_u8 = weight_scale.view(torch.uint8)
    _dequant_kernel[lambda meta: (triton.cdiv(r, meta["BR"]), triton.cdiv(c, meta["BC"]))](
        weight_packed, scale_u8, weight_global_scale, out, r, c, weight_packed.stride(0), scale_u8.stride(0),
        out.stride(0), USE_ASM=use_asm)
    return out


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _chunks(length: int, other: int, align: int) -> list[tuple[int, int]]:
    """Split `length` (rows or cols of W) into aligned pieces of at most CHUNK_ELEMENTS elements."""
    n = math.ceil(length * other / CHUNK_ELEMENTS)
    step = max(align, math.ceil(length / n / align) * align)
    return [(a, min(a + step, length)) for a in range(0, length, step)]


def _pipelined(chunks, buf_shape, dtype, device, dequant, consume) -> None:
    """dequant(chunk, buf) on a side stream overlapped with consume(chunk, buf) on the current stream."""
    if len(chunks) == 1:
        buf = torch.empty(buf_shape(chunks[0]), dtype=dtype, device=device)
        dequant(chunks[0], buf)
        consume(chunks[0], buf)
        return
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.setdefault(device.index or 0, torch.cuda.Stream(device))
    full = buf_shape((0, max(b - a for a, b in chunks)))
    bufs = [torch.empty(full, dtype=dtype, device=device) for _ in range(2)]
    done: list[torch.cuda.Event | None] = [None, None]
    side.wait_stream(main)  # the packed weight, x and the buffers are ready
    for i, chunk in enumerate(chunks):
        j = i % 2
        shape = buf_shape(chunk)
        buf = bufs[j].view(-1)[: math.prod(shape)].view(shape)
        with torch.cuda.stream(side):
            if done[j] is not None:
                side.wait_event(done[j])  # the matmul that read this buffer two chunks ago is finished
            dequant(chunk, buf)
            ready = torch.cuda.Event()
            ready.record(side)
        main.wait_event(ready)
        consume(chunk, buf)
        done[j] = torch.cuda.Event()
        done[j].record(main)


def dense_fp4_matmul(x2, weight_packed, weight_scale, weight_global_scale, bias, out, use_asm=True):
    """out (M, N) = x2 @ deq(W).T (+ bias), W rebuilt in chunks of rows."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    gs = weight_global_scale.reshape(1).float()

    def dequant(chunk, buf):
        a, b = chunk
        dequantize_into(buf, weight_packed[a:b], weight_scale[a:b], gs, use_asm)

    def consume(chunk, buf):
        a, b = chunk
        if bias is None:
            torch.matmul(x2, buf.T, out=out[:, a:b])
        else:
            torch.addmm(bias[a:b].to(out.dtype), x2, buf.T, out=out[:, a:b])

    _pipelined(_chunks(n, k, 256), lambda c: (c[1] - c[0], k), x2.dtype, x2.device, dequant, consume)
    return out


def dense_fp4_lora_matmul(x2, weight_packed, weight_scale, weight_global_scale, bias, xa, lora_b,
                          lora_scale: float, n1: int, n2: int, out: torch.Tensor, use_asm: bool = True):
    """out (M, N) = x2 @ deq(W).T (+ bias) (+ lora_scale * xa[:, seg] @ lora_b.T) for up to three weights stacked
    along N (rows [0, n1), [n1, n2), [n2, N), one global scale each), as kernels.triton_fp4.fp4_matmul_fused."""
    n = weight_packed.shape[0]
    r = 0 if lora_b is None else lora_b.shape[1]
    for i, (a, b) in enumerate(((0, n1), (n1, n2), (n2, n))):
        if b > a:
            dense_fp4_matmul(x2, weight_packed[a:b], weight_scale[a:b], weight_global_scale.reshape(-1)[i],
                             None if bias is None else bias[a:b], out[:, a:b], use_asm)
            if xa is not None:
                out[:, a:b].addmm_(xa[:, i * r:(i + 1) * r], lora_b[a:b].T, alpha=lora_scale)
    return out


def dense_fp4_matmul_t(g2, weight_packed, weight_scale, weight_global_scale, out, use_asm=True):
    """out (M, K) = g2 @ deq(W), W rebuilt in chunks of columns (each output column block computed once)."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    gs = weight_global_scale.reshape(1).float()

    def dequant(chunk, buf):
        a, b = chunk
        dequantize_into(buf, weight_packed[:, a // 2:b // 2], weight_scale[:, a // 16:b // 16], gs, use_asm)

    def consume(chunk, buf):
        a, b = chunk
        torch.matmul(g2, buf, out=out[:, a:b])

    _pipelined(_chunks(k, n, 256), lambda c: (n, c[1] - c[0]), g2.dtype, g2.device, dequant, consume)
    return out
