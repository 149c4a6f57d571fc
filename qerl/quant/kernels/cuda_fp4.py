"""Hand-written CUDA forward for few-row NVFP4 matmuls, the default for <= 8 rows on Hopper (`QERL_FP4_CUDA`).

    y = fp4_matmul_cuda(x2, weight_packed, weight_scale, weight_global_scale, bias, xa, lora_b, lora_scale, n1, n2,
                        lora_a=...)

Same contract as the Triton kernel's few-row path (qerl.quant.triton_fp4.fp4_matmul_triton dispatches here): x2
(M <= 16, K) bf16 @ deq(W).T (+ bias) (+ lora_scale * (x @ A.T)[:, seg] @ lora_b.T), up to three stacked weights
along N with their own global scales. `QERL_FP4_CUDA`: "auto" (default) = rows <= AUTO_ROWS on sm_90+ with a
compiler (else one warning and Triton), "1" = rows <= MAX_ROWS on sm_89+, "0" = Triton only.

Design (few-row Triton launches are bound by on-chip work per weight, not bytes: BENCHMARKS.md, "(a) Kernels"): one
16-row block of W per CTA, or per thread-block cluster of S CTAs on Hopper, with the block's K chunks (128 weights)
split over its S x W warps; each warp runs `mma.sync` m16n8k16 with W as the A operand decoded in registers
(qerl.quant.ptx's bit trick) straight from 16-byte global loads, the K order permuted so one thread's 32 contiguous
weights of a row feed 8 MMAs, x read from L1 in the same order as the B operand (two 8-row tiles for M 9..16).
Partial tiles are summed in shared memory and, across a cluster, through distributed shared memory: no workspace, no
atomics, deterministic. Warp 0 of the block applies 128 / global_scale, bias and the LoRA B product (one more mma
per 16 of rank) and stores bf16. With `lora_a`, x @ A.T is computed in the same launch: the first blocks of the grid
are A's 16-row blocks in K slices writing fp32 partials; in each weight block the other warps wait for them with an
acquire load and sum them in a fixed order into shared memory while warp 0 sums the block's partial tiles, and the
last weight block resets the flags (CUDA-graph safe). (cluster, warps) come from `model_time`, fitted to an H100
sweep. Under `QERL_PDL` (default: while a CUDA graph is captured, sm_90+) launches use programmatic dependent
launch: a CTA requests its first weight chunk, then waits (griddepcontrol.wait) for the previous kernel before
reading x or writing anything. Built once per device by NVRTC (libnvrtc and the CUDA headers ship with CUDA builds
of torch) or nvcc, launched through the driver API on torch's current stream. Outside the envelope (fp16/fp32 x,
K % 128, N or segment bounds % 16, more rows) the Triton kernel runs.

Measured (`python -m bench.wired`): BENCHMARKS.md, "Stacked decode layer" and "Few-row CUDA kernel".
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from qerl.quant import ptx
from qerl.quant.kernels import _fp8_capable

CHUNK = 128  # weights per row per chunk
MAX_ROWS = 16  # the kernels' limit (two 8-row MMA tiles)
AUTO_ROWS = 8  # default-on limit: at 9-16 rows the two-tile kernel lost to Triton (BENCHMARKS.md, "Few-row CUDA")
MAX_WARPS = 16  # the kernels' __launch_bounds__ (32 x MAX_WARPS threads)
MAX_FUSED_RANK = 128  # x @ A.T in the same launch up to this LoRA rank (its M x R bf16 tile in shared memory)


def _decode8() -> str:
    """decode8(w, s2, o0..o3): qerl.quant.ptx's E2M1 -> bf16 PTX (the same text the Triton kernels inline and the
    CPU emulator test checks) as a CUDA asm block, one scale pair s2 for all four output registers."""
    text = ptx.E2M1_BF16.strip()
    for j in (6, 7, 8):
        text = text.replace(f"${j}", "$5")
    lines = "".join(f'      "{line}\\n"\n' for line in text.replace("$", "%").splitlines())
    return ("__device__ __forceinline__ void decode8(uint32_t w, uint32_t s2, uint32_t &o0, uint32_t &o1,\n"
            "                                        uint32_t &o2, uint32_t &o3) {\n  asm(\n" + lines
            + '      : "=r"(o0), "=r"(o1), "=r"(o2), "=r"(o3)\n      : "r"(w), "r"(s2));\n}\n')


DEVICE_COMMON = r"""#include <cuda_bf16.h>
#include <cuda_fp8.h>
#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#else
#include <stdint.h>
#endif

""" + _decode8() + r"""
__device__ __forceinline__ uint32_t scale_pair(uint32_t byte) {  // bf16(fp8 scale * 2^119) in both halves
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)byte, __NV_E4M3);
  __nv_bfloat16 b = __float2bfloat16_rn(__half2float(__half(h)) * 6.646139978924579e+35f);
  uint32_t bits = (uint32_t)(*reinterpret_cast<uint16_t *>(&b));
  return bits | (bits << 16);
}

