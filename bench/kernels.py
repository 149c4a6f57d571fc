"""Kernel benchmark: NVFP4 Triton matmuls vs bf16 cuBLAS and a naive dequantize-then-matmul, per Qwen2.5 shape.

    python -m bench.kernels --out results/bench/kernels.json [--models 7B,14B,32B] [--rows 1,16,64,256,2048]
    python -m bench.kernels --sweep --models 7B --out results/bench/kernel_sweep.json   # tile configs per shape
    python -m bench.kernels --sweep --models 7B,7B-stacked --layers "q|k|v,down" --rows 256 --kinds fwd --jobs 12

One run measures the device's own ceilings first (a large device-to-device copy; an 8192^3 bf16 matmul), then for
every Linear shape and row count M: bf16 `torch.matmul`, the naive path (dequantize_nvfp4 to bf16, then matmul),
the fused forward and the fused grad_input kernel, with the floor max(bytes / bandwidth, flops / matmul rate) next
to each. Timing: each measurement is a CUDA graph of R calls over R copies of the weights (R * bytes > 4x L2, so
weights come from HBM as in a real forward pass), replayed and timed with CUDA events; median over replays / R.
Random weights, never zeros. Prints a Markdown table; writes the JSON atomically.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import statistics
from pathlib import Path

import torch

from qerl.quant.format import dequantize_nvfp4, quantize_nvfp4

# (model, names, N, K, how many of this shape per decoder layer): Qwen2.5 public configs.
QWEN_LINEARS = {
    "7B": [("q/o", 3584, 3584, 2), ("k/v", 512, 3584, 2), ("gate/up", 18944, 3584, 2), ("down", 3584, 18944, 1)],
    "14B": [("q/o", 5120, 5120, 2), ("k/v", 1024, 5120, 2), ("gate/up", 13824, 5120, 2), ("down", 5120, 13824, 1)],
    "32B": [("q/o", 5120, 5120, 2), ("k/v", 1024, 5120, 2), ("gate/up", 27648, 5120, 2), ("down", 5120, 27648, 1)],
    # the 7B layer as the engines run it (qerl.quant.grouped): q|k|v and gate|up stacked, one launch each
    "7B-stacked": [("q|k|v", 4608, 3584, 1), ("o", 3584, 3584, 1), ("gate|up", 37888, 3584, 1),
                   ("down", 3584, 18944, 1)],
}
ROTATE_BYTES = 4 * 50 * 2**20  # ~4x the L2 of an H100/H200


def _median_ms(fn, reps: int = 20, inner: int = 1) -> float:
    """Median of `reps` event-timed calls of fn (each doing `inner` units of work), per unit, in ms."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def graph_time_us(call, n_copies: int, reps: int = 15) -> float:
    """Per-call time (us) of call(i) for i in range(n_copies), captured once in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(n_copies):  # compile, allocate workspaces on this stream, fill caches
            call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(n_copies):
            call(i)
    ms = _median_ms(graph.replay, reps=reps, inner=n_copies)
    del graph
    return ms * 1e3


def eager_time_us(call, n_copies: int, reps: int = 5) -> float:
    """Per-call time (us) without a graph, for code that cannot be captured (host-to-device copies inside)."""
    def all_copies():
        for i in range(n_copies):
            call(i)
    return _median_ms(all_copies, reps=reps, inner=n_copies) * 1e3


def measure_ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and dense bf16 matmul rate, on random data."""
    n = 2 * 2**30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), reps=10)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda: a @ b, reps=10)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "bf16_tflops": 2 * 8192**3 / mm_ms / 1e9}


def _copies(nbytes: int) -> int:
    return max(1, min(32, math.ceil(ROTATE_BYTES / nbytes)))


def _fp4_weights(n: int, k: int, copies: int, seed: int):
    torch.manual_seed(seed)
    base = quantize_nvfp4(torch.randn(n, k, device="cuda"))
    out = [base]
    for i in range(1, copies):  # other random codes with the same statistics
        packed = torch.randint(0, 256, base[0].shape, dtype=torch.uint8, device="cuda")
        out.append((packed, base[1][torch.randperm(n, device="cuda")], base[2]))
    return out


