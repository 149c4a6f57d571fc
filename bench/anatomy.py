"""Where the few-row FP4 forward kernel's time goes: the same launch (grid, tiles, pipeline) with parts taken out.

    python -m bench.anatomy --out results/bench/kernel_anatomy.json [--shapes 18944x3584,3584x18944] [--rows 1,16]

Variants of `qerl.quant.kernels.triton_fp4._fp4_mm_kernel` (default config of each shape), each in its own process
because Triton caches a kernel per process with the helpers it was first compiled with:
  full         the kernel as shipped;
  cheap        the E2M1 decode replaced by a byte -> bf16 conversion (weights still loaded);
  no_w         no weight loads (codes made in registers from the indices), real decode;
  no_w_cheap   neither weight loads nor the decode: x loads, tensor-core dots and the loop remain;
  skeleton     also no x loads: only the dots, layout changes and the loop.
Results are wrong on purpose in all but `full` (timing only). Each time is a CUDA graph over rotated weight copies
(bench.kernels.graph_time_us); the floor is the packed weight bytes over the copy bandwidth measured in the
same run. Prints a Markdown table, writes the JSON atomically.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

VARIANTS = ("full", "cheap", "no_w", "no_w_cheap", "skeleton")


def _patch(variant: str) -> None:
    """Swap triton_fp4's helpers before anything compiles (the kernel resolves them at its first compile)."""
    import triton
    import triton.language as tl

    from qerl.quant.kernels import triton_fp4 as tf

    @triton.jit
    def cheap_dequant(p, s, BR: tl.constexpr, BC: tl.constexpr, USE_ASM: tl.constexpr):
        return tl.reshape(tl.join(p, p), (BR, BC)).to(tl.bfloat16)

    @triton.jit
    def codes_in_registers(wp_ptr, ws_ptr, rows, kt, row_mask, K, swn, ssn, BK: tl.constexpr, EVEN: tl.constexpr):
        offs_b = kt * (BK // 2) + tl.arange(0, BK // 2)
        p = ((rows[:, None] * 7 + offs_b[None, :]) & 0xFF).to(tl.uint8)
        s = (tl.zeros((rows.shape[0], BK // 16), dtype=tl.float32) + 1.0).to(tl.bfloat16)
        return p, s

    @triton.jit
    def rows_in_registers(a_ptr, rows, cols, R, C, sr, sc, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr):
        return ((rows[:, None] + cols[None, :]) & 7).to(tl.bfloat16)

    if variant in ("cheap", "no_w_cheap", "skeleton"):
        tf._dequant_tile = cheap_dequant
    if variant in ("no_w", "no_w_cheap", "skeleton"):
        tf._load_weight_tile = codes_in_registers
    if variant == "skeleton":
        tf._load_rows = rows_in_registers


def _worker(variant: str, shapes: list[tuple[int, int]], rows: list[int]) -> list[dict]:
    from bench.kernels import _copies, _fp4_weights, graph_time_us
    from qerl.quant.dispatch import run_fp4_matmul
    from qerl.quant.kernels import triton_fp4 as tf

    _patch(variant)
    out = []
    for n, k in shapes:
        copies = _copies(n * k // 2 + n * k // 16)
        fp4 = _fp4_weights(n, k, copies, 0)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = graph_time_us(lambda i: run_fp4_matmul(x, *fp4[i], kernel="triton"), copies)
            out.append({"variant": variant, "N": n, "K": k, "M": m, "us": us,
                        "config": list(tf.forward_config(m, n, k, x.device))})
    return out


def markdown(result: dict) -> str:
    gbps = result["ceilings"]["copy_GBps"]
    lines = ["| N x K | M | floor us | " + " | ".join(f"{v} us" for v in VARIANTS) + " |",
             "|---|---|---|" + "---|" * len(VARIANTS)]
    keys = sorted({(r["N"], r["K"], r["M"]) for r in result["rows"]}, key=lambda t: (-t[0], t[2]))
    for n, k, m in keys:
        by = {r["variant"]: r["us"] for r in result["rows"] if (r["N"], r["K"], r["M"]) == (n, k, m)}
        floor = n * k * 0.5625 / gbps / 1e3
        cells = [f"{by[v]:.1f}" if v in by else "-" for v in VARIANTS]
        lines.append(f"| {n} x {k} | {m} | {floor:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/bench/kernel_anatomy.json"))
    p.add_argument("--shapes", default="18944x3584,3584x18944", help="N x K of the weights")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.anatomy needs a CUDA GPU")
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    rows = [int(v) for v in a.rows.split(",") if v]
    if a.worker:
        print(json.dumps(_worker(a.worker, shapes, rows)))
        return
    from bench.kernels import _environment, measure_ceilings, publish

    variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    result = {**_environment(), "ceilings": measure_ceilings(), "rows": []}
    for v in variants:
        proc = subprocess.run([sys.executable, "-m", "bench.anatomy", "--worker", v, "--shapes", a.shapes,
                               "--rows", a.rows], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"variant {v} failed: {proc.stderr.strip().splitlines()[-1:]}")
        result["rows"] += json.loads(proc.stdout.strip().splitlines()[-1])
    publish(result, markdown(result), a.out)


if __name__ == "__main__":
    main()
