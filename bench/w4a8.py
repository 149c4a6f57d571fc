"""FP8 activations on humming (W4A8) against its W4A16 GEMM and cuBLAS bf16, per Qwen2.5 projection and rows: time
(CUDA graphs over rotating weight copies, weights not served from L2) and error against float64.

    python -m bench.w4a8 --size 7B --rows 16,32,64,128,256,512 --out results/bench/w4a8.json

Hopper has no FP4 tensor cores: a W4A16 GEMM dequantizes W to bf16 and runs bf16 MMAs, so from ~64 rows its time
is the bf16 FLOPs'. W4A8 (humming's act "fp8", qerl.quant.kernels.humming_fp4) quantizes each row of x to FP8 E4M3
in a kernel and runs FP8 MMAs at twice the rate. Error: ||y - y64|| / ||y64|| on an NVFP4 weight quantized from a
Gaussian and Gaussian x, y64 = x @ deq(W).T in float64; the same for the bf16 paths (their rounding alone).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.common import ints
from bench.humming_tune import _L2_SPAN, copy_bandwidth, graph_us, shapes


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def bench_layer(name: str, n: int, k: int, rows: list[int], bandwidth: float) -> dict:
    from qerl.quant.dispatch import HUMMING_TABLE_ROWS
    from qerl.quant.format import dequantize, quantize_nvfp4
    from qerl.quant.kernels import humming_fp4

    fp4_bytes = n * k // 2 + n * k // 16
    copies = max(1, min(16, int(_L2_SPAN // fp4_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    real = quantize_nvfp4(torch.randn(n, k, device="cuda", generator=gen))
    ops = [real] + [(torch.randint(0, 256, real[0].shape, dtype=torch.uint8, device="cuda", generator=gen),
                     real[1][torch.randperm(n, device="cuda", generator=gen)], real[2]) for _ in range(copies - 1)]
    built = {act: [humming_fp4.HummingWeight(*o, (n,), torch.bfloat16, HUMMING_TABLE_ROWS, act) for o in ops]
             for act in humming_fp4.ACTS}
    w64 = dequantize(*real, torch.float64)
    dense = [w64.to(torch.bfloat16)] + [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                                        for _ in range(max(0, min(3, int(_L2_SPAN // (2 * n * k))) - 1))]
    out = {"shape": [n, k], "copies": copies, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ w64.T
        row = {"floor_us": fp4_bytes / bandwidth * 1e6}
        for act, weights in built.items():
            row[f"{act}_us"] = graph_us(lambda i, w=weights: w[i].run(x, y), copies)
            row[f"{act}_err"] = _rel_err(weights[0].run(x, torch.empty_like(y)), ref)
        row["bf16_us"] = graph_us(lambda i: torch.matmul(x, dense[i].T, out=y), len(dense))
        row["bf16_err"] = _rel_err(x @ dense[0].T, ref)
        out["rows"][m] = row
        print(f"{name:8s} M={m:4d}  a16 {row['a16_us']:7.1f} us  fp8 {row['fp8_us']:7.1f} us  bf16 "
              f"{row['bf16_us']:7.1f} us  floor {row['floor_us']:5.1f} us  fp8/a16 x{row['a16_us'] / row['fp8_us']:.2f}"
              f"  bf16/fp8 x{row['bf16_us'] / row['fp8_us']:.2f}  err a16 {row['a16_err']:.1e} fp8 "
              f"{row['fp8_err']:.1e} bf16 "
              f"{row['bf16_err']:.1e}", flush=True)
    return out


def layer_totals(layers: dict, rows: list[int]) -> list[dict]:
    """Per decoder layer (every projection once) and rows: the summed times of each path."""
    return [{"rows": m, **{f"{p}_us": sum(v["rows"][m][f"{p}_us"] for v in layers.values())
                           for p in ("a16", "fp8", "bf16", "floor")}} for m in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w4a8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="7B")
    p.add_argument("--rows", type=ints, default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--layers", default="qkv,o,gate_up,down")
    p.add_argument("--out", default="results/bench/w4a8.json")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    payload = {"device": device, "bandwidth_bytes_s": bandwidth, "args": vars(args), "layers": {}}
    for name in args.layers.split(","):
        payload["layers"][name] = bench_layer(name, *shapes(args.size)[name], args.rows, bandwidth)
    payload["per_layer"] = layer_totals(payload["layers"], args.rows)
    print("| rows | W4A16 us | W4A8 us | bf16 us | floor us | W4A8 / W4A16 | bf16 / W4A8 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for t in payload["per_layer"]:
        print(f"| {t['rows']} | {t['a16_us']:.1f} | {t['fp8_us']:.1f} | {t['bf16_us']:.1f} | {t['floor_us']:.1f} | "
              f"x{t['a16_us'] / t['fp8_us']:.2f} | x{t['bf16_us'] / t['fp8_us']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".tmp").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(out.with_suffix(".tmp"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
