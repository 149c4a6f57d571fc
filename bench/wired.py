"""The engine's stacked decode layer on qerl.quant.kernels.cuda_fp4, the few-row CUDA kernel (<= 8 rows on Hopper).

    python -m bench.wired --models 7B --rows 1,8 --lora-rank 32 --out results/bench/wired.json   # a CUDA GPU

Per decoder-layer shape as the engine runs it (q|k|v and gate|up stacked): the kernel's chosen (cluster, warps),
every other candidate with warps in --warps, the Triton kernel and bf16 torch.matmul, all in one process; and the
whole run_fp4_matmul call with bias and a rank --lora-rank LoRA (x @ A.T included) on either kernel. Every
timed configuration is first checked against the float64 reference. `python -m bench.suite` runs it and compares
the layer's total with bf16 (BENCHMARKS.md, "Kernels").
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qerl.quant.kernels import cuda_fp4

LAYER_SHAPES = {  # (layer, N, K, stacked segments along N)
    "7B": [("q|k|v", 4608, 3584, (3584, 512, 512)), ("o", 3584, 3584, (3584,)),
           ("gate|up", 37888, 3584, (18944, 18944)), ("down", 3584, 18944, (3584,))],
    "32B": [("q|k|v", 7168, 5120, (5120, 1024, 1024)), ("o", 5120, 5120, (5120,)),
            ("gate|up", 55296, 5120, (27648, 27648)), ("down", 5120, 27648, (5120,))]}


def run_wired(models: list[str], rows_m: list[int], warps_list: list[int], lora_rank: int = 16) -> dict:
    """qerl.quant.kernels.cuda_fp4 (the wired-in kernel) per decoder-layer shape: its chosen (cluster, warps), every
    other candidate with warps in `warps_list`, the Triton kernel and bf16 torch.matmul, all in one process; and the
    whole run_fp4_matmul call with bias and a rank-`lora_rank` LoRA (x @ A.T included) on either kernel."""
    from bench.kernels import _copies, _environment, _fp4_weights, env_var, fp4_reference, graph_time_us
    from bench.kernels import measure_ceilings
    from qerl.quant.dispatch import run_fp4_matmul

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
                       "triton_us": graph_time_us(lambda i: run_fp4_matmul(x, *fp4[i], kernel="triton"),
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
                for mode, kernel in (("triton", "triton"), ("cuda", None)):  # LoRA + bias, the whole call
                    with env_var("QERL_FP4_CUDA", "1"):
                        row[f"lora_{mode}_us"] = graph_time_us(
                            lambda i, kernel=kernel: run_fp4_matmul(
                                x, fp4[i][0], fp4[i][1], gs, bias, lora_a, lora_b, 0.5,
                                segments=list(segments), kernel=kernel), len(fp4))
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/bench/wired.json"))
    p.add_argument("--rows", default="1,8")
    p.add_argument("--warps", default="4", help="candidate (cluster, warps) timed besides the chosen one")
    p.add_argument("--models", default="7B", help=", ".join(LAYER_SHAPES))
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA columns")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.wired needs a CUDA GPU")
    from bench.kernels import publish

    result = run_wired(a.models.split(","), [int(v) for v in a.rows.split(",")],
                       [int(v) for v in a.warps.split(",")], lora_rank=a.lora_rank)
    publish(result, wired_markdown(result), a.out)


if __name__ == "__main__":
    main()
