"""Decode attention on one GPU: the fused Triton kernel (`qerl::gqa_decode`) against the batched-matmul path, per
layer of Qwen2.5 7B shapes (28 query / 4 KV heads of 128), over a static cache of which only a prefix is filled.

    python -m bench.attention --out results/bench/attention.json
    python -m bench.attention --paged --out results/bench/attention_paged.json   # the paged engine's kernel

--paged: the paged decode kernel (`qerl.rollout.triton_paged`) with the split the engine's captured steps use, its
block table as wide as the qwen7b recipe's rows (4,368 keys), rows of 900-3,300 filled keys, at 1-128 rows: the
decode kernel and the combine of its splits, one call per layer. --splits 1,2,4 also times those split counts
(one split: no combine); --keys long,mid,short picks the rows' lengths (900-3,300, 300-1,600: the 16-prompt
rollout's, 260-400: its first steps after a 256-token prompt): the engine's split rule looks at the block table's
width, not the lengths, so a short row splits as a long one. --configs 128x4x2,... also times the kernel with other
(key positions per tile, warps, pipeline stages), at every split count timed.

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


PAGED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
PAGED_WIDTH = 273  # blocks of 16: 4,368 keys, a 256-token prompt + 4,096 completion tokens + a spare block


KEY_KINDS = {  # rows' filled keys: a rollout's late steps, its middle (the 16-prompt rollout's 300-1,600), its start
    "long": lambda i: 900 + (37 * i) % 3300,
    "mid": lambda i: 300 + (37 * i) % 1301,
    "short": lambda i: 260 + (37 * i) % 141,
}


def _configs(text: str) -> list[tuple[int, int, int]]:
    """'64x4x3,128x8x2' -> [(64, 4, 3), (128, 8, 2)]: key positions per tile, warps, pipeline stages."""
    found = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        parts = item.split("x")
        if len(parts) != 3 or not all(v.isdigit() and int(v) > 0 for v in parts):
            raise SystemExit(f"bench.attention: --configs: expected TILExWARPSxSTAGES (e.g. 64x4x3), got {item!r}")
        found.append(tuple(int(v) for v in parts))
    return found


def run_paged(splits=(), kinds=("long",), configs=()) -> dict:
    from bench.random_models import paged_attention_case
    from qerl.rollout import triton_paged

    result = {**_environment(), "ceilings": measure_ceilings(), "rows": []}
    for kind in kinds:
        length = KEY_KINDS[kind]
        for rows in PAGED_ROWS:
            lengths = [length(i) for i in range(rows)]
            copies = 4
            cases = []
            for c in range(copies):
                q, k, v, table, lens = paged_attention_case(rows, 28, 4, 128, 16, lengths, torch.bfloat16, "cuda",
                                                               seed=c)
                pad = torch.zeros(rows, PAGED_WIDTH - table.shape[1], dtype=table.dtype, device="cuda")
                cases.append((q, k, v, torch.cat([table, pad], 1), lens))
            split = triton_paged.default_split(rows, 4, PAGED_WIDTH * 16, torch.device("cuda"))
            us = graph_time_us(lambda i: triton_paged.paged_decode(*cases[i], 128 ** -0.5), copies)
            others = {}
            for n in splits:
                if n != split:
                    others[str(n)] = graph_time_us(lambda i, n=n: triton_paged.paged_decode(*cases[i], 128 ** -0.5,
                                                                                            split=n), copies)
            for cfg in configs:  # each tile config at the default split and at the other split counts
                for n in [split, *[n for n in splits if n != split]]:
                    others[f"{n}@{'x'.join(map(str, cfg))}"] = graph_time_us(
                        lambda i, n=n, cfg=cfg: triton_paged.paged_decode(*cases[i], 128 ** -0.5, split=n,
                                                                          config=cfg), copies)
            floor = 2 * sum(lengths) * 4 * 128 * 2 / (result["ceilings"]["copy_GBps"] * 1e3)
            best = min([("default", us), *others.items()], key=lambda kv: kv[1])
            result["rows"].append({"keys": kind, "rows": rows, "split": split, "us": us, "floor_us": floor,
                                   "mean_keys": sum(lengths) / rows, "other_splits_us": others, "best": best})
            tried = "".join(f", split {n} {t:.1f} us" for n, t in others.items())
            print(f"paged, {kind} rows ({sum(lengths) / rows:.0f} keys), rows {rows}, split {split}: {us:.1f} us"
                  f"{tried}, floor {floor:.1f} us", flush=True)
    lines = ["| keys | rows | splits | us per layer | fastest other (split@tile x warps x stages), us | floor us |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['keys']} ({r['mean_keys']:.0f}) | {r['rows']} | {r['split']} | {r['us']:.1f} | "
              f"{r['best'][0]}: {r['best'][1]:.1f} | {r['floor_us']:.1f} |" for r in result["rows"]]
    result["markdown"] = "\n".join(lines)
    print(result["markdown"])
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/bench/attention.json"))
    p.add_argument("--paged", action="store_true", help="the paged engine's kernel at 1-128 rows instead")
    p.add_argument("--splits", default="", help="--paged: also these split counts, e.g. 1,2,4")
    p.add_argument("--short-rows", action="store_true", help="--paged: also rows of 260-400 keys (= --keys long,short)")
    p.add_argument("--keys", default="long", help=f"--paged: row lengths, of {','.join(KEY_KINDS)}")
    p.add_argument("--configs", default="", help="--paged: also these kernel configs, tile keys x warps x stages, "
                   "e.g. 128x4x2,64x8x3, each at every split count timed")
    a = p.parse_args(argv)
    configs = _configs(a.configs)
    kinds = [k.strip() for k in a.keys.split(",") if k.strip()] + (["short"] if a.short_rows else [])
    bad = [k for k in kinds if k not in KEY_KINDS]
    if bad:
        raise SystemExit(f"bench.attention: --keys: unknown {bad}, expected some of {list(KEY_KINDS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention needs a CUDA GPU")
    splits = tuple(int(n) for n in a.splits.split(",") if n.strip())
    result = run_paged(splits, tuple(dict.fromkeys(kinds)), configs) if a.paged else run()
    write_json(a.out, result)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