def fp4_kernel(x: torch.Tensor, weight_packed: torch.Tensor, n: int, k: int) -> str:
    """Which forward qerl.quant.dispatch picks for x (NVFP4, no LoRA, one segment): cuda (kernels.cuda_fp4),
    triton (the fused Triton kernel), dense (chunked dequantize + cuBLAS) or reference (off CUDA)."""
    from qerl.quant import dispatch
    from qerl.quant.kernels import cuda_fp4
    from qerl.quant.kernels.device import device_index

    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else (0, 0)
    return dispatch.choose_kernel("forward", x.device.type, cap, x.shape[0], dtype=x.dtype,
                                  triton=lambda: dispatch._triton() is not None,
                                  cuda_fits=lambda: cuda_fp4.fits(x, weight_packed, n, k, n, n),
                                  cuda_builds=lambda: cuda_fp4.built(device_index(x.device)))


def bench_shape(n: int, k: int, m: int, ceilings: dict, seed: int = 0, naive: bool = True) -> dict:
    """All timings of one (N, K) weight at M rows, with bandwidth and floor figures."""
    from qerl.quant.dispatch import run_fp4_matmul, run_fp4_matmul_t
    from qerl.quant.kernels import humming_fp4

    fp4_bytes = n * k // 2 + n * k // 16 + 4
    fp4 = _fp4_weights(n, k, _copies(fp4_bytes), seed)
    nb = _copies(2 * n * k)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(nb)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    r = {"N": n, "K": k, "M": m}
    r["bf16_us"] = graph_time_us(lambda i: torch.matmul(x, wb[i].T), nb)
    r["fp4_us"] = graph_time_us(lambda i: run_fp4_matmul(x, *fp4[i]), len(fp4))
    r["fp4_kernel"] = fp4_kernel(x, fp4[0][0], n, k)
    if humming_fp4.available():  # both candidates of the dispatch, each timed alone: ours (QERL_FP4_HUMMING=0) and humming
        with env_var("QERL_FP4_HUMMING", "0"):
            r["ours_us"] = graph_time_us(lambda i: run_fp4_matmul(x, *fp4[i]), len(fp4))
        r["humming_us"] = graph_time_us(lambda i: run_fp4_matmul(x, *fp4[i], kernel="humming"), len(fp4))
        r["ours_speedup"], r["humming_speedup"] = r["bf16_us"] / r["ours_us"], r["bf16_us"] / r["humming_us"]
        humming_fp4.clear()
    r["bwd_bf16_us"] = graph_time_us(lambda i: torch.matmul(g, wb[i]), nb)
    r["bwd_fp4_us"] = graph_time_us(lambda i: run_fp4_matmul_t(g, *fp4[i]), len(fp4))
    if m >= 64:  # the dequantize + cuBLAS path, the many-row choice before the tiled kernels took these rows
        r["dense_us"] = graph_time_us(lambda i: run_fp4_matmul(x, *fp4[i], kernel="dense"), len(fp4))
        r["dense_speedup"] = r["bf16_us"] / r["dense_us"]
    if naive:
        r["naive_us"] = eager_time_us(
            lambda i: torch.matmul(x, dequantize_nvfp4(*fp4[i], dtype=torch.bfloat16).T), min(4, len(fp4)))
    del wb, fp4
    flops = 2 * m * n * k
    act_bytes = 2 * m * (n + k)
    bw = ceilings["copy_GBps"] * 1e3  # bytes per us
    rate = ceilings["bf16_tflops"] * 1e6  # flops per us
    r["fp4_floor_us"] = max((fp4_bytes + act_bytes) / bw, flops / rate)
    r["bf16_floor_us"] = max((2 * n * k + act_bytes) / bw, flops / rate)
    r["speedup"] = r["bf16_us"] / r["fp4_us"]
    r["bwd_speedup"] = r["bwd_bf16_us"] / r["bwd_fp4_us"]
    if naive:
        r["speedup_vs_naive"] = r["naive_us"] / r["fp4_us"]
    r["fp4_GBps"] = fp4_bytes / r["fp4_us"] / 1e3
    r["fp4_pct_peak_bw"] = 100 * r["fp4_GBps"] / ceilings["copy_GBps"]
    r["fp4_tflops"] = flops / r["fp4_us"] / 1e6
    r["bwd_fp4_tflops"] = flops / r["bwd_fp4_us"] / 1e6
    return r


