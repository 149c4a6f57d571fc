"""Rollout throughput: the torch engine vs transformers' generate on the same model and prompts.

    python -m bench.rollout --model resources/smollm2-135m-instruct --batch 8 --n 8 \
        --prompt-len 64 --new-tokens 64 --out results/bench/rollout.json

Both engines sample (temperature 1, no top-k/top-p, the RL setting) len(prompts) * n rows of exactly
--new-tokens tokens (EOS ignored), so tokens/s compares the same work. Prints a table and writes JSON
atomically (tmp file + os.replace) so a killed run never leaves a truncated result.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from qerl.errors import QerlError
from bench.common import sync


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (with tokenizer)")
    p.add_argument("--batch", type=int, default=8, help="number of prompts")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16")
    p.add_argument("--engines", default="torch,hf", help="comma list of: torch, hf, vllm (needs qerl[vllm])")
    p.add_argument("--cache", default="auto", help="torch engine KV cache: auto | dynamic | static")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine (best is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench/rollout.json")
    return p.parse_args(argv)


def _setup_model(args):
    """Load model + tokenizer on the requested device and precision."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(args.model, "config.json").exists():
        raise QerlError(f"--model: expected an HF model directory with config.json, got {args.model}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype_name = ("bfloat16" if device == "cuda" else "float32") if args.dtype == "auto" else args.dtype
    if dtype_name not in ("float32", "bfloat16", "float16"):
        raise QerlError(f"--dtype: expected float32, bfloat16 or float16, got {dtype_name}")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype_name)).to(device)
    return model.eval(), tok, device, dtype_name


def _prompts(tok, batch: int, length: int, seed: int) -> list[list[int]]:
    """Random ordinary-token prompts of one length (deterministic per seed)."""
    gen = torch.Generator().manual_seed(seed)
    special = set(tok.all_special_ids)
    ids = torch.randint(0, min(len(tok), 30000), (batch * length * 2,), generator=gen).tolist()
    ids = [t for t in ids if t not in special][: batch * length]
    return [ids[i * length:(i + 1) * length] for i in range(batch)]


def _qerl_runner(name: str, model, tok, args):
    """generate() of a qerl engine built once (so caches and compiled graphs persist across runs)."""
    from qerl.rollout import SamplingParams, make_engine

    if name == "torch":  # no EOS: every row has exactly new_tokens tokens
        engine = make_engine("torch", model, tok, cache=args.cache, eos_token_ids=())
    else:
        engine = make_engine("vllm", model, tok, model_path=args.model, ignore_eos=True,
                             dtype=str(model.dtype).removeprefix("torch."), gpu_memory_utilization=0.5)

    def run(prompts, new_tokens: int) -> int:
        sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=args.seed)
        return engine.generate(prompts, n=args.n, sampling=sampling).num_tokens

    return run


def _hf_runner(model, tok, args):
    """transformers' generate: each prompt expanded n times before its prefill."""
    tok.padding_side = "left"
    if tok.pad_token is None:  # e.g. SmolLM2: any id works, the padded positions are masked
        tok.pad_token = tok.eos_token

    def run(prompts, new_tokens: int) -> int:
        enc = tok.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
        torch.manual_seed(args.seed)
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 num_return_sequences=args.n, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
        return (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]

    return run


def _timed(run, prompts, new_tokens: int) -> tuple[float, int]:
    sync()
    start = time.perf_counter()
    tokens = run(prompts, new_tokens)
    sync()
    return time.perf_counter() - start, tokens


def _measure(model, tok, prompts, args) -> list[dict]:
    """Warm up each engine, then keep the best of --repeats timed runs.

    On CUDA the warm-up is the full run (it compiles and captures the decode graph; its time is
    reported as first_seconds); on CPU a 4-token run is enough to fault in weights and allocators.
    """
    rows = []
    for name in args.engines.split(","):
        if name not in ("torch", "hf", "vllm"):
            raise QerlError(f"--engines: expected a comma list of torch, hf, vllm; got {name!r}")
        run = _hf_runner(model, tok, args) if name == "hf" else _qerl_runner(name, model, tok, args)
        if model.device.type == "cuda":
            first, _ = _timed(run, prompts, args.new_tokens)
        else:
            first, _ = _timed(run, prompts[:1], 4)
        seconds, tokens = min(_timed(run, prompts, args.new_tokens) for _ in range(args.repeats))
        rows.append({"engine": name, "seconds": round(seconds, 3), "tokens": tokens,
                     "tokens_per_s": round(tokens / seconds, 1), "first_seconds": round(first, 3)})
    return rows


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = _parse(argv)
    model, tok, device, dtype_name = _setup_model(args)
    prompts = _prompts(tok, args.batch, args.prompt_len, args.seed)
    rows = _measure(model, tok, prompts, args)
    where = torch.cuda.get_device_name() if device == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    print(f"model {args.model} | device {where} | {dtype_name} | prompts {args.batch} x n {args.n} | "
          f"prompt {args.prompt_len} | new {args.new_tokens}")
    print(f"{'engine':<8}{'seconds':>10}{'tokens':>10}{'tokens/s':>12}")
    for r in rows:
        print(f"{r['engine']:<8}{r['seconds']:>10.2f}{r['tokens']:>10d}{r['tokens_per_s']:>12.1f}")
    payload = {"model": str(args.model), "device": where, "dtype": dtype_name, "batch": args.batch,
               "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "cache": args.cache, "torch": torch.__version__, "python": platform.python_version(),
               "results": rows}
    _write_json(Path(args.out), payload)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except QerlError as err:  # a user mistake: one line, exit 2 (as the stage CLIs)
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