__device__ __forceinline__ void mma16816(float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int NT>
struct Chunk {
  uint4 wa, wb;
  uint16_t sa, sb;
  uint4 x[NT][4];
};

__device__ __forceinline__ void grid_dep_wait() {  // programmatic dependent launch: the previous kernel is done
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dep_launch() {  // the next kernel may start launching (it waits for us)
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// chunk c (128 weights per row) of rows g and g + 8 for lane (g, t): 16 B of each row and its two group scales.
// TILED: W re-laid out as [N / 16][K / 128][16 rows][64 B] (a prototype's layout; the kernels below use false).
template <bool TILED, int NT>
__device__ __forceinline__ void load_w(Chunk<NT> &ch, const uint8_t *wg, const uint8_t *wg8, const uint8_t *sg,
                                       const uint8_t *sg8, int c, int t) {
  const int kb = TILED ? c * 1024 + 16 * t : c * 64 + 16 * t;
  ch.wa = __ldg(reinterpret_cast<const uint4 *>(wg + kb));
  ch.wb = __ldg(reinterpret_cast<const uint4 *>(wg8 + kb));
  const int gi = c * 8 + 2 * t;
  ch.sa = __ldg(reinterpret_cast<const unsigned short *>(sg + gi));
  ch.sb = __ldg(reinterpret_cast<const unsigned short *>(sg8 + gi));
}

// the 32 bf16 of x rows nt * 8 + g that chunk c of lane (g, t) multiplies (zeros past M)
template <int NT>
__device__ __forceinline__ void load_x(Chunk<NT> &ch, const __nv_bfloat16 *const *xg, const bool *xok, int c,
                                       int t) {
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    if (xok[nt]) {
      const uint4 *xp = reinterpret_cast<const uint4 *>(xg[nt] + c * 128 + 32 * t);
#pragma unroll
      for (int i = 0; i < 4; i++) ch.x[nt][i] = __ldg(xp + i);
    } else {
#pragma unroll
      for (int i = 0; i < 4; i++) ch.x[nt][i] = make_uint4(0, 0, 0, 0);
    }
  }
}

template <bool TILED, int NT>
__device__ __forceinline__ void load_chunk(Chunk<NT> &ch, const uint8_t *wg, const uint8_t *wg8, const uint8_t *sg,
                                           const uint8_t *sg8, const __nv_bfloat16 *const *xg, const bool *xok,
                                           int c, int t) {
  load_w<TILED, NT>(ch, wg, wg8, sg, sg8, c, t);
  load_x<NT>(ch, xg, xok, c, t);
}

template <int NT>
__device__ __forceinline__ void compute_chunk(const Chunk<NT> &ch, float (*acc)[4]) {
  uint32_t A[4][4], B[4][4];
  const uint32_t wa[4] = {ch.wa.x, ch.wa.y, ch.wa.z, ch.wa.w};
  const uint32_t wb[4] = {ch.wb.x, ch.wb.y, ch.wb.z, ch.wb.w};
  const uint32_t sa0 = scale_pair(ch.sa & 0xFF), sa1 = scale_pair(ch.sa >> 8);
  const uint32_t sb0 = scale_pair(ch.sb & 0xFF), sb1 = scale_pair(ch.sb >> 8);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    decode8(wa[i], i < 2 ? sa0 : sa1, A[i][0], A[i][1], A[i][2], A[i][3]);
    decode8(wb[i], i < 2 ? sb0 : sb1, B[i][0], B[i][1], B[i][2], B[i][3]);
  }
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    const uint32_t *xr = reinterpret_cast<const uint32_t *>(ch.x[nt]);
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const int i = j / 2, p = (j % 2) * 2;
      mma16816(acc[nt], A[i][p], B[i][p], A[i][p + 1], B[i][p + 1], xr[2 * j], xr[2 * j + 1]);
    }
  }
}

// the warp's 16 x (8 NT) fp32 tile over chunks [c0, c1): rows r0 + g and r0 + g + 8 (rows past N read row N - 1,
// never stored), x rows nt * 8 + g < M (zeros past M). Fragment acc[nt]: [0], [1] = (row r0 + g, m = 8 nt + 2t,
// 2t + 1); [2], [3] = (row r0 + g + 8, same m). The next chunk's loads are in flight while one is computed.
template <bool TILED, int NT>
__device__ __forceinline__ void accumulate(float (*acc)[4], const uint8_t *wp, const uint8_t *ws,
                                           const __nv_bfloat16 *x, int sxm, int M, int N, int K, int rb, int c0,
                                           int c1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, r0 = rb * 16;
  const int kh = K / 2, kg = K / 16;
  const int rg = min(r0 + g, N - 1), rg8 = min(r0 + g + 8, N - 1);
  const uint8_t *wg = TILED ? wp + (size_t)rb * 16 * kh + g * 64 : wp + (size_t)rg * kh;
  const uint8_t *wg8 = TILED ? wg + 8 * 64 : wp + (size_t)rg8 * kh;
  const uint8_t *sg = ws + (size_t)rg * kg, *sg8 = ws + (size_t)rg8 * kg;
  bool xok[NT];
  const __nv_bfloat16 *xg[NT];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    xok[nt] = nt * 8 + g < M;
    xg[nt] = x + (size_t)(xok[nt] ? nt * 8 + g : 0) * sxm;
  }
  // the first chunk's weights are requested before waiting for the previous kernel (they are not its output:
  // with programmatic dependent launch this overlaps its end), its x after
  Chunk<NT> ca, cb;
  if (c0 < c1) load_w<TILED, NT>(ca, wg, wg8, sg, sg8, c0, t);
  grid_dep_wait();
  grid_dep_launch();
  if (c0 < c1) load_x<NT>(ca, xg, xok, c0, t);
  for (int c = c0; c < c1; c += 2) {
    if (c + 1 < c1) load_chunk<TILED, NT>(cb, wg, wg8, sg, sg8, xg, xok, c + 1, t);
    compute_chunk<NT>(ca, acc);
    if (c + 1 < c1) {
      if (c + 2 < c1) load_chunk<TILED, NT>(ca, wg, wg8, sg, sg8, xg, xok, c + 2, t);
      compute_chunk<NT>(cb, acc);
    }
  }
}
"""

SOURCE = DEVICE_COMMON + f"#define MAX_WARPS {MAX_WARPS}\n#define MAX_FUSED_RANK {MAX_FUSED_RANK}\n" + r"""

