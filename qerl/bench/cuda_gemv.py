"""Prototype: a hand-written CUDA W4A16 NVFP4 GEMV for M <= 8 against qerl's Triton kernel (benchmark only).

    python -m qerl.bench.cuda_gemv --out results/bench/cuda_gemv.json     # a CUDA GPU; nvcc or NVRTC

Why (BENCHMARKS.md, session 6): `qerl.bench.anatomy` shows the Triton few-row kernel is bound by its on-chip work
per weight (5.5 SASS instructions per weight and thread), not by the weight bytes. These kernels are the design
sketched there, written by hand: `mma.sync` m16n8k16 with W as the A operand, decoded in registers straight from
16-byte global loads (qerl.quant.ptx's bit trick, no shared memory), the K order permuted so one thread's 32
contiguous weights of a row feed 8 MMAs, and x read from global memory (L1) in the same permuted order as the B
operand; K splits add fp32 partials with atomics into a zeroed (M, N) buffer. 3.5 SASS instructions per weight
and thread. Variants (`KERNELS`):
  base   the compressed-tensors layout; the next chunk of 128 weights per row is loaded while one is computed;
  deep   W streamed past L1 with two chunks in flight (no faster than base on an H100);
  tiled  W re-laid out by `tile_packed` as [N/16][K/128][16 rows][64 B], so each warp's chunk is one contiguous
         1 KiB block: the fastest (H100, 7B gate/up at M = 1: 19.0 -> 17.1 us, 74% of the copy bandwidth).
The same tiled layout does not speed up the Triton kernel (tried in session 6: 24.8 -> 24.5 us).

Not wired into qerl: it lacks bias, the LoRA epilogue, stacked segments, M > 8, ragged N / K and an in-kernel
finish (the `full` column adds the zeroing and the scale + bf16 conversion as torch ops). It is compiled into a
cubin by nvcc or, without it, NVRTC (libnvrtc and the CUDA headers come with CUDA builds of torch) and launched through the CUDA driver API (ctypes) on torch's current stream, so CUDA graphs capture it.
Every timed configuration is first checked against the float64 reference.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = r"""#include <cuda_bf16.h>
#include <cuda_fp8.h>
#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#else
#include <stdint.h>
#endif

__device__ __forceinline__ void decode8(uint32_t w, uint32_t s2, uint32_t &o0, uint32_t &o1, uint32_t &o2,
                                        uint32_t &o3) {
  // qerl.quant.ptx's decode with mul.bf16x2 (sm_90) instead of fma with -0
  asm("{\n"
      ".reg .b32 r, x0, x1, x2, x3;\n"
      "shf.l.wrap.b32 r, %4, %4, 4;\n"
      "prmt.b32 x0, r, %4, 0xC184;\n"
      "prmt.b32 x1, r, %4, 0xD295;\n"
      "prmt.b32 x2, r, %4, 0xE3A6;\n"
      "prmt.b32 x3, r, %4, 0xF0B7;\n"
      "shl.b32 x0, x0, 6;\n"
      "shl.b32 x1, x1, 6;\n"
      "shl.b32 x2, x2, 6;\n"
      "shl.b32 x3, x3, 6;\n"
      "and.b32 x0, x0, 0x81C081C0;\n"
      "and.b32 x1, x1, 0x81C081C0;\n"
      "and.b32 x2, x2, 0x81C081C0;\n"
      "and.b32 x3, x3, 0x81C081C0;\n"
      "mul.rn.bf16x2 %0, x0, %5;\n"
      "mul.rn.bf16x2 %1, x1, %5;\n"
      "mul.rn.bf16x2 %2, x2, %5;\n"
      "mul.rn.bf16x2 %3, x3, %5;\n"
      "}\n"
      : "=r"(o0), "=r"(o1), "=r"(o2), "=r"(o3)
      : "r"(w), "r"(s2));
}

