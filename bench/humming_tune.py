"""humming-kernels' W4A16 GEMM on a Qwen2.5 layer's NVFP4 weights: the kernel its heuristics pick per M against
sampled legal configurations (humming's own sampler), and cuBLAS bf16 on the same shape, each timed as a CUDA graph
of launches over rotating weight copies (no host overhead, weights not served from L2), beside the FP4 bytes' floor.

    python -m bench.humming_tune --size 7B --rows 16,32,64,128 --samples 24 --out results/bench/humming_tune.json

--variants also times one-field edits of the heuristic's own pick at each M (Stream-K flipped, half-width N tiles,
two CTAs per SM, one pipeline stage more, programmatic dependent launch), each with its largest difference from the
pick's output: an edit that wins is the candidate a per-shape override would ship.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.common import ints
from bench.random_models import QWEN25_SHAPES

_L2_SPAN = 160e6  # bytes of weight copies cycled per graph: a few times the H100/H200 L2 (50-60 MB)
_LAUNCHES = 24


def shapes(size: str) -> dict[str, tuple[int, int]]:
    hidden, inter, _, heads, kv, _ = QWEN25_SHAPES[size]
    head_dim = hidden // heads
    return {"qkv": (hidden + 2 * kv * head_dim, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def graph_us(launch, copies: int) -> float:
    """Mean microseconds per launch of `launch(i)` (i cycles over the copies) replayed as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(copies):
            launch(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(_LAUNCHES):
            launch(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * _LAUNCHES)


def copy_bandwidth() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * 10 * a.numel() / (time.perf_counter() - t)


def heuristic_config(weight, m: int) -> dict:
    """The config humming's heuristics pick for M rows of this weight (the interval holding M)."""
    from qerl.quant.kernels import humming_fp4

    intervals = humming_fp4._humming()["heuristics"](weight.config, device=torch.device("cuda"))
    return dict(humming_fp4.config_at(intervals, m))


def variants(cfg: dict) -> dict[str, dict]:
    """One-field edits of a humming config; illegal ones fail at compile time and are reported, not timed."""
    out = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flip = cfg | {"use_stream_k": not cfg.get("use_stream_k", True)}  # humming's TuningConfig default: on
    if flip["use_stream_k"]:
        flip["num_sms"] = cfg.get("num_sms") or sms
    out["stream_k" if flip["use_stream_k"] else "no_stream_k"] = flip
    bm, bn, bk = cfg["block_shape"]
    wm, wn, wk = cfg["warp_shape"]
    if bn >= 128:
        out["block_n/2"] = cfg | {"block_shape": (bm, bn // 2, bk), "warp_shape": (wm, min(wn, bn // 2), wk)}
        out["block_n/2+stream_k"] = out["block_n/2"] | {"use_stream_k": True, "num_sms": cfg.get("num_sms") or sms}
    if not cfg.get("use_pdl", False):
        out["pdl"] = cfg | {"use_pdl": True}
    if cfg.get("num_ctas_per_sm", 1) == 1:
        out["2 ctas/sm"] = cfg | {"num_ctas_per_sm": 2}
    if cfg.get("num_stages", 4) < 8:
        out["stages+1"] = cfg | {"num_stages": cfg.get("num_stages", 4) + 1}
    return out


def launcher(weights, row, x, y):
    """launch(i): the kernel of table row `row` over weight copy i, x -> y (what graph_us replays)."""
    from humming.ops.launcher import launch_kernel

    def launch(i):
        t = weights[i].tensors
        launch_kernel(configs=row, inputs=x, weight=t["weight"], weight_scale=t.get("weight_scale"),
                      weight_scale_2=t.get("weight_scale_2"), outputs=y, locks=weights[i].locks)
    return launch


def time_variants(name, weights, layer, x, y, copies, m) -> dict:
    """Each edit of the heuristic's pick at M, compiled alone (an illegal edit costs only itself), timed."""
    from humming.kernel.humming import HummingKernel

    base = heuristic_config(weights[0], m)
    out = {"heuristic_config": base, "variants": {}}
    edits = variants(base)
    try:  # one call compiles them in parallel; one illegal edit fails it, then each is compiled alone
        rows = list(HummingKernel.prepare_kernels(layer.to_str(), None, [(0, 1 << 30, c) for c in edits.values()],
                                                  device=torch.device("cuda")).reshape(-1, 4))
    except Exception:  # noqa: BLE001
        rows = [None] * len(edits)
    for (label, cfg), row in zip(edits.items(), rows):
        try:
            if row is None:
                row = HummingKernel.prepare_kernels(layer.to_str(), None, [(0, 1 << 30, cfg)],
                                                    device=torch.device("cuda")).reshape(-1, 4)[0]
            launch = launcher(weights, row, x, y)
            us = graph_us(launch, copies)
            ref = torch.empty_like(y)
            weights[0].run(x, ref)
            launch(0)
            err_rel = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
        except Exception as err:  # noqa: BLE001 - an edit humming rejects or that does not run at this M
            print(f"  {name} M={m} {label}: {type(err).__name__}: {str(err)[:100]}", flush=True)
            continue
        out["variants"][label] = {"us": us, "config": cfg, "max_rel_diff_vs_pick": err_rel}
    return out


def tune_shape(name, n, k, rows, samples, bandwidth, edits=False) -> dict:
    from humming.config import ComputeConfig, GemmType
    from humming.kernel.humming import HummingKernel
    from humming.testing.tuning import sample_test_tuning_configs

    from qerl.quant.dispatch import HUMMING_TABLE_ROWS
    from qerl.quant.kernels import humming_fp4

    fp4_bytes = n * k // 2 + n * k // 16
    copies = max(1, min(16, int(_L2_SPAN // fp4_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = []
    for _ in range(copies):
        wp = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        ws = (torch.rand(n, k // 16, device="cuda", generator=gen) + 0.5).to(torch.float8_e4m3fn)
        gs = torch.tensor([448.0 * 6], device="cuda")
        weights.append(humming_fp4.HummingWeight(wp, ws, gs, (n,), torch.bfloat16, HUMMING_TABLE_ROWS))
    layer = weights[0].config
    cands = (sample_test_tuning_configs(layer, ComputeConfig(gemm_type=GemmType.DENSE), sample_size=samples)
             if samples else [])
    t = time.perf_counter()
    table = (HummingKernel.prepare_kernels(layer.to_str(), None,
                                           [(0, 1 << 30, c | {"use_batch_invariant": False}) for c in cands],
                                           device=torch.device("cuda")).reshape(-1, 4) if cands else [])
    compile_s = time.perf_counter() - t
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
             for _ in range(max(1, min(4, int(_L2_SPAN // (2 * n * k)))))]
    out = {"shape": [n, k], "copies": copies, "candidates": len(cands), "compile_s": compile_s, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        heuristic = graph_us(lambda i: weights[i].run(x, y), copies)
        bf16 = graph_us(lambda i: torch.matmul(x, dense[i].T, out=y), len(dense))
        timed = []
        for j, row in enumerate(table):
            try:
                timed.append((graph_us(launcher(weights, row, x, y), copies), j))
            except Exception as err:  # noqa: BLE001 - a sampled config that does not run at this M
                timed.append((float("inf"), j))
                print(f"  {name} M={m} candidate {j}: {type(err).__name__}: {str(err)[:120]}", flush=True)
        best_us, best_j = min(timed, default=(float("inf"), None))
        floor_us = fp4_bytes / bandwidth * 1e6
        out["rows"][m] = {"heuristic_us": heuristic, "best_sampled_us": best_us,
                          "best_config": cands[best_j] if best_j is not None else None,
                          "bf16_us": bf16, "floor_us": floor_us}
        print(f"{name:8s} M={m:4d}  heuristic {heuristic:7.1f} us  best sampled {best_us:7.1f} us  bf16 "
              f"{bf16:7.1f} us  fp4 floor {floor_us:6.1f} us  heuristic/floor x{heuristic / floor_us:.2f}  "
              f"bf16/heuristic x{bf16 / heuristic:.2f}", flush=True)
        if edits:
            found = time_variants(name, weights, layer, x, y, copies, m)
            out["rows"][m].update(found)
            print(f"  heuristic pick: {found['heuristic_config']}", flush=True)
            for label, v in sorted(found["variants"].items(), key=lambda kv: kv[1]["us"]):
                print(f"  {label:20s} {v['us']:7.1f} us  x{heuristic / v['us']:.2f} the pick's speed  "
                      f"max |diff| / max |y| {v['max_rel_diff_vs_pick']:.1e}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.humming_tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="7B", choices=list(QWEN25_SHAPES))
    p.add_argument("--rows", type=ints, default=[16, 32, 64, 128])
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--layers", default="qkv,o,gate_up,down")
    p.add_argument("--variants", action="store_true", help="also time one-field edits of the heuristic's pick")
    p.add_argument("--out", default="results/bench/humming_tune.json")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    payload = {"device": torch.cuda.get_device_name(), "bandwidth_bytes_s": bandwidth, "args": vars(args),
               "layers": {}}
    for name in args.layers.split(","):
        n, k = shapes(args.size)[name]
        payload["layers"][name] = tune_shape(name, n, k, args.rows, args.samples, bandwidth,
                                              args.variants)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".tmp").write_text(json.dumps(payload, indent=2, default=str) + "\n")
        os.replace(out.with_suffix(".tmp"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