__device__ __forceinline__ uint32_t bf16_pair(const __nv_bfloat16 *p, int k, int R, bool ok, bool wide) {
  // (p[k], p[k + 1]) as one bf16x2 register (k even), zeros past R or when !ok; wide: one 4-byte load (p
  // 4-byte aligned and R even)
  if (wide) return ok && k < R ? *reinterpret_cast<const uint32_t *>(p + k) : 0u;
  const unsigned short *q = reinterpret_cast<const unsigned short *>(p + k);
  const uint32_t lo = ok && k < R ? (uint32_t)q[0] : 0u;
  const uint32_t hi = ok && k + 1 < R ? (uint32_t)q[1] : 0u;
  return lo | (hi << 16);
}

// the A fragment of lb[r0 .. r0 + 16, kk .. kk + 16] (rows past N read as zeros)
__device__ __forceinline__ void lb_frag(uint32_t *a, const __nv_bfloat16 *lb, int slb, int R, int r0, int N, int kk,
                                        bool wide) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const __nv_bfloat16 *la = lb + (size_t)r0 * slb;
  const bool ok0 = r0 + g < N, ok8 = r0 + g + 8 < N;
  a[0] = bf16_pair(la + (size_t)g * slb, kk + 2 * t, R, ok0, wide);
  a[1] = bf16_pair(la + (size_t)(g + 8) * slb, kk + 2 * t, R, ok8, wide);
  a[2] = bf16_pair(la + (size_t)g * slb, kk + 2 * t + 8, R, ok0, wide);
  a[3] = bf16_pair(la + (size_t)(g + 8) * slb, kk + 2 * t + 8, R, ok8, wide);
}

// lo[nt] += a (16 rows x k kk .. kk + 16) @ xa[nt * 8 .. + 8, kk .. kk + 16].T (xa: row stride sxa, shared or global)
template <int NT>
__device__ __forceinline__ void lora_step(float (*lo)[4], const uint32_t *a, const __nv_bfloat16 *xa, int sxa,
                                          int R, int M, int kk) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    const int m = nt * 8 + g;
    const __nv_bfloat16 *xr = xa + (size_t)(m < M ? m : 0) * sxa;
    mma16816(lo[nt], a[0], a[1], a[2], a[3], bf16_pair(xr, kk + 2 * t, R, m < M, false),
             bf16_pair(xr, kk + 2 * t + 8, R, m < M, false));
  }
}

// lo[nt] += lb[r0 .. r0 + 16, :R] @ xa[nt * 8 .. + 8, :R].T in the accumulator's fragment layout, the first two
// steps' A fragments (pre, loaded by lb_frag) given
template <int NT>
__device__ __forceinline__ void lora_tile(float (*lo)[4], const __nv_bfloat16 *xa, int sxa, const __nv_bfloat16 *lb,
                                          int slb, int R, int r0, int M, int N, bool wide, const uint32_t (*pre)[4]) {
  if (R > 0) lora_step<NT>(lo, pre[0], xa, sxa, R, M, 0);
  if (R > 16) lora_step<NT>(lo, pre[1], xa, sxa, R, M, 16);
  for (int kk = 32; kk < R; kk += 16) {
    uint32_t a[4];
    lb_frag(a, lb, slb, R, r0, N, kk, wide);
    lora_step<NT>(lo, a, xa, sxa, R, M, kk);
  }
}

// xs[m * R + j] = bf16(sum over ks of xw[ks][m][col + j]) for m < M, j < R: the A blocks' fp32 partials of this
// launch (read through L2), summed in a fixed order and rounded like the unfused x @ A.T; thread tid of nth
__device__ __forceinline__ void gather_xa(__nv_bfloat16 *xs, const float *xw, int SA, int M, int RA, int col,
                                          int R, int tid, int nth) {
  const size_t step = (size_t)M * RA;
  for (int e = tid; e < M * R; e += nth) {
    const int m = e / R, j = e % R;
    const float *q = xw + (size_t)m * RA + col + j;
    float v = 0.f;
    for (int ks = 0; ks < SA; ks++) v += __ldcg(q + ks * step);
    xs[e] = __float2bfloat16_rn(v);
  }
}