def layer_totals(rows: list[dict], models: list[str]) -> list[dict]:
    """Sum over the 7 Linear layers of one decoder layer (q, k, v, o, gate, up, down) per model and M; only where
    every shape of that layer was timed (a run stopped early leaves some out)."""
    out = []
    for model in models:
        for m in sorted({r["M"] for r in rows if r["model"] == model}):
            sel = [r for r in rows if r["model"] == model and r["M"] == m]
            if {r["layer"] for r in sel} != {shape[0] for shape in QWEN_LINEARS[model]}:
                continue
            tot = {key: sum(r[key] * r["per_layer"] for r in sel)
                   for key in ("bf16_us", "fp4_us", "bwd_bf16_us", "bwd_fp4_us", "fp4_floor_us")}
            for key in ("ours_us", "humming_us"):
                if all(key in r for r in sel):
                    tot[key] = sum(r[key] * r["per_layer"] for r in sel)
                    tot[key.replace("_us", "_speedup")] = tot["bf16_us"] / tot[key]
            if all("dense_us" in r for r in sel):
                tot["dense_us"] = sum(r["dense_us"] * r["per_layer"] for r in sel)
                tot["dense_speedup"] = tot["bf16_us"] / tot["dense_us"]
            if all("naive_us" in r for r in sel):
                tot["naive_us"] = sum(r["naive_us"] * r["per_layer"] for r in sel)
            out.append({"model": model, "M": m, **tot, "speedup": tot["bf16_us"] / tot["fp4_us"],
                        "bwd_speedup": tot["bwd_bf16_us"] / tot["bwd_fp4_us"]})
    return out


def markdown(result: dict) -> str:
    c = result["ceilings"]

    def opt(row: dict, key: str, fmt: str) -> str:  # columns absent with --no-naive print as "-"
        return format(row[key], fmt) if key in row else "-"

    lines = [f"Device: {result['device']} ({result['date']}); measured copy {c['copy_GBps']:.0f} GB/s, "
             f"bf16 matmul {c['bf16_tflops']:.0f} TFLOP/s", "",
             "| model | layer | N x K | M | bf16 us | naive us | fp4 us (kernel) | fp4 floor us | x bf16 | x naive | "
             "GB/s (% peak) | bwd bf16 us | bwd fp4 us | bwd x bf16 | dense x bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['N']}x{r['K']} | {r['M']} | {r['bf16_us']:.1f} | "
            f"{opt(r, 'naive_us', '.1f')} | {r['fp4_us']:.1f} ({r.get('fp4_kernel', 'triton')}) | "
            f"{r['fp4_floor_us']:.1f} | "
            f"{r['speedup']:.2f} | {opt(r, 'speedup_vs_naive', '.1f')} | "
            f"{r['fp4_GBps']:.0f} ({r['fp4_pct_peak_bw']:.0f}%) | {r['bwd_bf16_us']:.1f} | {r['bwd_fp4_us']:.1f} | "
            f"{r['bwd_speedup']:.2f} | {opt(r, 'dense_speedup', '.2f')} |")
    lines += ["", "Per decoder layer (7B: q, k, v, o, gate, up, down; 7B-stacked: q|k|v, o, gate|up, down); dense = "
              "dequantize + cuBLAS:", "",
              "| model | M | bf16 us | naive us | fp4 us | fp4 floor us | x bf16 | ours x bf16 | humming x bf16 | "
              "dense x bf16 | bwd bf16 us | bwd fp4 us | bwd x |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in result["layer_totals"]:
        lines.append(f"| {t['model']} | {t['M']} | {t['bf16_us']:.0f} | {opt(t, 'naive_us', '.0f')} | "
                     f"{t['fp4_us']:.0f} | {t['fp4_floor_us']:.0f} | {t['speedup']:.2f} | "
                     f"{opt(t, 'ours_speedup', '.2f')} | {opt(t, 'humming_speedup', '.2f')} | "
                     f"{opt(t, 'dense_speedup', '.2f')} | {t['bwd_bf16_us']:.0f} | "
                     f"{t['bwd_fp4_us']:.0f} | {t['bwd_speedup']:.2f} |")
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


@contextlib.contextmanager
def env_var(name: str, value: str):
    """An environment variable (a kernel choice such as QERL_FP4_CUDA) set for the block, restored after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def publish(result: dict, table: str, out: Path) -> None:
    """Print a benchmark's Markdown table and write its JSON (with the table) atomically."""
    result["markdown"] = table
    print(table)
    write_json(out, result)
    print(f"wrote {out}")


def _environment() -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(), "date": dt.datetime.now(dt.timezone.utc).isoformat(
        timespec="seconds"), "torch": torch.__version__, "triton": triton.__version__,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count}


