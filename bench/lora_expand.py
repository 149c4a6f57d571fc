"""LoRA's B product at decode and prefill row counts: the one-pass kernel (qerl.quant.kernels.lora_expand) against
what it replaced, cuBLAS's addmm over the block-diagonal stacked B (and the bias add before it), per Qwen2.5 layer
shape as the engines stack them (q|k|v with bias, o, gate|up, down; LoRA r 32 on every member), and the floor:
output read + written once, xa and B read once, at the measured copy bandwidth.

    python -m bench.lora_expand --sizes 7B --rows 16,32,48,64,96,128,256,512,1024 --out results/bench/lora_expand.json

Times: microseconds per call, a CUDA graph of calls cycling over output copies larger than L2 (as in a decode
step, where the output was just written by the FP4 GEMM but other layers' weights have streamed through since).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.common import ints
from bench.few_rows import RANK, layers
from bench.humming_tune import _L2_SPAN, copy_bandwidth, graph_us


def run_shape(name, segments, rows, bandwidth, bias: bool) -> dict:
    from qerl.quant.dispatch import run_lora_expand
    from qerl.quant.grouped import block_diagonal

    n, s = sum(segments), len(segments)
    n1, n2 = ([*[sum(segments[:i + 1]) for i in range(s - 1)], n, n])[:2]
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = torch.randn(n, RANK, device="cuda", dtype=torch.bfloat16, generator=gen)
    diag = block_diagonal(b, segments)
    bi = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if bias else None
    result = {"segments": list(segments), "bias": bias, "rows": {}}
    for m in rows:
        copies = max(2, min(16, int(_L2_SPAN // (2 * m * n))))
        outs = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
        xa = torch.randn(m, s * RANK, device="cuda", dtype=torch.bfloat16, generator=gen)

        def kernel(i):
            run_lora_expand(outs[i], xa, b, 2.0, n1, n2, bi, diag, out=outs[i])

        def cublas(i):
            if bi is not None:
                outs[i].add_(bi)
            outs[i].addmm_(xa, diag.T, alpha=2.0)

        floor = (2 * m * n * 2 + m * s * RANK * 2 + n * RANK * 2) / bandwidth * 1e6
        row = {"kernel_us": graph_us(kernel, copies), "cublas_us": graph_us(cublas, copies), "floor_us": floor}
        result["rows"][m] = row
        print(f"{name:10s} M={m:5d}  one pass {row['kernel_us']:7.1f}  cuBLAS(+bias) {row['cublas_us']:7.1f}  "
              f"floor {floor:6.1f} us  x{row['cublas_us'] / row['kernel_us']:.2f}", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lora_expand", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="7B")
    p.add_argument("--rows", type=ints, default=[16, 32, 48, 64, 96, 128, 256, 512, 1024])
    p.add_argument("--out", default="results/bench/lora_expand.json")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    payload = {"device": torch.cuda.get_device_name(), "bandwidth_bytes_s": bandwidth, "args": vars(args),
               "lora_rank": RANK, "shapes": {}}
    totals: dict[tuple[str, int], list[float]] = {}
    for size in args.sizes.split(","):
        for name, (segments, _k) in layers(size).items():
            shape = run_shape(f"{size}/{name}", segments, args.rows, bandwidth, bias=name == "qkv")
            payload["shapes"][f"{size}/{name}"] = shape
            for m, row in shape["rows"].items():
                t = totals.setdefault((size, m), [0.0, 0.0, 0.0])
                for j, key in enumerate(("kernel_us", "cublas_us", "floor_us")):
                    t[j] += row[key]
    print("\nper decoder layer (4 stacked calls), us: one pass / cuBLAS (+bias) / floor")
    for (size, m), (k, c, f) in totals.items():
        print(f"  {size} M={m:5d}  {k:7.1f} / {c:7.1f} / {f:6.1f}   x{c / k:.2f}")
    payload["layer_totals_us"] = {f"{s}/{m}": dict(zip(("kernel", "cublas", "floor"), v))
                                  for (s, m), v in totals.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".tmp").write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(out.with_suffix(".tmp"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
