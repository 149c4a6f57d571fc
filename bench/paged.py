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

    def _finish_reasons(self, seqs, tokens, sampling):
        reasons = super()._finish_reasons(seqs, tokens, sampling)
        return ["stop" if r is None and len(s.output) + 1 >= self.lengths[s.row] else r
                for s, r in zip(seqs, reasons)]


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
    p.add_argument("--engines", default="paged,static", help="comma list of: paged, paged-nc (not compiled), static")
    p.add_argument("--no-fixed", action="store_true", help="skip the 16 x 4 x 128 fixed-length workload")
    p.add_argument("--seed", type=int, default=0)
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


def draw_lengths(rows: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """Completion lengths ~ round(exp(N(log median, sigma))), clipped to [1, cap]; fixed by the seed."""
    z = np.random.default_rng(seed).standard_normal(rows)
    return np.clip(np.round(median * np.exp(sigma * z)), 1, cap).astype(int).tolist()


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
    engine.lengths = lengths
    sampling = SamplingParams(temperature=1.0, max_tokens=max(lengths), seed=args.seed)
    warm_start = time.perf_counter()
    engine.generate(prompts, n, sampling)
    warm = time.perf_counter() - warm_start
    wall, out = _timed(lambda: engine.generate(prompts, n, sampling))
    got = [len(c) for c in out.completion_ids]
    assert got == lengths, "PagedEngine rows did not end at their drawn lengths"
    stats = {k: out.stats[k] for k in ("steps", "preemptions", "peak_running", "peak_blocks", "num_blocks",
                                       "graph_captures", "graph_replays", "graph_eager_steps") if k in out.stats}
    engine.close()
    return dict(engine="paged" if compile else "paged-nc", wall_s=wall, warmup_s=warm, generated_tokens=sum(got), **stats,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def run_static(model, tok, prompts, n, lengths, args) -> dict:
    engine = TorchEngine(model, tok, eos_token_ids=())  # static cache, CUDA graphs, torch.compile ("auto")
    sampling = SamplingParams(temperature=1.0, max_tokens=max(lengths), seed=args.seed)
    warm_start = time.perf_counter()
    engine.warm_up(prompts, n, sampling)
    warm = time.perf_counter() - warm_start
    wall, out = _timed(lambda: engine.generate(prompts, n, sampling))
    engine.close()
    return dict(engine="static", wall_s=wall, warmup_s=warm, generated_tokens=sum(len(c) for c in out.completion_ids),
                steps=max(lengths), peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def run_workload(name, model, tok, prompts, n, lengths, args) -> list[dict]:
    runners = {"paged": run_paged, "static": run_static,
               "paged-nc": lambda *a: run_paged(*a, compile=False)}
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
    head = f"{'workload':10s} {'engine':7s} {'rows':>5s} {'useful tok':>10s} {'computed':>9s} {'wall s':>7s} " \
           f"{'tok/s':>9s} {'steps':>6s} {'peak GiB':>8s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['workload']:10s} {r['engine']:7s} {r['rows']:5d} {r['useful_tokens']:10d} "
                     f"{r['generated_tokens']:9d} {r['wall_s']:7.2f} {r['tok_s']:9,.0f} {r['steps']:6d} "
                     f"{r['peak_gib']:8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    from transformers import AutoTokenizer

    shared = Path(os.environ.get("QERL_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    tok = AutoTokenizer.from_pretrained(shared / "tokenizers" / "qwen2.5")
    model = build_model(args.size, "cuda")
    vocab = model.config.vocab_size
    rows_total = args.prompts * args.n
    lengths = draw_lengths(rows_total, args.median, args.sigma, args.max_tokens, args.seed)
    print(f"{torch.cuda.get_device_name()}: random Qwen2.5-{args.size} bf16; completion lengths log-normal "
          f"(median {args.median:.0f}, sigma {args.sigma}, cap {args.max_tokens}): mean {np.mean(lengths):.0f}, "
          f"max {max(lengths)}; each row's end forced at its drawn length (random weights never emit EOS)",
          flush=True)
    results = run_workload("lognormal", model, tok, random_prompts(args.prompts, args.prompt_len, vocab, args.seed),
                           args.n, lengths, args)
    if not args.no_fixed:
        results += run_workload("fixed128", model, tok, random_prompts(16, 128, vocab, args.seed + 1), 4,
                                [128] * 64, args)
    print(_table(results))
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
               "lengths": lengths, "note": "rows end at their drawn lengths (forced EOS for paged; the static "
               "batch runs to the longest row); tok_s = drawn tokens / wall", "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
