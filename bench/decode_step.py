"""One PagedEngine decode step, taken apart: wall time per step, its graph's GPU time alone, the host's share, the
kernels inside the graph by kind, and the floor (weights + live KV over the measured copy bandwidth).

    python -m bench.decode_step --experiment qwen7b --modes fp4,bf16 --rows 1,16,32,64,128,256 \
        --out results/bench/decode_step.json
    python -m bench.decode_step --modes fp4 --rows 32,64 --variants 'base;QERL_LORA_OVERLAP=0'   # A/B, one call
    python -m bench.decode_step --lora-rank 0    # no adapters: what the step would cost if LoRA were free

For each mode (the trainer's random model: FP4 or bf16 + LoRA r of the recipe) and each row count R, R prompts of
--prompt-len tokens decode --tokens tokens each (no row ends early: every decode step has R rows) through the
recipe's paged engine and sampling, with max_tokens the recipe's max_completion_length (--max-tokens), so the block
table is as wide as in a rollout (the split of the attention depends on it; rows end after --tokens as if at EOS),
three times: two calls compile and capture the buckets, the third is timed
(the engine's own per-step clock, host included). Then the bucket's captured graph is replayed alone (CUDA events:
the GPU's time per step) and once under torch.profiler (kernels per step, grouped by kind). host = wall - GPU: the
part of a step the GPU waits for the host (staging, scheduler, the device-to-host read of the sampled tokens).
Prints a table, writes JSON atomically.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.kernels import env_var

# kernel-name fragments of each kind (first match wins; the rest is "other")
KINDS = (
    ("norm_rope_act", r"^triton_"),  # inductor's fused kernels (compiled decode), whatever ops their names list
    ("fp4_matmul", r"fp4|humming|marlin|gemv_kernel"),
    ("dense_gemm", r"gemm|cutlass|xmma|nvjet|splitk|sm90|sm80|cublas"),
    ("attention", r"paged|attn|attention|_combine"),  # _combine*: the merge of split attention's partials
    ("sampling", r"softmax|scan|cumsum|sort|topk|search|argmax|bucketize"),
    ("elementwise", r"elementwise|vectorized|unrolled|pow|rsqrt|silu|mul|add"),
    ("reduction", r"reduce"),
    ("copy_index", r"copy|cat|index|gather|scatter|fill"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="config/config.yaml")
    p.add_argument("--experiment", default="qwen7b")
    p.add_argument("--modes", default="fp4,bf16")
    p.add_argument("--size", default=None, help="random model size (default: the experiment's model_size)")
    p.add_argument("--rows", default="1,16,32,64,128,256")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=40, help="tokens each row decodes per call")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="sampling max_tokens, which sizes the block table (default: the recipe's max_completion_length)")
    p.add_argument("--compile", default="off", choices=("off", "auto"))
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=12, help="kernels listed per (mode, rows)")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="LoRA rank of the model (default: the recipe's; 0: no adapters, the ceiling of LoRA fusion)")
    p.add_argument("--variants", default="",
                   help="A/B in one call: ';'-separated settings, each 'base' or NAME=VALUE[,NAME=VALUE] environment "
                        "variables set while every mode runs again (e.g. 'base;QERL_LORA_OVERLAP=0')")
    p.add_argument("--out", default="results/bench/decode_step.json")
    return p.parse_args(argv)


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    """'base;A=1,B=0' -> [("base", {}), ("A=1,B=0", {"A": "1", "B": "0"})]; empty text: the one base variant."""
    out = []
    for part in (p.strip() for p in (text or "base").split(";")):
        env = {}
        for item in ([] if part in ("", "base") else part.split(",")):
            name, eq, value = item.strip().partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise SystemExit(f"--variants: expected base or NAME=VALUE items, got {item.strip()!r}")
            env[name] = value
        out.append((part or "base", env))
    return out


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """These environment variables set for the block (the kernel switches read them at launch), then restored."""
    with contextlib.ExitStack() as stack:
        for name, value in env.items():
            stack.enter_context(env_var(name, value))
        yield


def _graph_ms(graph, replays: int) -> float:
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _profile(graph, replays: int, top: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    by_kind: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_kind.setdefault(kind_of(e.key), [0.0, 0.0])
        entry[0] += e.count / replays
        entry[1] += e.self_device_time_total / replays
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {"kernels_per_step": sum(e.count for e in kernels) / replays,
            "kernel_us_per_step": sum(e.self_device_time_total for e in kernels) / replays,
            "by_kind": {k: {"count": round(c, 1), "us": round(us, 1)} for k, (c, us) in
                        sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
            "top": [{"name": e.key[:100], "kind": kind_of(e.key), "count": round(e.count / replays, 1),
                     "us": round(e.self_device_time_total / replays, 1)} for e in kernels[:top]]}


def _host_profile(engine, prompts, sampling, top: int) -> list:
    """One more call under cProfile: the host functions taking the most time of their own (the device-to-host
    read of the sampled tokens shows as the wait of the step's GPU work)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, n=1, sampling=sampling)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{Path(f).name}:{line}:{name}", round(tt * 1e3, 1), calls) for (f, line, name), (_, calls, tt, _, _)
            in rows]