// the warp's 16 x (8 NT) fp32 tile of x @ A.T over chunks [c0, c1) for bf16 rows A[r0 .. r0 + 16] (rows past RA
// read row RA - 1, never stored): lane (g, t) takes 32 contiguous k per chunk of rows g, g + 8 and of x rows
// nt * 8 + g, the same permuted order as the FP4 path, in two halves of 16 (4 MMAs each), so that these few
// blocks do not raise the kernel's register count.
template <int NT>
__device__ __forceinline__ void accumulate_bf16(float (*acc)[4], const __nv_bfloat16 *a, int sa,
                                                const __nv_bfloat16 *x, int sxm, int M, int RA, int r0, int c0,
                                                int c1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint4 *ag = reinterpret_cast<const uint4 *>(a + (size_t)min(r0 + g, RA - 1) * sa + 32 * t);
  const uint4 *ag8 = reinterpret_cast<const uint4 *>(a + (size_t)min(r0 + g + 8, RA - 1) * sa + 32 * t);
#pragma unroll 1
  for (int h = c0 * 2; h < c1 * 2; h++) {  // half chunk h: k = (h / 2) * 128 + 32 t + (h % 2) * 16 + 0..15
    const int off = (h >> 1) * 16 + (h & 1) * 2;  // in uint4 of the row
    uint4 w[2], v[2], xv[NT][2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      w[i] = __ldg(ag + off + i);
      v[i] = __ldg(ag8 + off + i);
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const int m = nt * 8 + g;
      const uint4 *xp = reinterpret_cast<const uint4 *>(x + (size_t)(m < M ? m : 0) * sxm + 32 * t) + off;
#pragma unroll
      for (int i = 0; i < 2; i++) xv[nt][i] = m < M ? __ldg(xp + i) : make_uint4(0, 0, 0, 0);
    }
    const uint32_t *wr = reinterpret_cast<const uint32_t *>(w), *vr = reinterpret_cast<const uint32_t *>(v);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const uint32_t *xr = reinterpret_cast<const uint32_t *>(xv[nt]);
#pragma unroll
      for (int j = 0; j < 4; j++)
        mma16816(acc[nt], wr[2 * j], vr[2 * j], wr[2 * j + 1], vr[2 * j + 1], xr[2 * j], xr[2 * j + 1]);
    }
  }
}

__device__ __forceinline__ int ld_acquire(const int *p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ float ld_cluster(const float *p, int rank) {  // p in CTA `rank`'s shared memory
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p), r;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(r) : "memory");
  return v;
}