def run(models: list[str], rows_m: list[int], naive: bool, on_row=None) -> dict:
    """Every shape of `models` at every M; on_row(result so far) after each (a run stopped early keeps those)."""
    result = {**_environment(), "ceilings": measure_ceilings(), "rows": []}
    timed: dict[tuple[int, int, int], dict] = {}  # a shape in two models is timed once
    for model in models:
        for seed, (layer, n, k, per_layer) in enumerate(QWEN_LINEARS[model]):
            for m in rows_m:
                if (n, k, m) not in timed:
                    timed[n, k, m] = bench_shape(n, k, m, result["ceilings"], seed=seed, naive=naive)
                r = timed[n, k, m]
                result["rows"].append({"model": model, "layer": layer, "per_layer": per_layer, **r})
                extra = f"; ours {r['ours_us']:.1f} humming {r['humming_us']:.1f} us" if "humming_us" in r else ""
                print(f"{model} {layer} M={m}: bf16 {r['bf16_us']:.1f} fp4 {r['fp4_us']:.1f} us "
                      f"(x{r['speedup']:.2f}, {r['fp4_kernel']}); bwd x{r['bwd_speedup']:.2f}{extra}", flush=True)
                if on_row:
                    on_row({**result, "partial": True, "layer_totals": layer_totals(result["rows"], models)})
    result["layer_totals"] = layer_totals(result["rows"], models)
    return result


# Candidate tiles per row bucket: (bm, bn, bk, warps, stages, maxnreg[, swap_ab[, tma]]); split-K: none, 2 and 6
# programs per SM up to 64 rows, none and one wave's worth above. "dense" = chunked dequantize + cuBLAS
# (qerl.quant.kernels.triton_dequant). swap_ab (W as the MMA's A operand) runs on Hopper's wgmma with the dequantized W
# straight from registers (unswapped: W goes through smem, and its wgmma waits for each step); tma: x tiles by a TMA
# descriptor (without it the swapped many-row tiles needed ~230 registers a thread). The first M <= 16 entry is the
# shipped default (forward_config), the second its 4-stage predecessor.
_ST = (None, True, True)  # swapped + TMA: the sm_90+ many-row tiles (tiling.many_rows_config)
# (256, 128, 64, 8, 3, swapped + TMA) gave wrong results (H200, Triton 3.6), so it is not swept
_MANY_FWD = [(128, 64, 64, 4, 4, *_ST), (256, 64, 64, 4, 3, *_ST), (256, 64, 64, 4, 4, *_ST),
             (128, 128, 64, 8, 3, *_ST), "dense"]
SWEEP_FWD = {
    16: [(16, 32, 256, 4, 3, 128), (16, 32, 256, 4, 4, 128), (16, 64, 256, 4, 4, None), (16, 64, 128, 4, 4, None),
         (16, 128, 128, 4, 3, None), (16, 128, 128, 4, 4, None), (16, 128, 64, 4, 4, None), (16, 256, 64, 4, 4, None),
         (16, 256, 64, 8, 4, None),
         (16, 32, 256, 2, 4, None, True), (16, 32, 128, 2, 4, None, True), (16, 32, 128, 2, 6, None, True),
         (16, 64, 128, 4, 4, None, True), (16, 64, 256, 4, 3, None, True), (16, 128, 128, 4, 3, None, True)],
    64: [(32, 64, 256, 4, 3, None), (64, 64, 64, 4, 4, None), (64, 64, 64, 4, 4, *_ST), (64, 64, 64, 4, 3, *_ST),
         (64, 128, 64, 8, 3, *_ST)],
    128: [(64, 64, 64, 4, 4, *_ST), (128, 64, 64, 4, 3, *_ST), (128, 64, 64, 4, 4, *_ST), (128, 128, 64, 8, 3, *_ST),
          "dense"],
    256: _MANY_FWD,
    512: _MANY_FWD,
    2048: _MANY_FWD,
}
_MANY_BWD = [(64, 128, 64, 4, 4, None), (128, 64, 128, 8, 4, None), (128, 128, 128, 8, 3, None),
             (64, 64, 128, 4, 4, None), (128, 64, 64, 4, 4, None), (64, 128, 128, 4, 3, None), "dense"]
