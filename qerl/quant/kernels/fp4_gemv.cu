// Hand-written few-row NVFP4 matmul (qerl.quant.kernels.cuda_fp4 builds it with NVRTC or nvcc and launches it).
// Not compilable on its own: cuda_fp4.source() replaces two marker lines before the build, so that each piece
// keeps one source: `// QERL_DECODE8` becomes decode8(), generated from the PTX text that the Triton kernels also
// inline (kernels/_e2m1.py), and `// QERL_LIMITS` the #defines of MAX_WARPS and MAX_FUSED_RANK from cuda_fp4's
// Python constants (the launcher sizes grids and shared memory by the same numbers).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#else
#include <stdint.h>
#endif

// QERL_DECODE8

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

// Weight and scale loads ask L2 to fetch the whole 128-byte line from DRAM: a lane group reads 64 B of a row per
// chunk and the next chunk's 64 B soon after (-2 us per 7B layer at 1-4 rows on an H200; 256 B: the same).
__device__ __forceinline__ uint4 ldg_w(const void *p) {
  uint4 v;
  asm("ld.global.nc.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned short ldg_s(const void *p) {
  unsigned short v;
  asm("ld.global.nc.L2::128B.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
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
template <int NT>
__device__ __forceinline__ void load_w(Chunk<NT> &ch, const uint8_t *wg, const uint8_t *wg8, const uint8_t *sg,
                                       const uint8_t *sg8, int c, int t) {
  const int kb = c * 64 + 16 * t;
  ch.wa = ldg_w(wg + kb);
  ch.wb = ldg_w(wg8 + kb);
  const int gi = c * 8 + 2 * t;
  ch.sa = ldg_s(sg + gi);
  ch.sb = ldg_s(sg8 + gi);
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

template <int NT>
__device__ __forceinline__ void load_chunk(Chunk<NT> &ch, const uint8_t *wg, const uint8_t *wg8, const uint8_t *sg,
                                           const uint8_t *sg8, const __nv_bfloat16 *const *xg, const bool *xok,
                                           int c, int t) {
  load_w<NT>(ch, wg, wg8, sg, sg8, c, t);
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
template <int NT>
__device__ __forceinline__ void accumulate(float (*acc)[4], const uint8_t *wp, const uint8_t *ws,
                                           const __nv_bfloat16 *x, int sxm, int M, int N, int K, int rb, int c0,
                                           int c1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, r0 = rb * 16;
  const int kh = K / 2, kg = K / 16;
  const int rg = min(r0 + g, N - 1), rg8 = min(r0 + g + 8, N - 1);
  const uint8_t *wg = wp + (size_t)rg * kh, *wg8 = wp + (size_t)rg8 * kh;
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
  if (c0 < c1) load_w<NT>(ca, wg, wg8, sg, sg8, c0, t);
  grid_dep_wait();
  grid_dep_launch();
  if (c0 < c1) load_x<NT>(ca, xg, xok, c0, t);
  for (int c = c0; c < c1; c += 2) {
    if (c + 1 < c1) load_chunk<NT>(cb, wg, wg8, sg, sg8, xg, xok, c + 1, t);
    compute_chunk<NT>(ca, acc);
    if (c + 1 < c1) {
      if (c + 2 < c1) load_chunk<NT>(ca, wg, wg8, sg, sg8, xg, xok, c + 2, t);
      compute_chunk<NT>(cb, acc);
    }
  }
}
// QERL_LIMITS


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
    accumulate<NT>(acc, wp, ws, x, sxm, M, N, K, rb, C * p / P, C * (p + 1) / P);
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
