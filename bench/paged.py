"""Rollout tokens/s: PagedEngine (continuous batching, paged KV, CUDA-graph decode buckets) vs TorchEngine (static
cache + CUDA graphs + torch.compile) on a random Qwen2.5-shaped bf16 model, with completion lengths of RL rollouts.

    python -m bench.paged --size 0.5B --prompts 32 --n 8 --max-tokens 1024 --out results/bench/paged.json

Completion lengths are drawn once from a fixed log-normal (median --median, sigma --sigma, capped at --max-tokens)
per row. Random weights never emit EOS, so each row's end is forced at its drawn length, the same draws for both
engines: PagedEngine ends row r after lengths[r] tokens (an EOS forced by this benchmark; its blocks free and
waiting rows take its place); TorchEngine's static batch decodes every row until the longest ends whatever EOS says,
so it runs max(lengths) steps with EOS ignored - the same work as with forced EOS. tokens/s counts the drawn
(useful) tokens of both. Each engine runs the workload once untimed (compilation, graph captures), then timed.
A second workload, --fixed (the earlier measurement: 16 prompts x 4 x 128 tokens, all rows full length), is run too.

--modes fp4,bf16: the trainer's models instead of the plain bf16 one, one after the other (each freed before the
next): random FP4 (FP4Linear) or bf16 weights + peft LoRA r --lora-r on all 7 projections, built as bench.e2e_workers
builds them for the e2e benchmark; the same draws for both; the table adds the FP4/bf16 ratio of tokens/s and peak.
--warmup-tokens N: the untimed run's rows end after at most N tokens, staggered so that the running rows fall
through every decode bucket to one (warmup_lengths: its kernels compiled, its graph captured), with the same rows and
max_tokens; the timed run still captures its own graphs (a new KV pool each call; counted in graph_captures).
Prints a table and writes JSON atomically.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from qerl.rollout import SamplingParams
from qerl.rollout.paged_engine import PagedEngine
from qerl.rollout.torch_engine import TorchEngine

# Qwen2.5 shapes not in bench.random_models (hidden, intermediate, layers, heads, kv heads; tied embeddings)
SMALL_SHAPES = {"0.5B": (896, 4864, 24, 14, 2), "1.5B": (1536, 8960, 28, 12, 2)}


class ForcedLengthEngine(PagedEngine):
    """PagedEngine whose row r ends after lengths[r] tokens (finish reason "stop"), as if it had sampled EOS."""

    lengths: list[int] = []
    progress_s: float = 0.0  # > 0: print the tokens done so far this often (a call cut short still says how far)

    def generate(self, prompts, n=1, sampling=None):
        self._started = self._last_report = time.perf_counter()
        return super().generate(prompts, n, sampling)

    def _steps(self, sched, pool, sampling, uniforms, graphs):
        for out in super()._steps(sched, pool, sampling, uniforms, graphs):
            yield out
            self._report(sched)

    def _report(self, sched) -> None:
        now = time.perf_counter()
        if self.progress_s > 0 and now - self._last_report >= self.progress_s:
            self._last_report = now
            done = sum(len(s.output) for s in sched.seqs)
            finished = sum(s.finish_reason is not None for s in sched.seqs)
            elapsed = now - self._started
            print(f"  rollout {elapsed:.0f} s: {done:,} tokens ({done / elapsed:,.0f}/s), {finished}/"
                  f"{len(sched.seqs)} rows finished, {sched.stats.get('preemptions', 0)} preemptions", flush=True)

    def _finish_reasons(self, seqs, tokens, sampling):
        return end_at_lengths(super()._finish_reasons(seqs, tokens, sampling), seqs, self.lengths)


def end_at_lengths(reasons: list, seqs, lengths: list[int]) -> list:
    """The engine's finish reasons of a step, with "stop" for each running row whose token of this step is its
    lengths[row]-th: it ends there as if it had sampled EOS."""
    return ["stop" if r is None and len(s.output) + 1 >= lengths[s.row] else r for s, r in zip(seqs, reasons)]


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="0.5B", help="0.5B | 1.5B | 7B | 14B (random weights, bf16, dense)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--median", type=float, default=400.0, help="median completion length of the log-normal")
    p.add_argument("--sigma", type=float, default=0.6, help="sigma of log(length)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--engines", default="paged,static",
                   help="comma list of: paged, paged-nc (not compiled), static, static-nc (not compiled)")
    p.add_argument("--static-chunk", type=int, default=0, help="rows per static-engine batch, whole prompt groups "
                   "(0: all rows in one batch; the static cache holds every row at full length)")
    p.add_argument("--no-fixed", action="store_true", help="skip the 16 x 4 x 128 fixed-length workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="", help="comma list of fp4, bf16: random weights + LoRA "
                   "(default: bf16 without LoRA)")
    p.add_argument("--mode", dest="modes", help="one of fp4, bf16 (as --modes)")
    p.add_argument("--lora-r", type=int, default=32, help="LoRA rank of --modes models (alpha = 2 r)")
    p.add_argument("--warmup-tokens", type=int, default=0, help="untimed run's rows end after at most this many "
                   "tokens (0: the whole workload)")
    p.add_argument("--out", default="results/bench/paged.json")
    return p.parse_args(argv)


def build_model(size: str, device: str):
    from bench.random_models import build_random_model, qwen25_config

    if size in SMALL_SHAPES:
        hidden, inter, layers, heads, kv = SMALL_SHAPES[size]
        config = qwen25_config("7B", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True)
    else:
        config = size
    return build_random_model(config, fp4=False, device=device, dtype=torch.bfloat16)


def build_lora_model(size: str, mode: str, lora_r: int, seed: int, device: str):
    """bench.e2e_workers' model of the e2e benchmark: random FP4 or bf16 Qwen2.5 + peft LoRA on all 7 projections
    (gradient checkpointing on, fused LoRA training path), as the trainer holds it between updates."""
    from bench.random_models import attach_lora, build_random_model, qwen25_config

    if mode not in ("fp4", "bf16"):
        raise SystemExit(f"--modes: expected fp4 and/or bf16, got {mode!r}")
    model = build_random_model(qwen25_config(size), fp4=mode == "fp4", device=device, dtype=torch.bfloat16, seed=seed)
    return attach_lora(model, r=lora_r, alpha=2 * lora_r, fp4=mode == "fp4", gradient_checkpointing=True, fused=True)


def draw_lengths(rows: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """Completion lengths ~ round(exp(N(log median, sigma))), clipped to [1, cap]; fixed by the seed."""
    z = np.random.default_rng(seed).standard_normal(rows)
    return np.clip(np.round(median * np.exp(sigma * z)), 1, cap).astype(int).tolist()


def warmup_lengths(rows: int, tokens: int) -> list[int]:
    """Lengths (1..tokens, the longest = tokens) for an untimed run whose running rows fall through every decode
    batch-size bucket of `rows` rows (qerl.rollout.paged_graphs.bucket_sizes), each held for an equal share of the
    tokens - 1 decode steps (2+ when tokens allow: the step that compiles it, then the one that captures it), so the
    timed run meets no new bucket: the kernels' tile configs differ by rows and compile on first use (seconds each).
    The largest bucket runs with all the rows: a prefill with every row is not a decode step of that bucket."""
    from qerl.rollout.paged_graphs import bucket_sizes

    if rows <= 0:
        return []
    counts = sorted({min(b, rows) for b in bucket_sizes(rows)}, reverse=True)  # one running count per bucket
    steps = max(tokens - 1, 0)
    share = [steps // len(counts) + (i < steps % len(counts)) for i in range(len(counts))]
    running = [c for c, s in zip(counts, share) for _ in range(s)]  # rows decoding at decode step 1, 2, ...
    return [1 + sum(c > i for c in running) for i in range(rows)]


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 150000), (count, length), generator=gen).tolist()


def _timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def run_paged(model, tok, prompts, n, lengths, args, compile="auto") -> dict:
    engine = ForcedLengthEngine(model, tok, block_size=args.block_size, eos_token_ids=(), compile=compile)
    sampling = SamplingParams(temperature=1.0, max_tokens=max(lengths), seed=args.seed)
    engine.lengths = warmup_lengths(len(lengths), args.warmup_tokens) if args.warmup_tokens else lengths
    warm_start = time.perf_counter()
    engine.generate(prompts, n, sampling)
    warm = time.perf_counter() - warm_start
    engine.lengths = lengths
    wall, out = _timed(lambda: engine.generate(prompts, n, sampling))
    got = [len(c) for c in out.completion_ids]
    assert got == lengths, "PagedEngine rows did not end at their drawn lengths"
    keep = ("steps", "preemptions", "peak_running", "peak_blocks", "num_blocks", "graph_captures", "graph_replays",
            "graph_eager_steps", "projection_groups")
    stats = {k: v for k, v in out.stats.items() if k in keep or k.startswith(("step_s_", "steps_", "dense_"))}
    engine.close()
    return dict(engine="paged" if compile else "paged-nc", wall_s=wall, warmup_s=warm, generated_tokens=sum(got),
                **stats,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def run_static(model, tok, prompts, n, lengths, args, compile="auto") -> dict:
    """The static engine (one KV cache for the batch, CUDA graphs; torch.compile unless compile=False), over
    chunks of --static-chunk rows (whole prompt groups) one after the other where the whole batch would not fit:
    each chunk decodes until its longest row's drawn length. Each chunk is warmed up untimed first."""
    engine = TorchEngine(model, tok, eos_token_ids=(), compile=compile)
    per = max(1, (args.static_chunk or len(lengths)) // n)  # prompts per chunk
    wall = warm = 0.0
    generated = steps = 0
    for start in range(0, len(prompts), per):
        chunk = prompts[start:start + per]
        longest = max(lengths[start * n:(start + len(chunk)) * n])
        sampling = SamplingParams(temperature=1.0, max_tokens=longest, seed=args.seed)
        warm_start = time.perf_counter()
        engine.warm_up(chunk, n, sampling)
        warm += time.perf_counter() - warm_start
        seconds, out = _timed(lambda: engine.generate(chunk, n, sampling))
        wall += seconds
        generated += sum(len(c) for c in out.completion_ids)
        steps += longest
    engine.close()
    return dict(engine="static" if compile else "static-nc", wall_s=wall, warmup_s=warm, generated_tokens=generated,
                steps=steps, static_chunk_rows=per * n, peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def run_workload(name, model, tok, prompts, n, lengths, args) -> list[dict]:
    runners = {"paged": run_paged, "static": run_static,
               "paged-nc": lambda *a: run_paged(*a, compile=False),
               "static-nc": lambda *a: run_static(*a, compile=False)}
    rows = []
    for engine in args.engines.split(","):
        result = runners[engine](model, tok, prompts, n, lengths, args)
        result.update(workload=name, rows=len(lengths), useful_tokens=sum(lengths),
                      tok_s=sum(lengths) / result["wall_s"])
        rows.append(result)
        print(f"  {name:10s} {engine:7s} {result['wall_s']:8.2f} s  {result['tok_s']:10,.0f} tok/s  "
              f"(warm-up {result['warmup_s']:.1f} s)", flush=True)
    return rows


def _table(rows) -> str:
    head = f"{'model':9s} {'workload':10s} {'engine':7s} {'rows':>5s} {'useful tok':>10s} {'computed':>9s} " \
           f"{'wall s':>7s} " \
           f"{'tok/s':>9s} {'steps':>6s} {'peak GiB':>8s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.get('model', 'bf16'):9s} {r['workload']:10s} {r['engine']:7s} {r['rows']:5d} "
                     f"{r['useful_tokens']:10d} "
                     f"{r['generated_tokens']:9d} {r['wall_s']:7.2f} {r['tok_s']:9,.0f} {r['steps']:6d} "
                     f"{r['peak_gib']:8.2f}")
    return "\n".join(lines + _ratios(rows))


def _ratios(rows) -> list[str]:
    """FP4/bf16 ratios of tokens/s and peak memory per workload and engine, where both models ran."""
    by = {(r.get("model"), r["workload"], r["engine"]): r for r in rows}
    out = []
    for (model, workload, engine), fp4 in by.items():
        bf16 = by.get(("bf16+lora", workload, engine))
        if model == "fp4+lora" and bf16:
            out.append(f"FP4/bf16 ({workload}, {engine}): tokens/s x{fp4['tok_s'] / bf16['tok_s']:.2f}, "
                       f"peak GiB x{fp4['peak_gib'] / bf16['peak_gib']:.2f}")
    return out


def main(argv=None) -> int:
    args = _parse(argv)
    from transformers import AutoTokenizer

    shared = Path(os.environ.get("QERL_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    tok = AutoTokenizer.from_pretrained(shared / "tokenizers" / "qwen2.5")
    lengths = draw_lengths(args.prompts * args.n, args.median, args.sigma, args.max_tokens, args.seed)
    modes = [m for m in args.modes.split(",") if m] or [None]
    results = []
    for mode in modes:
        results += _run_model(args, mode, tok, lengths)
        print(_table(results), flush=True)
        _write(args, lengths, results)  # after each model: a run cut short keeps what it measured
    return 0


def _run_model(args, mode, tok, lengths) -> list[dict]:
    """Both workloads on one model, which is freed afterwards."""
    import gc

    model = build_model(args.size, "cuda") if mode is None else build_lora_model(args.size, mode, args.lora_r,
                                                                                 args.seed, "cuda")
    name = "bf16" if mode is None else f"{mode}+lora"
    vocab = model.config.vocab_size
    print(f"{torch.cuda.get_device_name()}: random Qwen2.5-{args.size} {name}; completion lengths log-normal "
          f"(median {args.median:.0f}, sigma {args.sigma}, cap {args.max_tokens}): mean {np.mean(lengths):.0f}, "
          f"max {max(lengths)}; each row's end forced at its drawn length (random weights never emit EOS)",
          flush=True)
    results = run_workload("lognormal", model, tok, random_prompts(args.prompts, args.prompt_len, vocab, args.seed),
                           args.n, lengths, args)
    if not args.no_fixed:
        results += run_workload("fixed128", model, tok, random_prompts(16, 128, vocab, args.seed + 1), 4,
                                [128] * 64, args)
    for r in results:
        r["model"] = name
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _write(args, lengths, results) -> None:
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
               "lengths": lengths, "note": "rows end at their drawn lengths (forced EOS for paged; the static "
               "batch runs to the longest row); tok_s = drawn tokens / wall", "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    raise SystemExit(main())
