"""Prototype: a hand-written CUDA W4A16 NVFP4 GEMV for M <= 8 against qerl's Triton kernel (benchmark only).

    python -m qerl.bench.cuda_gemv --out results/bench/cuda_gemv.json     # a CUDA GPU; nvcc or NVRTC
    python -m qerl.bench.cuda_gemv --wired --rows 1,8 --warps 4,8,12 --out results/bench/cuda_fp4_wired.json

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

These kernels lack bias, the LoRA epilogue, stacked segments, M > 8, ragged N / K and an in-kernel finish (the
`full` column adds the zeroing and the scale + bf16 conversion as torch ops); qerl.quant.cuda_fp4 (the default
for <= 8 rows on Hopper) is the complete kernel, and `--wired` times it (chosen and swept (cluster, warps)
configurations, and the whole call with bias and LoRA) against Triton and bf16. Built by
qerl.quant.cuda_fp4.compile_cubin (nvcc, else NVRTC from torch's CUDA wheel), launched through the CUDA driver API
on torch's current stream, so CUDA graphs capture it.
Every timed configuration is first checked against the float64 reference.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
from pathlib import Path

import torch

from qerl.quant import cuda_fp4
from qerl.quant.tiling import no_empty_splits

SOURCE = cuda_fp4.DEVICE_COMMON + r"""
// fp32 partials of the warp's tile added into out (M, N) with atomics
__device__ __forceinline__ void add_partials(float *out, const float *acc, int M, int N, int r0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rows[4] = {r0 + g, r0 + g, r0 + g + 8, r0 + g + 8}, ms[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
#pragma unroll
  for (int i = 0; i < 4; i++)
    if (ms[i] < M) atomicAdd(out + (size_t)ms[i] * N + rows[i], acc[i]);
}

template <bool TILED>
__device__ __forceinline__ void gemv_m8(const uint8_t *__restrict__ wp, const uint8_t *__restrict__ ws,
                                        const __nv_bfloat16 *__restrict__ x, float *__restrict__ out, int M, int N,
                                        int K, int chunks_per_split) {
  const int rb = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (rb * 16 >= N) return;
  const int c0 = blockIdx.y * chunks_per_split, c1 = min(c0 + chunks_per_split, K / 128);
  float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
  accumulate<TILED, 1>(acc, wp, ws, x, K, M, N, K, rb, c0, c1);
  add_partials(out, acc[0], M, N, rb * 16);
}

#define GEMV_KERNEL(NAME, TILED)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256)                                                            \
      NAME(const uint8_t *__restrict__ wp, const uint8_t *__restrict__ ws, const __nv_bfloat16 *__restrict__ x,  \
           float *__restrict__ out, int M, int N, int K, int chunks_per_split) {                                 \
    gemv_m8<TILED>(wp, ws, x, out, M, N, K, chunks_per_split);                                                 \
  }

GEMV_KERNEL(fp4_gemv_m8, false)
GEMV_KERNEL(fp4_gemv_m8_tiled, true)

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
                                          float (*acc)[4]) {
  Chunk<1> ch;
  ch.wa = w.wa;
  ch.wb = w.wb;
  ch.sa = w.sa;
  ch.sb = w.sb;
  if (xok) {
    const uint4 *xp = reinterpret_cast<const uint4 *>(xg + c * 128 + 32 * t);
#pragma unroll
    for (int i = 0; i < 4; i++) ch.x[0][i] = __ldg(xp + i);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) ch.x[0][i] = make_uint4(0, 0, 0, 0);
  }
  compute_chunk<1>(ch, acc);
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
  float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
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
  add_partials(out, acc[0], M, N, r0);
}
"""

CHUNK = 128  # weights per row and chunk


def tile_packed(weight_packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) packed bytes -> the "tiled" kernel's layout [N/16][K/128][16 rows][64 B] (same bytes)."""
    n, kh = weight_packed.shape
    return weight_packed.view(n // 16, 16, kh // 64, 64).permute(0, 2, 1, 3).contiguous().view(n, kh)
KERNELS = {"base": b"fp4_gemv_m8", "deep": b"fp4_gemv_m8_deep", "tiled": b"fp4_gemv_m8_tiled"}


def compile_cubin(arch: str, nvcc: str | None = None, compiler: str = "auto") -> bytes:
    """The prototype kernels as a cubin (qerl.quant.cuda_fp4.compile_cubin: nvcc, else NVRTC)."""
    return cuda_fp4.compile_cubin(SOURCE, arch, compiler, nvcc)


class CudaGemv:
    """The prototype cubin in torch's CUDA context; `__call__` launches one variant on the current stream."""

    def __init__(self, cubin: bytes):
        self._module = cuda_fp4.CudaModule(cubin, [name.decode() for name in KERNELS.values()])

    def __call__(self, weight_packed: torch.Tensor, weight_scale_u8: torch.Tensor, x: torch.Tensor,
                 out: torch.Tensor, splits: int, warps: int = 4, variant: str = "base") -> None:
        m, k = x.shape
        n = weight_packed.shape[0]
        if m > 8 or n % 16 or k % CHUNK or x.dtype != torch.bfloat16 or out.dtype != torch.float32:
            raise ValueError(f"prototype limits: M <= 8, N % 16 == 0, K % {CHUNK} == 0, bf16 x, fp32 out; "
                             f"got M={m} N={n} K={k} {x.dtype} {out.dtype}")
        chunks = k // CHUNK
        splits = no_empty_splits(splits, chunks)
        per_split = -(-chunks // splits)
        grid = (-(-n // (16 * warps)), splits)
        args = [ctypes.c_void_p(weight_packed.data_ptr()), ctypes.c_void_p(weight_scale_u8.data_ptr()),
                ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(m), ctypes.c_int(n),
                ctypes.c_int(k), ctypes.c_int(per_split)]
        self._module.launch(KERNELS[variant].decode(), grid, 32 * warps, args)


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


LAYER_SHAPES = {  # (layer, N, K, stacked segments along N)
    "7B": [("q|k|v", 4608, 3584, (3584, 512, 512)), ("o", 3584, 3584, (3584,)),
           ("gate|up", 37888, 3584, (18944, 18944)), ("down", 3584, 18944, (3584,))],
    "32B": [("q|k|v", 7168, 5120, (5120, 1024, 1024)), ("o", 5120, 5120, (5120,)),
            ("gate|up", 55296, 5120, (27648, 27648)), ("down", 5120, 27648, (5120,))]}


def run_wired(models: list[str], rows_m: list[int], warps_list: list[int], lora_rank: int = 16) -> dict:
    """qerl.quant.cuda_fp4 (the wired-in kernel) per decoder-layer shape: its chosen (cluster, warps), every other
    candidate with warps in `warps_list`, the Triton kernel and bf16 torch.matmul, all in one process; and the
    whole fp4_matmul_triton call with bias and a rank-`lora_rank` LoRA (x @ A.T included) on either kernel."""
    from qerl.bench.kernels import _copies, _environment, _fp4_weights, env_var, fp4_reference, graph_time_us
    from qerl.bench.kernels import measure_ceilings
    from qerl.quant import triton_fp4 as tf

    dev = torch.cuda.current_device()
    clusters = torch.cuda.get_device_capability(dev)[0] >= 9
    result = {**_environment(), "ceilings": measure_ceilings(), "lora_rank": lora_rank, "rows": []}
    for model in models:
        for layer, n, k, segments in LAYER_SHAPES[model]:
            fp4 = _fp4_weights(n, k, _copies(n * k // 2 + n * k // 16), 0)
            gs = fp4[0][2].reshape(1).repeat(len(segments))
            lora_a = torch.randn(len(segments) * lora_rank, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            lora_b = torch.randn(n, lora_rank, device="cuda", dtype=torch.bfloat16)
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            nb = _copies(2 * n * k)
            wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(nb)]
            for m in rows_m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = fp4_reference(x, *fp4[0])
                chosen = cuda_fp4._config(dev, cuda_fp4._n_tiles(m), n, k)
                row = {"model": model, "layer": layer, "N": n, "K": k, "M": m, "chosen": list(chosen),
                       "bf16_us": graph_time_us(lambda i: torch.matmul(x, wb[i].T), nb),
                       "triton_us": graph_time_us(lambda i: tf.fp4_matmul_triton(x, *fp4[i], path="fused"),
                                                  len(fp4)), "configs": []}
                for cfg in cuda_fp4.candidate_configs(k, clusters):
                    if cfg != chosen and cfg[1] not in warps_list:
                        continue

                    def call(i, cfg=cfg):
                        return cuda_fp4.fp4_matmul_cuda(x, *fp4[i], None, None, None, 1.0, n, n, config=cfg)

                    err = ((call(0).double() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        raise RuntimeError(f"{layer} M={m} config {cfg}: rel. error {err:.2e}")
                    row["configs"].append({"cluster": cfg[0], "warps": cfg[1], "us": graph_time_us(call, len(fp4)),
                                           "err": err})
                for mode, path in (("triton", "fused"), ("cuda", "auto")):  # LoRA + bias, the whole call
                    with env_var("QERL_FP4_CUDA", "1"):
                        row[f"lora_{mode}_us"] = graph_time_us(
                            lambda i, path=path: tf.fp4_matmul_triton(
                                x, fp4[i][0], fp4[i][1], gs, bias, lora_a, lora_b, 0.5,
                                segments=list(segments), path=path), len(fp4))
                best = min(row["configs"], key=lambda c: c["us"])
                row["chosen_us"] = next(c["us"] for c in row["configs"]
                                        if (c["cluster"], c["warps"]) == tuple(chosen))
                row.update(best_us=best["us"], best=[best["cluster"], best["warps"]],
                           floor_us=n * k * 0.5625 / result["ceilings"]["copy_GBps"] / 1e3)
                result["rows"].append(row)
                print(f"{model} {layer} M={m}: bf16 {row['bf16_us']:.1f} triton {row['triton_us']:.1f} CUDA chosen "
                      f"{tuple(chosen)} {row['chosen_us']:.1f}, best {tuple(row['best'])} {best['us']:.1f}, "
                      f"floor {row['floor_us']:.1f} us; with LoRA: triton {row['lora_triton_us']:.1f} CUDA "
                      f"{row['lora_cuda_us']:.1f}", flush=True)
            del wb, fp4
    return result


def wired_markdown(result: dict) -> str:
    lines = ["| model | layer | N x K | M | floor us | bf16 us | Triton us | CUDA us (cluster, warps) | best us "
             "(cluster, warps) | CUDA vs Triton | CUDA vs bf16 | LoRA call: Triton us | LoRA call: CUDA us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    totals: dict = {}
    for r in result["rows"]:
        layer = r["layer"].replace("|", "\\|")
        lines.append(f"| {r['model']} | {layer} | {r['N']} x {r['K']} | {r['M']} | {r['floor_us']:.1f} | "
                     f"{r['bf16_us']:.1f} | {r['triton_us']:.1f} | {r['chosen_us']:.1f} {tuple(r['chosen'])} | "
                     f"{r['best_us']:.1f} {tuple(r['best'])} | {r['triton_us'] / r['chosen_us']:.2f}x | "
                     f"{r['bf16_us'] / r['chosen_us']:.2f}x | {r['lora_triton_us']:.1f} | {r['lora_cuda_us']:.1f} |")
        keys = ("floor_us", "bf16_us", "triton_us", "chosen_us", "best_us", "lora_triton_us", "lora_cuda_us")
        t = totals.setdefault((r["model"], r["M"]), [0.0] * len(keys))
        for i, key in enumerate(keys):
            t[i] += r[key]
    for (model, m), t in totals.items():
        lines.append(f"| {model} | **layer** | | {m} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {t[3]:.1f} | {t[4]:.1f} |"
                     f" {t[2] / t[3]:.2f}x | {t[1] / t[3]:.2f}x | {t[5]:.1f} | {t[6]:.1f} |")
    return "\n".join(lines)


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
    p.add_argument("--wired", action="store_true",
                   help="time qerl.quant.cuda_fp4 (chosen and swept configs) against Triton and bf16 instead")
    p.add_argument("--models", default="7B", help="with --wired: " + ", ".join(LAYER_SHAPES))
    p.add_argument("--lora-rank", type=int, default=16, help="with --wired: rank of the LoRA columns")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl.bench.cuda_gemv needs a CUDA GPU")
    from qerl.bench.kernels import publish

    if a.wired:
        result = run_wired(a.models.split(","), [int(v) for v in a.rows.split(",")],
                           [int(v) for v in a.warps.split(",")], lora_rank=a.lora_rank)
        publish(result, wired_markdown(result), a.out)
        return

    result = run([int(v) for v in a.rows.split(",")], [int(v) for v in a.splits.split(",")],
                 [int(v) for v in a.warps.split(",")], [v for v in a.variants.split(",") if v],
                 a.compiler)
    publish(result, markdown(result), a.out)


if __name__ == "__main__":
    main()