// One 16-row block of y = x @ deq(W).T per cluster of S CTAs (cluster rank = blockIdx.x % S); its K chunks are
// split over the S x W warps (W = blockDim.x / 32). Partial tiles are summed in shared memory, across the cluster
// through distributed shared memory; warp 0 of rank 0 applies 128 / global_scale[seg], bias and
// lora_scale * xa[m, seg] . lb[row] (one more mma per 16 of R) and stores bf16; it loads the global scale, bias
// and first LoRA B fragments before the reduction, so that their latency overlaps it. No atomics without LoRA A.
// With la (LoRA A, RA = segments x R bf16 rows of K): the first NAB x SA units (NAB = ceil(RA / 16) row blocks,
// each in SA K slices) compute fp32 partials of xa = x @ A.T the same way into the workspace xw (SA x M x RA) and
// count themselves in flags[0]; in each weight block, warps 1..W-1 (warp 0 when W = 1) wait for all of them (they
// were dispatched first) and sum the partials in a fixed order into shared memory while warp 0 sums the block's
// partial tiles; the last weight block to finish resets flags[0..1] for the next launch (CUDA-graph safe,
// deterministic). With programmatic dependent launch, the first weight loads overlap the end of the previous kernel
// (accumulate); nothing is read from it or written before griddepcontrol.wait.
template <int NT, int S>
__device__ __forceinline__ void fp4_mm_body(
    const uint8_t *__restrict__ wp, const uint8_t *__restrict__ ws, const float *__restrict__ gs,
    const __nv_bfloat16 *__restrict__ x, int sxm, __nv_bfloat16 *__restrict__ out, int som,
    const __nv_bfloat16 *__restrict__ bias, const __nv_bfloat16 *xa, int sxa,
    const __nv_bfloat16 *__restrict__ lb, int slb, float lora_scale, int M, int N, int K, int N1, int N2, int R,
    const __nv_bfloat16 *__restrict__ la, int sla, int SA, float *xw, int *flags) {
  __shared__ float red[MAX_WARPS][NT * 4][32];
  __shared__ __nv_bfloat16 xs[NT * 8 * MAX_FUSED_RANK];
  const int warp = threadIdx.x >> 5, W = blockDim.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int RA = la ? (N2 < N ? 3 : N1 < N ? 2 : 1) * R : 0, NAB = (RA + 15) / 16;
  const int rank = blockIdx.x % S, rb_all = blockIdx.x / S;
  const bool a_block = rb_all < NAB * SA;
  const int ks = a_block ? rb_all / NAB : 0;
  const int rb = a_block ? rb_all % NAB : rb_all - NAB * SA, r0 = rb * 16;
  const int C = K / 128, P = S * W, p = rank * W + warp;
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  if (a_block) {
    const int lo = C * ks / SA, n = C * (ks + 1) / SA - lo;
    grid_dep_wait();  // x is the previous kernel's output
    accumulate_bf16<NT>(acc, la, sla, x, sxm, M, RA, r0, lo + n * p / P, lo + n * (p + 1) / P);
  } else
    accumulate<false, NT>(acc, wp, ws, x, sxm, M, N, K, rb, C * p / P, C * (p + 1) / P);
  const bool finish = !a_block && rank == 0;  // this CTA stores the block
  const bool fused = la && finish;
  const int seg = (r0 >= N1) + (r0 >= N2);  // segment bounds are multiples of 16
  const bool wide = (R % 2 == 0) && (slb % 2 == 0) && ((reinterpret_cast<size_t>(lb) & 3) == 0);
  float sc = 0.f, b0 = 0.f, b8 = 0.f;
  uint32_t pre[2][4] = {{0u, 0u, 0u, 0u}, {0u, 0u, 0u, 0u}};
  if (finish && warp == 0) {  // epilogue loads in flight during the reduction
    sc = 128.0f / gs[seg];
    if (bias) {
      b0 = r0 + g < N ? __bfloat162float(bias[r0 + g]) : 0.f;
      b8 = r0 + g + 8 < N ? __bfloat162float(bias[r0 + g + 8]) : 0.f;
    }
    if (lb && R > 0) lb_frag(pre[0], lb, slb, R, r0, N, 0, wide);
    if (lb && R > 16) lb_frag(pre[1], lb, slb, R, r0, N, 16, wide);
  }
  if (W > 1) {
    if (warp > 0) {
#pragma unroll
      for (int i = 0; i < NT * 4; i++) red[warp][i][lane] = acc[i / 4][i % 4];
    }
    __syncthreads();
    if (warp == 0) {
      for (int w = 1; w < W; w++) {
#pragma unroll
        for (int i = 0; i < NT * 4; i++) acc[i / 4][i % 4] += red[w][i][lane];
      }
    } else if (fused) {  // warps 1..W-1: this launch's x @ A.T into xs
      while (ld_acquire(flags) < NAB * SA) {
      }
      gather_xa(xs, xw, SA, M, RA, seg * R, R, threadIdx.x - 32, blockDim.x - 32);
    }
  }
  if (S > 1) {
    if (warp == 0) {
#pragma unroll
      for (int i = 0; i < NT * 4; i++) red[0][i][lane] = acc[i / 4][i % 4];
    }
    cluster_sync_all();  // every rank's block sum is in its red[0]
    if (rank == 0 && warp == 0) {
      for (int q = 1; q < S; q++) {
#pragma unroll
        for (int i = 0; i < NT * 4; i++) acc[i / 4][i % 4] += ld_cluster(&red[0][i][lane], q);
      }
    }
    cluster_sync_all();  // rank 0 has read them: the others may exit
  }
  if (rank != 0) return;
  if (fused) {
    if (W == 1) {
      while (ld_acquire(flags) < NAB * SA) {
      }
      gather_xa(xs, xw, SA, M, RA, seg * R, R, lane, 32);
    }
    __syncthreads();  // xs complete
  }
  if (warp != 0) return;
  if (a_block) {  // this unit's fp32 partial of xa
#pragma unroll
    for (int i = 0; i < NT * 4; i++) {
      const int nt = i / 4, j = i % 4;
      const int row = r0 + g + (j >= 2 ? 8 : 0), m = nt * 8 + 2 * t + (j & 1);
      if (m < M && row < RA) xw[((size_t)ks * M + m) * RA + row] = acc[nt][j];
    }
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(flags, 1);
    return;
  }
  float lo[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) lo[nt][0] = lo[nt][1] = lo[nt][2] = lo[nt][3] = 0.f;
  if (fused) {
    lora_tile<NT>(lo, xs, R, lb, slb, R, r0, M, N, wide, pre);
    if (lane == 0 && atomicAdd(flags + 1, 1) == N / 16 - 1) {  // the last reader: reset for the next launch
      flags[1] = 0;
      atomicExch(flags, 0);
    }
  } else if (xa) {
    lora_tile<NT>(lo, xa + seg * R, sxa, lb, slb, R, r0, M, N, wide, pre);
  }
#pragma unroll
  for (int i = 0; i < NT * 4; i++) {
    const int nt = i / 4, j = i % 4;
    const int row = r0 + g + (j >= 2 ? 8 : 0), m = nt * 8 + 2 * t + (j & 1);
    if (m < M && row < N) {
      const float y = acc[nt][j] * sc + lora_scale * lo[nt][j] + (j >= 2 ? b8 : b0);
      out[(size_t)m * som + row] = __float2bfloat16_rn(y);
    }
  }
}

#define FP4_MM_ARGS                                                                                              \
  const uint8_t *__restrict__ wp, const uint8_t *__restrict__ ws, const float *__restrict__ gs,                 \
      const __nv_bfloat16 *__restrict__ x, int sxm, __nv_bfloat16 *__restrict__ out, int som,                  \
      const __nv_bfloat16 *__restrict__ bias, const __nv_bfloat16 *xa, int sxa,                                \
      const __nv_bfloat16 *__restrict__ lb, int slb, float lora_scale, int M, int N, int K, int N1, int N2, int R, \
      const __nv_bfloat16 *__restrict__ la, int sla, int SA, float *xw, int *flags
#define FP4_MM_PASS \
  wp, ws, gs, x, sxm, out, som, bias, xa, sxa, lb, slb, lora_scale, M, N, K, N1, N2, R, la, sla, SA, xw, flags
// NT = 1: at most 80 registers (without the cap ptxas takes 87 for the LoRA-A branch: 5 instead of 6 CTAs of 4
// warps per SM; 80 spills nothing); NT = 2: whatever 512 threads allow.
#define FP4_MM_BOUNDS_1 __maxnreg__(80)
#define FP4_MM_BOUNDS_2 __launch_bounds__(32 * MAX_WARPS)
#define FP4_MM_KERNEL(NT, S, ATTR)                                                                              \
  extern "C" __global__ void FP4_MM_BOUNDS_##NT ATTR fp4_mm_n##NT##_s##S(FP4_MM_ARGS) {                        \
    fp4_mm_body<NT, S>(FP4_MM_PASS);                                                                           \
  }

