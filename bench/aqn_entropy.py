"""Does AQN raise the rollout policy's entropy? Mean token entropy of sampled rollouts per noise level.

    python -m bench.aqn_entropy --model results/demo/quantized --data resources/demo_task/train.jsonl \
        --template answer_line --sigmas 0 1e-2 5e-2 --seeds 0 1 2 --out results/bench/aqn_entropy.json

For each sigma and seed: fresh AQN noise on the RMSNorm scales, sample n completions per prompt with the torch
engine, then compute the exact entropy of the (noisy) policy at every generated position (qerl.grpo's chunked
log-probs, under the same noise). The paper's claim: quantization noise (and AQN on top) raises entropy, which
helps exploration.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qerl.io import atomic_write_json


def rollout_entropy(model, tokenizer, prompts: list[list[int]], *, sigma: float, seed: int, n: int,
                    temperature: float, max_tokens: int) -> float:
    """Mean entropy (nats) over all generated tokens of one noisy rollout batch."""
    from qerl.aqn import aqn_noise
    from qerl.grpo import masked_mean, token_logprobs
    from qerl.rollout import SamplingParams
    from qerl.rollout.torch_engine import TorchEngine
    from qerl.trainer import pad_rollout

    engine = TorchEngine(model, tokenizer)
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    with aqn_noise(model, sigma, torch.Generator().manual_seed(10_000 + seed)), torch.no_grad():
        out = engine.generate(prompts, n=n, sampling=sampling)
        ids, attn, rollout_lp = pad_rollout(out, tokenizer.pad_token_id or 0)
        clen = rollout_lp.shape[1]
        _, ent = token_logprobs(model, ids, attn, clen, temperature=temperature)
    return float(masked_mean(ent, attn[:, -clen:]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.aqn_entropy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--template", default="answer_line")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 1e-2, 5e-2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="results/bench/aqn_entropy.json")
    a = p.parse_args(argv)

    from qerl.data import encode_prompts, load_records
    from qerl.evaluate import load_for_eval

    model, tok = load_for_eval(a.model, "auto")
    records = load_records(a.data, limit=a.prompts)
    prompts = encode_prompts(tok, [r["question"] for r in records], a.template)
    rows = []
    for sigma in a.sigmas:
        t0 = time.perf_counter()
        values = [rollout_entropy(model, tok, prompts, sigma=sigma, seed=s, n=a.n, temperature=a.temperature,
                                  max_tokens=a.max_tokens) for s in a.seeds]
        rows.append({"sigma": sigma, "entropy_mean": statistics.mean(values),
                     "entropy_stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
                     "per_seed": values, "seconds": time.perf_counter() - t0})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"AQN rollout entropy, {a.model} on {device}, {a.prompts} prompts x {a.n} samples, T={a.temperature}")
    print("| sigma | mean token entropy (nats) | stdev over seeds | seeds |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['sigma']:g} | {r['entropy_mean']:.4f} | {r['entropy_stdev']:.4f} | {len(a.seeds)} |")
    atomic_write_json(a.out, {"model": a.model, "device": device, "args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