// fp8 e4m3 byte -> bf16(scale * 2^119) duplicated in both halves
__device__ __forceinline__ uint32_t scale_pair(uint32_t byte) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)byte, __NV_E4M3);
  float f = __half2float(__half(h)) * 6.646139978924579e+35f;
  __nv_bfloat16 b = __float2bfloat16_rn(f);
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

struct Chunk {
  uint4 wa, wb;      // 16 B of row g and of row g + 8
  uint16_t sa, sb;   // the two group scales of each
  uint4 x[4];        // 32 bf16 of x row g (zeros past M)
};

// TILED: W re-laid out as [N / 16][K / 128][16 rows][64 B], so a warp's chunk is one contiguous 1 KiB block
template <bool TILED>
__device__ __forceinline__ void load_chunk(Chunk &ch, const uint8_t *wg, const uint8_t *wg8, const uint8_t *sg,
                                           const uint8_t *sg8, const __nv_bfloat16 *xg, bool xok, int c, int t) {
  const int kb = TILED ? c * 1024 + 16 * t : c * 64 + 16 * t;  // thread's 16 B of chunk c (128 weights per row)
  ch.wa = __ldg(reinterpret_cast<const uint4 *>(wg + kb));
  ch.wb = __ldg(reinterpret_cast<const uint4 *>(wg8 + kb));
  const int gi = c * 8 + 2 * t;    // group index of the thread's first 16 weights
  ch.sa = __ldg(reinterpret_cast<const unsigned short *>(sg + gi));
  ch.sb = __ldg(reinterpret_cast<const unsigned short *>(sg8 + gi));
  if (xok) {
    const uint4 *xp = reinterpret_cast<const uint4 *>(xg + c * 128 + 32 * t);
#pragma unroll
    for (int i = 0; i < 4; i++) ch.x[i] = __ldg(xp + i);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) ch.x[i] = make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void compute_chunk(const Chunk &ch, float *acc) {
  uint32_t A[4][4], B[4][4];  // [word][pair] for rows g and g + 8
  const uint32_t wa[4] = {ch.wa.x, ch.wa.y, ch.wa.z, ch.wa.w};
  const uint32_t wb[4] = {ch.wb.x, ch.wb.y, ch.wb.z, ch.wb.w};
  const uint32_t sa0 = scale_pair(ch.sa & 0xFF), sa1 = scale_pair(ch.sa >> 8);
  const uint32_t sb0 = scale_pair(ch.sb & 0xFF), sb1 = scale_pair(ch.sb >> 8);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    decode8(wa[i], i < 2 ? sa0 : sa1, A[i][0], A[i][1], A[i][2], A[i][3]);
    decode8(wb[i], i < 2 ? sb0 : sb1, B[i][0], B[i][1], B[i][2], B[i][3]);
  }
  const uint32_t *xr = reinterpret_cast<const uint32_t *>(ch.x);  // 16 words = 32 bf16, physical k order
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const int i = j / 2, p = (j % 2) * 2;
    mma16816(acc, A[i][p], B[i][p], A[i][p + 1], B[i][p + 1], xr[2 * j], xr[2 * j + 1]);
  }
}