FP4_MM_KERNEL(1, 1, )
FP4_MM_KERNEL(2, 1, )
#ifdef QERL_CLUSTERS
FP4_MM_KERNEL(1, 2, __cluster_dims__(2, 1, 1))
FP4_MM_KERNEL(1, 4, __cluster_dims__(4, 1, 1))
FP4_MM_KERNEL(1, 8, __cluster_dims__(8, 1, 1))
FP4_MM_KERNEL(2, 2, __cluster_dims__(2, 1, 1))
FP4_MM_KERNEL(2, 4, __cluster_dims__(4, 1, 1))
FP4_MM_KERNEL(2, 8, __cluster_dims__(8, 1, 1))
#endif
"""


def _find_nvrtc() -> tuple[Path, Path] | None:
    """libnvrtc and the include dir with cuda_bf16.h: the CUDA torch wheel's nvidia package, else CUDA_HOME."""
    roots = [Path(torch.__file__).parent.parent / "nvidia"]
    roots += [Path(p) for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p]
    for root in roots:
        if not root.exists():
            continue
        libs = [lib for lib in sorted(root.glob("**/libnvrtc.so*"))
                if "builtins" not in lib.name and ".alt." not in lib.name]
        heads = sorted(root.glob("**/cuda_bf16.h"))
        if libs and heads:
            return libs[0], heads[0].parent
    return None


def _find_nvcc(nvcc: str | None = None) -> str | None:
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return nvcc if Path(nvcc).exists() or shutil.which(nvcc) else None


def compilers() -> list[str]:
    """The CUDA compilers `compile_cubin` can use here, in its order of preference: "nvcc", "nvrtc"."""
    return [name for name, found in (("nvcc", _find_nvcc()), ("nvrtc", _find_nvrtc())) if found is not None]