def run_mode(args, mode: str, train_cfg, size: str, bandwidth: float) -> list[dict]:
    from transformers import AutoTokenizer

    from bench.e2e_workers import random_prompts
    from bench.grpo_step import _kv_bytes_per_position
    from bench.paged import ForcedLengthEngine, build_lora_model
    from bench.random_models import decode_weight_bytes
    from qerl.rollout import SamplingParams
    from qerl.trainer import engine_options

    shared = Path(os.environ.get("QERL_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    tok = AutoTokenizer.from_pretrained(shared / "tokenizers" / "qwen2.5")
    rank = train_cfg.lora.lora_r if args.lora_rank is None else args.lora_rank
    if rank > 0:
        model = build_lora_model(size, mode, rank, args.seed, "cuda")
    else:  # the base alone, as the engine runs a merged checkpoint
        from bench.random_models import build_random_model, qwen25_config

        model = build_random_model(qwen25_config(size), fp4=mode == "fp4", device="cuda", dtype=torch.bfloat16,
                                   seed=args.seed)
    options = dict(engine_options(train_cfg.model_copy(update={"rollout": train_cfg.rollout.model_copy(
        update={"engine": "paged", "compile": "auto" if args.compile == "auto" else False})})),
                   plain_projections=True)  # as an evaluation: a model without adapters stacks its projections
    engine = ForcedLengthEngine(model, tok, eos_token_ids=(), **options)
    r = train_cfg.rollout
    weights, per_pos = decode_weight_bytes(model), _kv_bytes_per_position(model)
    rows_out = []
    for rows in [int(x) for x in args.rows.split(",")]:
        prompts = random_prompts(tok, rows, args.prompt_len, args.seed + rows)
        engine.lengths = [args.tokens] * rows
        sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_tokens=max(args.tokens, args.max_tokens or train_cfg.max_completion_length),
                                  seed=args.seed)
        start = time.perf_counter()
        engine.generate(prompts, n=1, sampling=sampling)  # compiles this bucket's step and runs it eagerly
        engine.generate(prompts, n=1, sampling=sampling)  # captures it (and the buckets a call meets once)
        warm_s = time.perf_counter() - start
        torch.cuda.synchronize()
        key = engine._graphs.key if engine._graphs is not None else None
        out = engine.generate(prompts, n=1, sampling=sampling)
        if engine._graphs is not None and key is not None and engine._graphs.key != key:
            changed = [i for i, (a, b) in enumerate(zip(key, engine._graphs.key)) if a != b]
            print(f"    graphs rebuilt between calls: key fields {changed} changed", flush=True)
        st = out.stats
        steps = sum(v for k, v in st.items() if k.startswith("steps_decode"))
        wall_ms = 1e3 * sum(v for k, v in st.items() if k.startswith("step_s_decode")) / max(1, steps)
        graphs = engine._graphs
        size_b = graphs.bucket(rows)
        graph = graphs.graphs.get(size_b)
        gpu_ms = _graph_ms(graph, args.replays) if graph is not None else float("nan")
        prof = _profile(graph, 10, args.top) if graph is not None else {}
        host = _host_profile(engine, prompts, sampling, args.top)
        live = rows * (args.prompt_len + args.tokens / 2)
        floor_ms = 1e3 * (weights + live * per_pos) / bandwidth
        row = dict(mode=mode, rows=rows, bucket=size_b, decode_steps=steps, wall_ms=wall_ms, gpu_ms=gpu_ms,
                   host_ms=wall_ms - gpu_ms, floor_ms=floor_ms, wall_x_floor=wall_ms / floor_ms,
                   gpu_x_floor=gpu_ms / floor_ms, warm_s=warm_s, humming_gib=st.get("humming_bytes", 0) / 2**30,
                   dense_copy_gib=st.get("dense_copy_bytes", 0) / 2**30,
                   graph_replays=st.get("graph_replays"), graph_eager_steps=st.get("graph_eager_steps"),
                   graph_captures=st.get("graph_captures"), host_top=host, **prof)
        rows_out.append(row)
        print(f"{mode} rows {rows}: wall {wall_ms:.2f} ms/step, graph {gpu_ms:.2f} ms, floor {floor_ms:.2f} ms, "
              f"{prof.get('kernels_per_step', 0):.0f} kernels; by kind {prof.get('by_kind')}", flush=True)
        print(f"    graph replays {st.get('graph_replays')}, eager {st.get('graph_eager_steps')}, captures "
              f"{st.get('graph_captures')}; host (cProfile, one more call): {host}", flush=True)
        for k in prof.get("top", []):
            print(f"    {k['us']:8.1f} us  x{k['count']:<6} {k['kind']:<14} {k['name']}", flush=True)
    engine.close()
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return rows_out


def markdown(result: dict) -> str:
    lines = [f"Decode step anatomy, {result['device']} ({result['experiment']}, {result['size']}, "
             f"compile {result['compile']}, copy bandwidth {result['copy_GBps']:.0f} GB/s)", "",
             "| mode | rows | wall ms | graph ms | host ms | floor ms | wall x floor | graph x floor | kernels |"
             " top kinds (us) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        kinds = ", ".join(f"{k} {v['us']:.0f}" for k, v in list(r.get("by_kind", {}).items())[:4])
        lines.append(f"| {r['mode']} | {r['rows']} | {r['wall_ms']:.2f} | {r['gpu_ms']:.2f} | {r['host_ms']:.2f} | "
                     f"{r['floor_ms']:.2f} | {r['wall_x_floor']:.2f} | {r['gpu_x_floor']:.2f} | "
                     f"{r.get('kernels_per_step', 0):.0f} | {kinds} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from bench.grpo_step import measure_ceilings, recipe

    args = _parse(argv)
    variants = parse_variants(args.variants)  # a bad one ends here, before any model is built
    args.prompts = args.completion_cap = args.num_iterations = 0  # the recipe as it is (bench.grpo_step.recipe)
    args.optim = ""
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_step: needs a CUDA GPU")
    train_cfg, size = recipe(args)
    bandwidth, _ = measure_ceilings("cuda")
    rows = []
    for name, env in variants:
        for mode in args.modes.split(","):
            with environment(env):
                found = run_mode(args, mode, train_cfg, size, bandwidth)
            rows += [dict(r, mode=r["mode"] if len(variants) == 1 else f"{r['mode']} [{name}]", variant=name)
                     for r in found]
            # the finished mode's engine, graphs and model sit in reference cycles: collected here, after run_mode's
            # locals are gone, or the next mode's KV pool is sized without their memory
            gc.collect()
            torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), experiment=args.experiment, size=size, compile=args.compile,
                  lora_rank=args.lora_rank,
                  copy_GBps=bandwidth / 1e9, prompt_len=args.prompt_len, tokens=args.tokens,
                  variants=[name for name, _ in variants], rows=rows)
    table = markdown(result)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as f:
        json.dump(result, f, indent=1)
    os.replace(f.name, out)
    out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