template <bool TILED>
__device__ __forceinline__ void gemv_m8(const uint8_t *__restrict__ wp, const uint8_t *__restrict__ ws,
                                        const __nv_bfloat16 *__restrict__ x, float *__restrict__ out, int M, int N,
                                        int K, int chunks_per_split) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rb = blockIdx.x * (blockDim.x >> 5) + warp;
  const int r0 = rb * 16;
  if (r0 >= N) return;
  const int kh = K / 2, kg = K / 16;
  const uint8_t *wg = TILED ? wp + (size_t)rb * 16 * kh + g * 64 : wp + (size_t)(r0 + g) * kh;
  const uint8_t *wg8 = TILED ? wg + 8 * 64 : wp + (size_t)(r0 + g + 8) * kh;
  const uint8_t *sg = ws + (size_t)(r0 + g) * kg, *sg8 = ws + (size_t)(r0 + g + 8) * kg;
  const bool xok = g < M;
  const __nv_bfloat16 *xg = x + (size_t)(xok ? g : 0) * K;
  const int c0 = blockIdx.y * chunks_per_split;
  const int c1 = min(c0 + chunks_per_split, K / 128);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  Chunk ca, cb;  // two register buffers: the next chunk's loads are in flight while one is computed
  if (c0 < c1) load_chunk<TILED>(ca, wg, wg8, sg, sg8, xg, xok, c0, t);
  for (int c = c0; c < c1; c += 2) {
    if (c + 1 < c1) load_chunk<TILED>(cb, wg, wg8, sg, sg8, xg, xok, c + 1, t);
    compute_chunk(ca, acc);
    if (c + 1 < c1) {
      if (c + 2 < c1) load_chunk<TILED>(ca, wg, wg8, sg, sg8, xg, xok, c + 2, t);
      compute_chunk(cb, acc);
    }
  }
  // C fragment: c0, c1 = (row g, n 2t, 2t + 1); c2, c3 = (row g + 8, same n)
  const int n0 = 2 * t, n1 = 2 * t + 1;
  if (n0 < M) {
    atomicAdd(out + (size_t)n0 * N + r0 + g, acc[0]);
    atomicAdd(out + (size_t)n0 * N + r0 + g + 8, acc[2]);
  }
  if (n1 < M) {
    atomicAdd(out + (size_t)n1 * N + r0 + g, acc[1]);
    atomicAdd(out + (size_t)n1 * N + r0 + g + 8, acc[3]);
  }
}

extern "C" __global__ void __launch_bounds__(256) fp4_gemv_m8(const uint8_t *__restrict__ wp,
                                                               const uint8_t *__restrict__ ws,
                                                               const __nv_bfloat16 *__restrict__ x,
                                                               float *__restrict__ out, int M, int N, int K,
                                                               int chunks_per_split) {
  gemv_m8<false>(wp, ws, x, out, M, N, K, chunks_per_split);
}

extern "C" __global__ void __launch_bounds__(256) fp4_gemv_m8_tiled(const uint8_t *__restrict__ wp,
                                                                     const uint8_t *__restrict__ ws,
                                                                     const __nv_bfloat16 *__restrict__ x,
                                                                     float *__restrict__ out, int M, int N, int K,
                                                                     int chunks_per_split) {
  gemv_m8<true>(wp, ws, x, out, M, N, K, chunks_per_split);
}

// Variant "deep": W streamed past L1 (ld.global.nc.L1::no_allocate) with two chunks in flight while a third is
// computed; x read from L1 just before its chunk's MMAs.
struct WChunk {
  uint4 wa, wb;
  uint16_t sa, sb;
};

__device__ __forceinline__ uint4 ld_stream(const void *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void load_w(WChunk &ch, const uint8_t *wg, const uint8_t *wg8, const uint8_t *sg,
                                       const uint8_t *sg8, int c, int t) {
  const int kb = c * 64 + 16 * t;
  ch.wa = ld_stream(wg + kb);
  ch.wb = ld_stream(wg8 + kb);
  const int gi = c * 8 + 2 * t;
  ch.sa = __ldg(reinterpret_cast<const unsigned short *>(sg + gi));
  ch.sb = __ldg(reinterpret_cast<const unsigned short *>(sg8 + gi));
}

__device__ __forceinline__ void compute_w(const WChunk &w, const __nv_bfloat16 *xg, bool xok, int c, int t,
                                          float *acc) {
  Chunk ch;
  ch.wa = w.wa;
  ch.wb = w.wb;
  ch.sa = w.sa;
  ch.sb = w.sb;
  if (xok) {
    const uint4 *xp = reinterpret_cast<const uint4 *>(xg + c * 128 + 32 * t);
#pragma unroll
    for (int i = 0; i < 4; i++) ch.x[i] = __ldg(xp + i);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) ch.x[i] = make_uint4(0, 0, 0, 0);
  }
  compute_chunk(ch, acc);
}