def _compile_nvrtc(source: str, arch: str) -> bytes:
    found = _find_nvrtc()
    if found is None:
        raise RuntimeError("NVRTC not found (no libnvrtc.so + cuda_bf16.h in torch's nvidia package or CUDA_HOME)")
    lib_path, include = found
    lib = ctypes.CDLL(str(lib_path))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"qerl_fp4.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), f"-I{include}".encode(), b"--std=c++17"]
    try:
        if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed: {log.value.decode(errors='replace').strip().splitlines()[:3]}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_cubin(source: str, arch: str, compiler: str = "auto", nvcc: str | None = None) -> bytes:
    """A cubin of `source` for `arch` (e.g. sm_90): nvcc when there is one (auto, nvcc), else NVRTC (auto, nvrtc);
    one clear error when neither is there or the source does not build."""
    nvcc_path = _find_nvcc(nvcc) if compiler in ("auto", "nvcc") else None
    if nvcc_path is None:
        if compiler == "nvcc":
            raise RuntimeError(f"nvcc not found (looked on PATH and at {nvcc or '/usr/local/cuda/bin/nvcc'})")
        return _compile_nvrtc(source, arch)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "qerl_fp4.cu"), Path(tmp, "qerl_fp4.cubin")
        src.write_text(source)
        proc = subprocess.run([nvcc_path, "-cubin", f"-arch={arch}", "-O3", "-o", str(out), str(src)],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(f"nvcc failed: {proc.stderr.strip().splitlines()[:3]}")
        return out.read_bytes()


class CudaModule:
    """A cubin loaded into torch's CUDA context of one device (default: the current one); `launch` runs one of its
    kernels on that device's current stream (the caller makes the device current)."""

    def __init__(self, cubin: bytes, names: list[str], device_index: int | None = None):
        self.device_index = torch.cuda.current_device() if device_index is None else device_index
        with torch.cuda.device(self.device_index):
            torch.zeros(1, device=f"cuda:{self.device_index}")  # torch's primary context is current
            self._cuda = ctypes.CDLL("libcuda.so.1")
            self._cubin = cubin
            self._mod = ctypes.c_void_p()
            self._check(self._cuda.cuModuleLoadData(ctypes.byref(self._mod), cubin), "cuModuleLoadData")
        self.functions = {}
        for name in names:
            fn = ctypes.c_void_p()
            self._check(self._cuda.cuModuleGetFunction(ctypes.byref(fn), self._mod, name.encode()),
                        f"cuModuleGetFunction({name})")
            self.functions[name] = fn

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"{what} returned CUDA error {code}")

    def occupancy(self, name: str, block: int) -> int:
        """Resident CTAs per SM of kernel `name` at `block` threads (cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
        n = ctypes.c_int()
        self._check(self._cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self.functions[name],
                                                                           block, ctypes.c_size_t(0)),
                    f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")
        return n.value

    def launch(self, name: str, grid: tuple[int, int], block: int, args: list, pdl: bool = False) -> None:
        """pdl: programmatic dependent launch (sm_90+): the kernel may start while the previous kernel on the stream
        finishes and waits for it with griddepcontrol.wait before touching its output."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if not pdl:
            self._check(self._cuda.cuLaunchKernel(self.functions[name], grid[0], grid[1], 1, block, 1, 1, 0, stream,
                                                  params, None), f"cuLaunchKernel({name})")
            return
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value.int_value = 1
        config = _LaunchConfig(grid[0], grid[1], 1, block, 1, 1, 0, stream, ctypes.pointer(attr), 1)
        self._check(self._cuda.cuLaunchKernelEx(ctypes.byref(config), self.functions[name], params, None),
                    f"cuLaunchKernelEx({name})")


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class _LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("int_value", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def pdl_mode() -> str:
    """QERL_PDL: "auto" (default: programmatic dependent launch on sm_90+ while a CUDA graph is being captured, the
    decode step's case), "1" (on sm_90+ for every launch), "0" (off). With it a launch starts loading its weights
    while the previous kernel finishes: the FP4 base must not be written by the kernel just before the matmul
    (it never is in a captured decode step; "1" puts eager launches under the same rule)."""
    return _auto_on_off("QERL_PDL")


def use_pdl(device_index: int) -> bool:
    how = pdl_mode()
    if how == "0" or not _hopper(device_index):
        return False
    return how == "1" or torch.cuda.is_current_stream_capturing()


def mode() -> str:
    """QERL_FP4_CUDA: "auto" (default; rows <= AUTO_ROWS on sm_90+, where it was measured faster than Triton,
    falling back to Triton with one warning when no compiler is found), "1" (rows <= MAX_ROWS on sm_89+, build
    errors raise), "0" (off: the Triton kernel)."""
    return _auto_on_off("QERL_FP4_CUDA")


def _auto_on_off(name: str) -> str:
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{name}: expected auto, 0 or 1, got {value!r}")
    return value


CLUSTER_SIZES = (1, 2, 4, 8)
WARP_CHOICES = tuple(range(1, MAX_WARPS + 1))


@functools.cache
def _module(device_index: int) -> CudaModule:
    major, minor = torch.cuda.get_device_capability(device_index)
    clusters = major >= 9  # thread-block clusters and distributed shared memory: Hopper on
    names = [kernel_name(nt, s) for nt in (1, 2) for s in (CLUSTER_SIZES if clusters else (1,))]
    source = ("#define QERL_CLUSTERS 1\n" if clusters else "") + SOURCE
    return CudaModule(compile_cubin(source, f"sm_{major}{minor}"), names, device_index)


def kernel_name(n_tiles: int, cluster: int) -> str:
    return f"fp4_mm_n{n_tiles}_s{cluster}"


def supports(x2: torch.Tensor, weight_packed: torch.Tensor, n: int, k: int, n1: int, n2: int) -> bool:
    """Inside the kernel's envelope for the current mode (else the Triton kernel runs): bf16 x of 1..AUTO_ROWS
    rows on sm_90+ ("auto") or 1..MAX_ROWS on sm_89+ ("1"), K % 128, N and segment bounds % 16, 16-byte aligned
    rows, and a built module."""
    how = mode()
    if how == "0" or not (x2.is_cuda and x2.dtype == torch.bfloat16):
        return False
    dev = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    rows = AUTO_ROWS if how == "auto" else MAX_ROWS
    if not (0 < x2.shape[0] <= rows and k % CHUNK == 0 and n % 16 == 0 and n1 % 16 == 0 and n2 % 16 == 0
            and x2.stride(1) == 1 and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0
            and weight_packed.data_ptr() % 16 == 0 and _fp8_capable(dev)):
        return False
    if how == "auto":
        return _hopper(dev) and _built(dev)
    return True


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _built(device_index: int) -> bool:
    """Whether the module builds on this device; in "auto" mode a failure (no nvcc, no NVRTC) is one warning and
    the Triton kernel."""
    try:
        _module(device_index)
        return True
    except RuntimeError as err:
        warnings.warn(f"qerl.quant.cuda_fp4: {err}; few-row FP4 matmuls stay on Triton (QERL_FP4_CUDA=0 silences "
                      "this)", stacklevel=3)
        return False


def model_time(n: int, k: int, cluster: int, warps: int, sms: int, ctas_per_sm: int,
               step_over_latency: float = 0.08, wave_cost: float = 3.0, cluster_cost: float = 1.0) -> float:
    """Modelled time, in units of one warp's chunk step when latency bound, of one (cluster, warps) launch: the
    busiest SM runs ceil(blocks x cluster / sms) CTAs of `warps` warps, each warp ceil(chunks / (cluster x
    warps)) steps; a step costs max(1 / warps in flight on the SM, step_over_latency) (latency bound below ~12
    warps per SM, bandwidth bound above), plus `wave_cost` per wave of resident CTAs (pipeline fill, reduction,
    epilogue) and `cluster_cost` more with a cluster barrier. Constants fitted to an H100 sweep of every (cluster,
    warps) on the 7B shapes at M = 1 and 8 (`python -m bench.wired --warps ...`; fit: BENCHMARKS.md, "Few-row CUDA
    kernel")."""
    chunks, blocks = k // CHUNK, n // 16
    steps = math.ceil(chunks / (cluster * warps))
    per_sm = math.ceil(blocks * cluster / sms)
    waves = math.ceil(per_sm / ctas_per_sm)
    in_flight = min(ctas_per_sm, per_sm) * warps
    return (per_sm * warps * steps * max(1.0 / in_flight, step_over_latency)
            + waves * (wave_cost + cluster_cost * (cluster > 1)))


MIN_WARPS = 4  # CTAs of 1-2 warps were never the fastest (BENCHMARKS.md, "Few-row CUDA kernel")


def candidate_configs(k: int, clusters: bool) -> list[tuple[int, int]]:
    """(cluster, warps) with at least two chunks of 128 per warp and MIN_WARPS warps per CTA (fewer only when K
    is too short for that)."""
    chunks = k // CHUNK
    ok = [(s, w) for s in (CLUSTER_SIZES if clusters else (1,)) for w in WARP_CHOICES
          if s * w == 1 or chunks >= 2 * s * w]
    wide = [c for c in ok if c[1] >= MIN_WARPS]
    return wide or [max(ok, key=lambda c: (c[1], -c[0]))]


def pick_config(n: int, k: int, sms: int, occupancy, clusters: bool) -> tuple[int, int]:
    """The (cluster, warps) of least `model_time`; occupancy(warps) = resident CTAs per SM."""
    return min(candidate_configs(k, clusters),
               key=lambda c: (model_time(n, k, c[0], c[1], sms, max(1, occupancy(c[1]))), c[0], c[1]))


def _n_tiles(m: int) -> int:
    return 1 if m <= 8 else 2


@functools.cache
def _occupancy(device_index: int, name: str, warps: int) -> int:
    return _module(device_index).occupancy(name, 32 * warps)


@functools.cache
def _config(device_index: int, m_tiles: int, n: int, k: int) -> tuple[int, int]:
    major, _ = torch.cuda.get_device_capability(device_index)
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    name = kernel_name(m_tiles, 1)
    return pick_config(n, k, sms, lambda w: _occupancy(device_index, name, w), clusters=major >= 9)


_WORKSPACES: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
MAX_A_SPLITS = 32


def _workspace(device: torch.device, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials of x @ A.T, two int32 flags left at zero by every launch) per (device, stream). Warm a
    shape up before CUDA-graph capture so no allocation is captured."""
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).cuda_stream)
    xw, flags = _WORKSPACES.get(key, (None, None))
    if xw is None or xw.numel() < floats:
        xw = torch.empty(max(floats, 1 << 14), dtype=torch.float32, device=device)
    if flags is None:
        flags = torch.zeros(2, dtype=torch.int32, device=device)
    _WORKSPACES[key] = (xw, flags)
    return xw, flags


def a_splits(k: int, cluster: int, warps: int) -> int:
    """K slices of each 16-row block of LoRA A, so that its warps take ~2 chunks each and finish long before the
    weight blocks that wait for them."""
    return max(1, min(MAX_A_SPLITS, math.ceil(k // CHUNK / (2 * cluster * warps))))


def lora_a_product(x2: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    from qerl.quant.triton_fp4 import small_matmul

    return small_matmul(x2, lora_a)


def fp4_matmul_cuda(x2, weight_packed, weight_scale, weight_global_scale, bias, xa, lora_b, lora_scale: float,
                    n1: int, n2: int, config: tuple[int, int] | None = None, out: torch.Tensor | None = None,
                    lora_a: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) bf16 x -> (M, N) bf16 (into `out` when given, contiguous). LoRA: either xa = x @ A.T (M, segments x
    R) or lora_a (segments x R, K) bf16, computed in the same launch; lora_b (N, R) as from
    triton_fp4._lora_operands. config: (cluster size, warps per CTA), default `pick_config`."""
    m, k = x2.shape
    n = weight_packed.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x2.device)
    dev = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    nt = _n_tiles(m)
    cluster, warps = config or _config(dev, nt, n, k)
    wp = weight_packed.contiguous()
    ws = weight_scale.contiguous().view(torch.uint8)
    gs = weight_global_scale.reshape(-1).to(torch.float32).contiguous()
    b = bias.contiguous() if bias is not None else None
    r = 0 if lora_b is None else lora_b.shape[1]
    lb = None if lora_b is None else lora_b.contiguous()
    la, xw, flags, a_units, sa = None, None, None, 0, 1
    if lora_a is not None and xa is None and r > MAX_FUSED_RANK:
        xa = lora_a_product(x2, lora_a)
    elif lora_a is not None and xa is None:
        la = lora_a.contiguous()
        if la.data_ptr() % 16:  # 16-byte loads of its rows
            la = la.clone()
        sa = a_splits(k, cluster, warps)
        xw, flags = _workspace(x2.device, sa * m * la.shape[0])
        a_units = -(-la.shape[0] // 16) * sa

    def ptr(t):
        return ctypes.c_void_p(0 if t is None else t.data_ptr())

    args = [ptr(wp), ptr(ws), ptr(gs), ptr(x2), ctypes.c_int(x2.stride(0)), ptr(out), ctypes.c_int(out.stride(0)),
            ptr(b), ptr(xa), ctypes.c_int(0 if xa is None else xa.stride(0)), ptr(lb),
            ctypes.c_int(0 if lb is None else lb.stride(0)), ctypes.c_float(lora_scale), ctypes.c_int(m),
            ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(n1), ctypes.c_int(n2), ctypes.c_int(r), ptr(la),
            ctypes.c_int(0 if la is None else la.stride(0)), ctypes.c_int(sa), ptr(xw), ptr(flags)]
    grid, name = ((n // 16 + a_units) * cluster, 1), kernel_name(nt, cluster)
    if dev == torch.cuda.current_device():
        _module(dev).launch(name, grid, 32 * warps, args, pdl=use_pdl(dev))
    else:  # the context, stream and workspace of x's device
        with torch.cuda.device(dev):
            _module(dev).launch(name, grid, 32 * warps, args, pdl=use_pdl(dev))
    return out


assert ptx.DEQ_GAIN == 128.0  # the kernel's finish multiplies by 128 / global_scale
