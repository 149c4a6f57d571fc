"""Decode attention on one GPU: the fused Triton kernel (`qerl::gqa_decode`) against the batched-matmul path, per
layer of Qwen2.5 7B shapes (28 query / 4 KV heads of 128), over a static cache of which only a prefix is filled.

    python -m bench.attention --out results/bench/attention.json

Floor = the filled part of K and V (both paths must read it) over the measured copy bandwidth. Both paths run
eagerly here; inside TorchEngine the matmul path is torch.compile'd (fused), which is why the engine only takes
the kernel from one (row, KV head) program per SM on (qerl.rollout.attention).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.kernels import _environment, env_var, graph_time_us, measure_ceilings, write_json

CASES = [  # (rows, static cache length, filled positions per row)
    (8, 1280, 768), (64, 1280, 768), (8, 2304, 1536), (64, 2304, 1536), (64, 2304, 300),
]


def _case(rows: int, length: int, filled: int, heads: int = 28, kv_heads: int = 4, d: int = 128):
    q = torch.randn(rows, heads, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, length, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    keep = torch.zeros(rows, length, dtype=torch.bool, device="cuda")
    keep[:, :filled] = True
    return q, k, v, keep[:, None, None, :]


def run() -> dict:
    from qerl.rollout.attention import decode_attention

    result = {**_environment(), "ceilings": measure_ceilings(), "rows": []}
    for rows, length, filled in CASES:
        copies = 4  # different caches per call: K/V stream from memory, not L2
        cases = [_case(rows, length, filled) for _ in range(copies)]
        times = {}
        for path in ("torch", "triton"):
            with env_var("QERL_DECODE_ATTENTION", path):
                times[path] = graph_time_us(lambda i: decode_attention(None, *cases[i][:3], cases[i][3]), copies)
        kv_bytes = 2 * rows * 4 * filled * 128 * 2
        floor = kv_bytes / (result["ceilings"]["copy_GBps"] * 1e3)
        row = {"rows": rows, "cache_len": length, "filled": filled, "torch_us": times["torch"],
               "triton_us": times["triton"], "speedup": times["torch"] / times["triton"], "floor_us": floor}
        result["rows"].append(row)
        print(f"rows {rows} cache {length} filled {filled}: torch {row['torch_us']:.1f} us, triton "
              f"{row['triton_us']:.1f} us (x{row['speedup']:.2f}), floor {floor:.1f} us", flush=True)
    lines = ["| rows | cache | filled | matmul path us | Triton us | x | floor us (filled K+V) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['cache_len']} | {r['filled']} | {r['torch_us']:.1f} | {r['triton_us']:.1f} | "
              f"{r['speedup']:.2f} | {r['floor_us']:.1f} |" for r in result["rows"]]
    result["markdown"] = "\n".join(lines)
    print(result["markdown"])
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/bench/attention.json"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention needs a CUDA GPU")
    result = run()
    write_json(a.out, result)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