extern "C" __global__ void __launch_bounds__(256) fp4_gemv_m8_deep(const uint8_t *__restrict__ wp,
                                                                    const uint8_t *__restrict__ ws,
                                                                    const __nv_bfloat16 *__restrict__ x,
                                                                    float *__restrict__ out, int M, int N, int K,
                                                                    int chunks_per_split) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rb = blockIdx.x * (blockDim.x >> 5) + warp;
  const int r0 = rb * 16;
  if (r0 >= N) return;
  const int kh = K / 2, kg = K / 16;
  const uint8_t *wg = wp + (size_t)(r0 + g) * kh, *wg8 = wp + (size_t)(r0 + g + 8) * kh;
  const uint8_t *sg = ws + (size_t)(r0 + g) * kg, *sg8 = ws + (size_t)(r0 + g + 8) * kg;
  const bool xok = g < M;
  const __nv_bfloat16 *xg = x + (size_t)(xok ? g : 0) * K;
  const int c0 = blockIdx.y * chunks_per_split;
  const int c1 = min(c0 + chunks_per_split, K / 128);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  WChunk w0, w1, w2;
  if (c0 < c1) load_w(w0, wg, wg8, sg, sg8, c0, t);
  if (c0 + 1 < c1) load_w(w1, wg, wg8, sg, sg8, c0 + 1, t);
  for (int c = c0; c < c1; c += 3) {
    if (c + 2 < c1) load_w(w2, wg, wg8, sg, sg8, c + 2, t);
    compute_w(w0, xg, xok, c, t, acc);
    if (c + 1 >= c1) break;
    if (c + 3 < c1) load_w(w0, wg, wg8, sg, sg8, c + 3, t);
    compute_w(w1, xg, xok, c + 1, t, acc);
    if (c + 2 >= c1) break;
    if (c + 4 < c1) load_w(w1, wg, wg8, sg, sg8, c + 4, t);
    compute_w(w2, xg, xok, c + 2, t, acc);
  }
  const int n0 = 2 * t, n1 = 2 * t + 1;
  if (n0 < M) {
    atomicAdd(out + (size_t)n0 * N + r0 + g, acc[0]);
    atomicAdd(out + (size_t)n0 * N + r0 + g + 8, acc[2]);
  }
  if (n1 < M) {
    atomicAdd(out + (size_t)n1 * N + r0 + g, acc[1]);
    atomicAdd(out + (size_t)n1 * N + r0 + g + 8, acc[3]);
  }
}
"""

CHUNK = 128  # weights per row and chunk


def tile_packed(weight_packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) packed bytes -> the "tiled" kernel's layout [N/16][K/128][16 rows][64 B] (same bytes)."""
    n, kh = weight_packed.shape
    return weight_packed.view(n // 16, 16, kh // 64, 64).permute(0, 2, 1, 3).contiguous().view(n, kh)
KERNELS = {"base": b"fp4_gemv_m8", "deep": b"fp4_gemv_m8_deep", "tiled": b"fp4_gemv_m8_tiled"}


def _find_nvcc(nvcc: str | None) -> str | None:
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return nvcc if Path(nvcc).exists() or shutil.which(nvcc) else None


def _find_nvrtc() -> tuple[Path, Path] | None:
    """libnvrtc and the include dir with cuda_bf16.h: the CUDA torch wheel's nvidia package, else CUDA_HOME."""
    roots = [Path(torch.__file__).parent.parent / "nvidia"]
    roots += [Path(p) for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p]
    for root in roots:
        libs = sorted(root.glob("**/libnvrtc.so*")) if root.exists() else []
        libs = [lib for lib in libs if "builtins" not in lib.name and ".alt." not in lib.name]
        heads = sorted(root.glob("**/cuda_bf16.h")) if root.exists() else []
        if libs and heads:
            return libs[0], heads[0].parent
    return None


def _compile_nvrtc(arch: str) -> bytes:
    found = _find_nvrtc()
    if found is None:
        raise RuntimeError("NVRTC not found (no libnvrtc.so + cuda_bf16.h in torch's nvidia package or CUDA_HOME)")
    lib_path, include = found
    lib = ctypes.CDLL(str(lib_path))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"fp4_gemv.cu", 0, None, None):
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


