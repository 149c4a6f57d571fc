"""The FP4 matmul at 1-32 rows, where a rollout's tail decodes: every kernel we have on each Qwen2.5 layer shape
(stacked as the engines run them: q|k|v, o, gate|up, down), with LoRA r 32 on every segment as a decode step runs
it, against bf16 cuBLAS and the FP4 bytes' floor.

    python -m bench.few_rows --sizes 7B,32B --rows 1,4,8,12,16,24,32 --out results/bench/few_rows.json
    python -m bench.few_rows --rows 1,4,8,12,16 --no-humming --cuda-source old.cu,+NAME=1   # A/B sources

Kernels: cuda (the few-row CUDA kernel, <= 16 rows, x @ A.T in the same launch), triton (+ small_matmul for
x @ A.T), humming (humming-kernels + small_matmul + one B GEMM), each through qerl.quant.dispatch.run_fp4_matmul
with the kernel named; bf16 = x @ W.T + (x @ A.T) @ B.T in cuBLAS. Times:
microseconds per call, a CUDA graph of calls over rotating weight copies (more bytes than L2), so weights stream
from HBM as in a forward.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch

from bench.common import ints
from bench.humming_tune import _L2_SPAN, copy_bandwidth, graph_us
from bench.random_models import QWEN25_SHAPES

RANK = 32
# Triton tiles of 32 rows, timed beside the shipped rule from 17 rows (bm, bn, bk, warps, stages, maxnreg): does one
# 32-row tile, which decodes each weight once for all rows, beat humming where the rule sends these rows?
MID_TILES = [(32, 32, 256, 4, 3, 128), (32, 32, 128, 4, 4, None), (32, 64, 128, 4, 3, None), (32, 64, 256, 4, 3, None),
             (32, 32, 256, 8, 3, None)]


def mid_configs(m, n, k):
    """(label, KernelConfig) of MID_TILES at m rows, each with the split-K counts the few-row rule would pick."""
    import math

    from bench.kernels import split_counts
    from qerl.quant.kernels.tiling import KernelConfig, k_block

    for bm, bn, bk, warps, stages, maxnreg in MID_TILES:
        bk = k_block(k, bk)
        for split in split_counts(math.ceil(m / bm) * math.ceil(n / bn), math.ceil(k / bk)):
            yield (f"t{bm}x{bn}x{bk}w{warps}s{stages}k{split}",
                   KernelConfig(bm, bn, bk, split, warps, stages, 8, maxnreg))


def layers(size: str) -> dict[str, tuple[tuple[int, ...], int]]:
    hidden, inter, _, heads, kv, _ = QWEN25_SHAPES[size]
    kvd = kv * (hidden // heads)
    return {"qkv": ((hidden, kvd, kvd), hidden), "o": ((hidden,), hidden), "gate_up": ((inter, inter), hidden),
            "down": ((hidden,), inter)}


def weights(segments, k, copies, gen):
    out = []
    n = sum(segments)
    for _ in range(copies):
        wp = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        ws = (torch.rand(n, k // 16, device="cuda", generator=gen) + 0.5).to(torch.float8_e4m3fn)
        gs = torch.full((len(segments),), 448.0 * 6, device="cuda")
        a = torch.randn(len(segments) * RANK, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
        b = torch.randn(n, RANK, device="cuda", dtype=torch.bfloat16, generator=gen)
        out.append((wp, ws, gs, a, b))
    return out


_ALT_MODULES: dict = {}


@contextlib.contextmanager
def cuda_source(spec):
    """The few-row CUDA kernel built from another source while inside (None: the shipped one). spec: a path to
    another fp4_gemv.cu, or "+NAME=VALUE" (several joined by "+"): the shipped file with those #defines in front
    (the experiments it keeps behind #ifdef). Each is compiled once; the occupancy and config caches, which read
    the module, are emptied on the way in and out."""
    from qerl.quant.kernels import cuda_fp4

    if spec is None:
        yield
        return
    dev = torch.cuda.current_device()
    shipped_file, shipped_source, shipped_module = cuda_fp4.SOURCE_FILE, cuda_fp4.source, cuda_fp4._module
    if (spec, dev) not in _ALT_MODULES:
        if spec.startswith("+"):
            defines = "".join(f"#define {d.partition('=')[0]} {d.partition('=')[2] or 1}\n"
                              for d in spec[1:].split("+") if d)
            cuda_fp4.source = lambda: defines + shipped_source()
        else:
            cuda_fp4.SOURCE_FILE = Path(spec)
            shipped_source.cache_clear()
        try:
            _ALT_MODULES[(spec, dev)] = shipped_module.__wrapped__(dev)
        finally:
            cuda_fp4.SOURCE_FILE, cuda_fp4.source = shipped_file, shipped_source
            shipped_source.cache_clear()
    cuda_fp4._module = lambda index: _ALT_MODULES[(spec, index)]
    cuda_fp4._occupancy.cache_clear()
    cuda_fp4._config.cache_clear()
    try:
        yield
    finally:
        cuda_fp4._module = shipped_module
        cuda_fp4._occupancy.cache_clear()
        cuda_fp4._config.cache_clear()


def source_label(spec: str) -> str:
    return "cuda:" + (spec[1:] if spec.startswith("+") else Path(spec).stem)


def run_shape(name, segments, k, rows, bandwidth, humming, mid=False, alt_source=None) -> dict:
    from qerl.quant.dispatch import run_fp4_matmul
    from qerl.quant.kernels import humming_fp4

    n = sum(segments)
    fp4_bytes = n * k // 2 + n * k // 16
    copies = max(2, min(16, int(_L2_SPAN // fp4_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws_ = weights(segments, k, copies, gen)
    if humming:
        for wp, ws, gs, *_ in ws_:
            humming_fp4.humming_weight(wp, ws, gs, segments, torch.bfloat16, (32, 64))
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
             for _ in range(max(2, min(4, int(_L2_SPAN // (2 * n * k)))))]
    seg = list(segments)
    result = {"segments": seg, "k": k, "copies": copies, "floor_us": fp4_bytes / bandwidth * 1e6, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        row = {}
        kernels = [(kn, kn, None) for kn, ok in (("cuda", m <= 16), ("triton", True), ("humming", humming)) if ok]
        for source in (alt_source or []) if m <= 16 else []:
            kernels.insert(1, (source_label(source), "cuda", source))  # after the shipped kernel
        shipped_out, diffs = None, {}
        for label, kernel, source in kernels:
            def call(i, kernel=kernel):
                wp, ws, gs, a, b = ws_[i]
                return run_fp4_matmul(x, wp, ws, gs, None, a, b, 1.0, segments=seg, kernel=kernel)
            try:
                with cuda_source(source):
                    row[label] = graph_us(call, copies)
                    if kernel == "cuda":  # an experiment must give the shipped kernel's numbers
                        out = call(0).float()
                        if source is None:
                            shipped_out = out
                        elif shipped_out is not None:
                            diffs[label] = (out - shipped_out).abs().max().item()
            except Exception as err:  # noqa: BLE001 - report and go on to the next kernel
                row[label] = None
                print(f"  {name} M={m} {label}: {type(err).__name__}: {str(err)[:160]}", flush=True)
        if mid and m > 16:
            tried = {}
            for label, cfg in mid_configs(m, n, k):
                def call(i, cfg=cfg):
                    wp, ws, gs, a, b = ws_[i]
                    run_fp4_matmul(x, wp, ws, gs, None, a, b, 1.0, segments=seg, config=cfg)
                try:
                    tried[label] = graph_us(call, copies)
                except Exception as err:  # noqa: BLE001 - a tile that does not build: report, go on
                    print(f"  {name} M={m} {label}: {type(err).__name__}: {str(err)[:120]}", flush=True)
            if tried:
                best = min(tried, key=tried.get)
                row["triton_mid"], row["triton_mid_tile"], row["triton_mid_all"] = tried[best], best, tried

        xa_w = [torch.randn(len(seg) * RANK, k, device="cuda", dtype=torch.bfloat16) for _ in dense]
        b_d = [torch.randn(n, len(seg) * RANK, device="cuda", dtype=torch.bfloat16) for _ in dense]
        row["bf16"] = graph_us(lambda i: torch.addmm(x @ dense[i].T, x @ xa_w[i].T, b_d[i].T), len(dense))
        result["rows"][m] = row
        ours = {kn: v for kn, v in row.items()
                if (kn in ("cuda", "triton", "humming", "triton_mid") or kn.startswith("cuda:")) and v}
        text = "  ".join(f"{kn} {v:6.1f}" for kn, v in ours.items())
        if diffs:
            result.setdefault("max_diff_vs_cuda", {})[m] = diffs
            text += "  (max |diff| vs cuda: " + ", ".join(f"{kn} {v:.3g}" for kn, v in diffs.items()) + ")"
        print(f"{name:8s} M={m:3d}  {text}  bf16 {row['bf16']:6.1f}  floor {result['floor_us']:5.1f} us"
              , flush=True)
    for wp, *_ in ws_:
        humming_fp4.drop(wp)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.few_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="7B")
    p.add_argument("--rows", type=ints, default=[1, 8, 16, 24, 32])
    p.add_argument("--layers", default="qkv,o,gate_up,down")
    p.add_argument("--no-humming", action="store_true")
    p.add_argument("--mid", action="store_true", help="from 17 rows also time MID_TILES (32-row Triton tiles)")
    p.add_argument("--cuda-source", default=None, type=lambda v: [f for f in v.split(",") if f],
                   help="also time the few-row CUDA kernel built from these sources (comma-separated), each as "
                        "cuda:<name>, with its largest difference from the shipped kernel's output: a path to an "
                        "fp4_gemv.cu (an earlier commit's: git show REV:qerl/quant/kernels/fp4_gemv.cu > old.cu) or "
                        "+NAME=VALUE, the shipped file with that #define (+NAME=1)")
    p.add_argument("--out", default="results/bench/few_rows.json")
    args = p.parse_args(argv)
    from qerl.quant.kernels import humming_fp4

    humming = not args.no_humming and humming_fp4.available(torch.device("cuda"))
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, humming {humming}",
          flush=True)
    payload = {"device": torch.cuda.get_device_name(), "bandwidth_bytes_s": bandwidth, "args": vars(args),
               "lora_rank": RANK, "shapes": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for size in args.sizes.split(","):
        for name in args.layers.split(","):
            segments, k = layers(size)[name]
            payload["shapes"][f"{size}/{name}"] = run_shape(f"{size}/{name}", segments, k, args.rows, bandwidth,
                                                            humming, args.mid, args.cuda_source)
            out.with_suffix(".tmp").write_text(json.dumps(payload, indent=2) + "\n")
            os.replace(out.with_suffix(".tmp"), out)
    totals = {}
    for key, shape in payload["shapes"].items():
        size = key.split("/")[0]
        for m, row in shape["rows"].items():
            for kn, v in row.items():
                if isinstance(v, float):
                    totals.setdefault((size, m, kn), 0.0)
                    totals[(size, m, kn)] += v
    print("\nper decoder layer (4 stacked calls with LoRA), us:")
    for (size, m, kn), v in sorted(totals.items(), key=lambda t: (t[0][0], int(t[0][1]), t[0][2])):
        print(f"  {size} M={m:>3} {kn:13s} {v:7.1f}")
    payload["layer_totals_us"] = {f"{s}/{m}/{kn}": v for (s, m, kn), v in totals.items()}
    out.with_suffix(".tmp").write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(out.with_suffix(".tmp"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