SWEEP_BWD = {  # bn = reduction step over N, bk = output tile along K
    16: [(16, 128, 64, 4, 4, None), (16, 128, 128, 4, 4, None), (16, 256, 64, 8, 3, None), (16, 64, 64, 4, 4, None),
         "dense"],
    64: [(64, 128, 64, 4, 4, None), (64, 64, 128, 4, 4, None), (32, 128, 64, 4, 4, None), "dense"],
    128: _MANY_BWD,
    256: _MANY_BWD,
    512: _MANY_BWD,
    2048: [(128, 64, 128, 8, 4, None), (128, 128, 128, 8, 3, None), (128, 64, 256, 8, 3, None), "dense"],
}


def _bucket(m: int) -> int:
    return next(b for b in sorted(SWEEP_FWD) if m <= b) if m <= max(SWEEP_FWD) else max(SWEEP_FWD)


def split_counts(tiles: int, k_tiles: int, waves=(2, 6), one: bool = False) -> list[int]:
    """The split-K counts to time for a grid of `tiles` output tiles over `k_tiles` K steps: what the few-row rule
    (tiling.pick_split) picks for each target of `waves`, and 1 when `one`."""
    from qerl.quant.kernels.tiling import pick_split

    dev = torch.device("cuda")
    return sorted(({1} if one else set()) | {pick_split(tiles, k_tiles, dev, waves=w) for w in waves})


def _candidates(kind, m, n, k):
    """(label, kwargs) of every config to try for one shape."""
    from qerl.quant.kernels.tiling import KernelConfig

    for cand in (SWEEP_FWD if kind == "fwd" else SWEEP_BWD)[_bucket(m)]:
        if cand == "dense":
            yield "dense", {"kernel": "dense"}
            continue
        bm, bn, bk, warps, stages, maxnreg, *flags = cand
        tiles = math.ceil(m / bm) * (math.ceil(n / bn) if kind == "fwd" else k // bk)
        k_tiles = math.ceil(k / bk) if kind == "fwd" else math.ceil(n / bn)
        for sp in split_counts(tiles, k_tiles, (2, 6) if m <= 64 else (1,), one=True):
            cfg = KernelConfig(bm, bn, bk, sp, warps, stages, 8, maxnreg, *map(bool, flags))
            label = list(cfg)[:6] + ([maxnreg] if maxnreg else []) + (["swap"] if cfg.swap_ab else []) + (
                ["tma"] if cfg.tma else [])
            yield str(label), {"config": cfg}


def _try_config(kind, label, n, k, m, ref, call, copies) -> dict:
    """Error vs the float64 result and time of one config; a config that fails to build is recorded."""
    row = {"kind": kind, "N": n, "K": k, "M": m, "config": label}
    try:
        row["err"] = ((call(0).double() - ref).norm() / ref.norm()).item()
        row["us"] = graph_time_us(call, copies)
    except Exception as exc:  # e.g. shared memory overflow of a large tile
        row.update(us=float("inf"), err=float("nan"), error=str(exc).splitlines()[0][:200])
    return row


def _sweep_one(n, k, m, fp4, x, g, kinds=("fwd", "bwd"), broken=frozenset()) -> list[dict]:
    from qerl.quant.dispatch import run_fp4_matmul, run_fp4_matmul_t

    out = []
    for kind in kinds:
        a = x if kind == "fwd" else g
        run = run_fp4_matmul if kind == "fwd" else run_fp4_matmul_t
        ref = fp4_reference(a, *fp4[0], transposed=kind == "bwd")
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(_copies(2 * n * k))]
        bf16 = graph_time_us(lambda i: a @ (wb[i].T if kind == "fwd" else wb[i]), len(wb))
        del wb
        out.append({"kind": kind, "N": n, "K": k, "M": m, "config": "bf16", "us": bf16, "err": 0.0})
        for label, kw in _candidates(kind, m, n, k):
            if (kind, n, k, m, label) in broken:  # failed to compile in a worker: not retried here
                continue
            out.append(_try_config(kind, label, n, k, m, ref, lambda i, kw=kw: run(a, *fp4[i], **kw), len(fp4)))
    return out


def fp4_reference(a: torch.Tensor, weight_packed, weight_scale, weight_global_scale,
                  transposed: bool = False) -> torch.Tensor:
    """a @ deq(W).T (or a @ deq(W)) in float64 from compressed-tensors' own dequantization: the sweep's yardstick."""
    w = dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, torch.float32).double()
    return a.double() @ (w if transposed else w.T)


_WORKER_WEIGHTS: dict = {}