def compile_cubin(arch: str, nvcc: str | None = None, compiler: str = "auto") -> bytes:
    """A cubin for `arch` (e.g. sm_90) from nvcc or, without it, NVRTC (which CUDA builds of torch ship); one clear
    error when neither is there or the source does not build."""
    nvcc_path = _find_nvcc(nvcc) if compiler in ("auto", "nvcc") else None
    if nvcc_path is None:
        if compiler == "nvcc":
            raise RuntimeError(f"nvcc not found (looked on PATH and at {nvcc or '/usr/local/cuda/bin/nvcc'}): "
                               "the CUDA prototype needs the CUDA toolkit or NVRTC")
        return _compile_nvrtc(arch)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "fp4_gemv.cu"), Path(tmp, "fp4_gemv.cubin")
        src.write_text(SOURCE)
        proc = subprocess.run([nvcc_path, "-cubin", f"-arch={arch}", "-O3", "-o", str(out), str(src)],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(f"nvcc failed: {proc.stderr.strip().splitlines()[:3]}")
        return out.read_bytes()


class CudaGemv:
    """The cubin loaded into torch's CUDA context; `__call__` launches on the current stream."""

    def __init__(self, cubin: bytes):
        torch.zeros(1, device="cuda")  # make torch's primary context current
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._cubin = cubin  # kept alive: the driver reads it during load
        self._mod = ctypes.c_void_p()
        self._check(self._cuda.cuModuleLoadData(ctypes.byref(self._mod), cubin), "cuModuleLoadData")
        self._fns = {}
        for variant, name in KERNELS.items():
            fn = ctypes.c_void_p()
            self._check(self._cuda.cuModuleGetFunction(ctypes.byref(fn), self._mod, name), "cuModuleGetFunction")
            self._fns[variant] = fn

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"{what} returned CUDA error {code}")

    def __call__(self, weight_packed: torch.Tensor, weight_scale_u8: torch.Tensor, x: torch.Tensor,
                 out: torch.Tensor, splits: int, warps: int = 4, variant: str = "base") -> None:
        m, k = x.shape
        n = weight_packed.shape[0]
        if m > 8 or n % 16 or k % CHUNK or x.dtype != torch.bfloat16 or out.dtype != torch.float32:
            raise ValueError(f"prototype limits: M <= 8, N % 16 == 0, K % {CHUNK} == 0, bf16 x, fp32 out; "
                             f"got M={m} N={n} K={k} {x.dtype} {out.dtype}")
        chunks = k // CHUNK
        per_split = -(-chunks // splits)
        grid = (-(-n // (16 * warps)), -(-chunks // per_split))
        args = [ctypes.c_void_p(weight_packed.data_ptr()), ctypes.c_void_p(weight_scale_u8.data_ptr()),
                ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(m), ctypes.c_int(n),
                ctypes.c_int(k), ctypes.c_int(per_split)]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        self._check(self._cuda.cuLaunchKernel(self._fns[variant], grid[0], grid[1], 1, 32 * warps, 1, 1, 0,
                                              ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), params,
                                              None), "cuLaunchKernel")


SHAPES = [("q/o", 3584, 3584), ("q|k|v", 4608, 3584), ("gate/up", 18944, 3584), ("gate|up", 37888, 3584),
          ("down", 3584, 18944)]


def run(rows_m: list[int], splits_list: list[int], warps_list: list[int], variants=tuple(KERNELS),
        compiler: str = "auto") -> dict:
    from qerl.bench.kernels import _copies, _environment, _fp4_weights, fp4_reference, graph_time_us
    from qerl.bench.kernels import measure_ceilings
    from qerl.quant import triton_fp4 as tf

    major, minor = torch.cuda.get_device_capability()
    kern = CudaGemv(compile_cubin(f"sm_{major}{minor}", compiler=compiler))
    result = {**_environment(), "ceilings": measure_ceilings(), "compiler": compiler, "rows": []}
    gain = tf.DEQ_GAIN.value
    for layer, n, k in SHAPES:
        copies = _copies(n * k // 2 + n * k // 16)
        fp4 = _fp4_weights(n, k, copies, 0)
        ws8 = [f[1].view(torch.uint8) for f in fp4]
        tiled = [tile_packed(f[0]) for f in fp4] if "tiled" in variants else None
        for m in rows_m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = fp4_reference(x, *fp4[0])
            row = {"layer": layer, "N": n, "K": k, "M": m,
                   "triton_us": graph_time_us(lambda i: tf.fp4_matmul_triton(x, *fp4[i]), copies), "configs": []}
            out = torch.zeros(m, n, device="cuda", dtype=torch.float32)
            scale = gain / fp4[0][2]
            for v, splits, warps in itertools.product(variants, splits_list, warps_list):
                wps = tiled if v == "tiled" else [f[0] for f in fp4]
                out.zero_()
                kern(wps[0], ws8[0], x, out, splits, warps, v)
                err = ((out.double() * (gain / fp4[0][2].double()) - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    raise RuntimeError(f"{layer} M={m} {v} splits={splits} warps={warps}: rel. error {err:.2e}")
                us = graph_time_us(lambda i: kern(wps[i], ws8[i], x, out, splits, warps, v), copies)

                def full(i):
                    out.zero_()
                    kern(wps[i], ws8[i], x, out, splits, warps, v)
                    return (out * scale).to(torch.bfloat16)

                row["configs"].append({"variant": v, "splits": splits, "warps": warps, "us": us, "err": err,
                                       "full_us": graph_time_us(full, copies)})
            for v in variants:
                bv = min((c for c in row["configs"] if c["variant"] == v), key=lambda c: c["us"])
                row[f"best_{v}_us"] = bv["us"]
            best = min(row["configs"], key=lambda c: c["us"])
            row.update(best_us=best["us"], best_full_us=best["full_us"], best_splits=best["splits"],
                       best_warps=best["warps"], best_variant=best["variant"],
                       floor_us=n * k * 0.5625 / result["ceilings"]["copy_GBps"] / 1e3)
            result["rows"].append(row)
            print(f"{layer} M={m}: triton {row['triton_us']:.1f} us, CUDA {best['us']:.1f} us ({best['variant']}, "
                  f"splits {best['splits']}, warps {best['warps']}; "
                  + ", ".join(f"{v} {row[f'best_{v}_us']:.1f}" for v in variants)
                  + f"), floor {row['floor_us']:.1f}", flush=True)
    return result


def markdown(result: dict) -> str:
    lines = ["| layer | N x K | M | floor us | Triton us | CUDA kernel us | CUDA + zero/finish us | kernel vs Triton |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        layer = r["layer"].replace("|", "\\|")  # stacked q|k|v, gate|up inside a Markdown table
        lines.append(f"| {layer} | {r['N']} x {r['K']} | {r['M']} | {r['floor_us']:.1f} | "
                     f"{r['triton_us']:.1f} | {r['best_us']:.1f} | {r['best_full_us']:.1f} | "
                     f"{r['triton_us'] / r['best_us']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/bench/cuda_gemv.json"))
    p.add_argument("--rows", default="1,8")
    p.add_argument("--splits", default="1,2,4,7,14")
    p.add_argument("--warps", default="4")
    p.add_argument("--compiler", choices=["auto", "nvcc", "nvrtc"], default="auto")
    p.add_argument("--variants", default="base,deep,tiled", help="kernels: " + ", ".join(KERNELS))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl.bench.cuda_gemv needs a CUDA GPU")
    from qerl.bench.kernels import write_json

    result = run([int(v) for v in a.rows.split(",")], [int(v) for v in a.splits.split(",")],
                 [int(v) for v in a.warps.split(",")], [v for v in a.variants.split(",") if v],
                 a.compiler)
    result["markdown"] = markdown(result)
    print(result["markdown"])
    write_json(a.out, result)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