def _compile_one(task):
    """Run one config once in a worker process, which leaves its compiled kernel in Triton's on-disk cache."""
    kind, n, k, m, label, kw = task
    from qerl.quant.dispatch import run_fp4_matmul, run_fp4_matmul_t

    try:
        if (n, k) not in _WORKER_WEIGHTS:
            _WORKER_WEIGHTS[n, k] = _fp4_weights(n, k, 1, 0)[0]
        a = torch.randn(m, k if kind == "fwd" else n, device="cuda", dtype=torch.bfloat16)
        (run_fp4_matmul if kind == "fwd" else run_fp4_matmul_t)(a, *_WORKER_WEIGHTS[n, k], **kw)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return (kind, n, k, m, label, str(exc).splitlines()[0][:200])


def precompile(shapes, rows_m, kinds, jobs: int) -> set:
    """Compile every candidate of the sweep in `jobs` processes first (Triton compiles one kernel at a time per
    process); returns the (kind, n, k, m, label) that failed."""
    import concurrent.futures as cf
    import multiprocessing as mp

    tasks = [(kind, n, k, m, label, kw) for (n, k) in shapes for m in rows_m for kind in kinds
             for label, kw in _candidates(kind, m, n, k)]
    broken = set()
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        for fut in [pool.submit(_compile_one, t) for t in tasks]:
            try:
                err = fut.result()
            except Exception as exc:  # a worker died: the timing loop compiles what is left itself
                print(f"precompile stopped: {exc!r}", flush=True)
                break
            if err:
                broken.add(err[:5])
                print(f"compile failed: {err}", flush=True)
    print(f"precompiled {len(tasks)} configs, {len(broken)} failed", flush=True)
    return broken


def sweep(rows_m: list[int], kinds=("fwd", "bwd"), models=("7B",), layers=None, jobs: int = 0) -> list[dict]:
    """Time every candidate config on the models' distinct shapes (optionally only `layers`); prints the best per
    (kind, shape, M) with its ratio to bf16 cuBLAS."""
    shapes = {}
    for model in models:
        for layer, n, k, _ in QWEN_LINEARS[model]:
            if layers is None or layer in layers:
                shapes.setdefault((n, k), layer)
    broken = precompile(list(shapes), rows_m, kinds, jobs) if jobs > 1 else set()
    results = []
    for seed, ((n, k), layer) in enumerate(shapes.items()):
        fp4 = _fp4_weights(n, k, _copies(n * k // 2 + n * k // 16), seed)
        for m in rows_m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            res = _sweep_one(n, k, m, fp4, x, g, kinds, broken)
            for kind in kinds:
                mine = [r for r in res if r["kind"] == kind]
                bf16 = next(r["us"] for r in mine if r["config"] == "bf16")
                best = min((r for r in mine if r["config"] != "bf16" and r["err"] <= 1e-2), key=lambda r: r["us"],
                           default={"config": "-", "us": float("inf")})
                print(f"sweep {kind} {layer} {n}x{k} M={m}: bf16 {bf16:.1f}, best {best['config']} {best['us']:.1f} "
                      f"us (x{bf16 / best['us']:.2f}); all " + ", ".join(
                          f"{r['config']}={r['us']:.1f}{'' if r['err'] <= 1e-2 else '!'}"
                          for r in mine if r["config"] != "bf16"), flush=True)
            results += res
        del fp4
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/bench/kernels.json"))
    p.add_argument("--models", default="7B,14B,32B")
    p.add_argument("--rows", default="1,16,64,256,2048")
    p.add_argument("--no-naive", action="store_true", help="skip the (slow) dequantize-then-matmul baseline")
    p.add_argument("--sweep", action="store_true", help="time candidate tile configs instead (SWEEP_FWD / SWEEP_BWD)")
    p.add_argument("--kinds", default="fwd,bwd", help="--sweep: fwd (x @ W.T), bwd (grad_out @ W) or both")
    p.add_argument("--layers", default=None, help="--sweep: only these layer names (comma-separated), e.g. down,o")
    p.add_argument("--jobs", type=int, default=0, help="--sweep: compile the candidates in this many processes first")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels needs a CUDA GPU")
    rows_m = [int(v) for v in a.rows.split(",")]
    if a.sweep:
        layers = set(a.layers.split(",")) if a.layers else None
        result = {**_environment(), "sweep": sweep(rows_m, tuple(a.kinds.split(",")), a.models.split(","), layers,
                                                   a.jobs)}
    else:
        result = run(a.models.split(","), rows_m, naive=not a.no_naive, on_row=lambda part: write_json(a.out, part))
        print(markdown(result))
        result["markdown"] = markdown(result)
    write_json(a.out, result)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
