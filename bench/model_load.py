"""Loading a full-parameter model onto N ranks (train.mode full, FSDP2): seconds and peak host memory per rank.

    python -m bench.model_load --size 7B --ranks 4 --out results/bench/model_load.json   # 4 GPUs, repository root

Writes a random bf16 Qwen2.5-<size> checkpoint with the real tokenizer (--model DIR loads one instead), then loads
it on --ranks ranks (torchrun) as the train stage does, up to a sharded model: qerl.train's model set-up, the
trainer's forward swaps (qerl.fsdp.fuse_as_rank0) and FSDP2 sharding (qerl.fsdp.data_parallel), once per way:
  rank0   rank 0 reads the checkpoint, the others build the model on the meta device and receive their shards
          (the train stage's way)
  every   every rank reads the whole checkpoint before sharding (the way before rank0, for comparison)
Per rank: load seconds (its own; the way's time is the slowest rank's), peak host RSS grown during the load
(ru_maxrss, measured after the imports and a first tokenizer load), the RSS after it (anonymous / file-backed)
and peak allocated GPU memory. A checkpoint from_pretrained reads is memory-mapped: its pages count in the RSS
of every process that touched them, once in the node's page cache; a dtype conversion makes a private copy.
Prints a table, writes JSON; each way's output goes to <out stem>-<way>.log.

CPU smoke run (gloo; tests/bench/test_model_load_bench.py): python -m bench.model_load --size tiny --ranks 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

WAYS = ("rank0", "every")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="7B", help="7B | 14B | 32B | tiny (CPU smoke runs): the random checkpoint")
    p.add_argument("--model", help="a dense checkpoint to load instead of a random one")
    p.add_argument("--ranks", type=int, default=4, help="ranks of one node (GPUs; CPU processes under gloo)")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}")
    p.add_argument("--timeout-s", type=float, default=540, help="per way")
    p.add_argument("--tokenizer", default="../shared/tokenizers/qwen2.5", help="the real Qwen2.5 tokenizer dir")
    p.add_argument("--out", default="results/bench/model_load.json")
    p.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _rss_now_mib() -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB now: a mapped checkpoint's pages are the second kind (Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return tuple(float(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))
    except (OSError, KeyError, ValueError):
        return 0.0, 0.0


def _load(way: str, model_dir: str, cfg, ranks):
    """The model sharded over the ranks, loaded one way (the trainer's steps up to data_parallel)."""
    from qerl.fsdp import data_parallel, fuse_as_rank0
    from qerl.fused_elementwise import fuse_elementwise
    from qerl.policy import load_policy
    from qerl.train import _setup_model

    if way == "rank0":
        model, _ = _setup_model(cfg, model_dir, ranks)
        fuse_as_rank0(model, cfg, ranks)
    else:
        model, _ = load_policy(model_dir, mode="full", dtype=getattr(torch, cfg.dtype), device="cpu",
                               gradient_checkpointing=True)
        fuse_elementwise(model)  # each rank probes its own whole model
    return data_parallel(model, cfg, ranks)


def run_way(args) -> None:
    """The --worker way in this process group; rank 0 writes every rank's figures to --worker-out."""
    from transformers import AutoTokenizer

    from qerl.config import parse_section
    from qerl.distributed import close, init_ranks

    ranks = init_ranks(args.ranks)
    try:
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        cfg = parse_section("train", {"data": {"source": "bench"}, "mode": "full", "dtype": dtype,
                                      "num_gpus": args.ranks, "gradient_checkpointing": True})
        AutoTokenizer.from_pretrained(args.model)  # its transient peak before the baseline (the stage loads it too)
        ranks.barrier()
        before, start = _peak_rss_mib(), time.perf_counter()
        parallel = _load(args.worker, args.model, cfg, ranks)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        mine = torch.tensor([[seconds, _peak_rss_mib() - before, _peak_rss_mib(), *_rss_now_mib(), gpu]],
                            dtype=torch.float64)
        every = ranks.all_gather(mine)
        size = sum(p.numel() * p.element_size() for p in parallel.rollout_model.parameters()) / 2**20
        if ranks.is_main:
            keys = ("load_s", "rss_growth_mib", "rss_peak_mib", "rss_anon_mib", "rss_file_mib", "gpu_peak_gib")
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
            result = {"way": args.worker, "ranks": ranks.world_size, "device": device, "model_mib": round(size, 1),
                      **{k: [round(float(x), 2) for x in every[:, i]] for i, k in enumerate(keys)}}
            result["slowest_s"] = max(result["load_s"])
            Path(args.worker_out).write_text(json.dumps(result))
        ranks.barrier()
    finally:
        close(ranks)


def _checkpoint(args, root: Path) -> str:
    """--model, or a random bf16 checkpoint of --size with the real tokenizer written under root."""
    if args.model:
        return args.model
    from transformers import AutoTokenizer

    from bench.random_models import build_random_model

    out = root / f"random-{args.size}"
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    build_random_model(args.size, fp4=False, device="cpu", dtype=dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(out)
    return str(out)


def _table(results: list[dict]) -> str:
    lines = [f"{'way':6s} {'ranks':>5s} {'slowest s':>9s}  per rank: load s / peak RSS grown MiB / GPU GiB"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['way']:6s} failed: {r['error'][:100]}")
            continue
        per = ", ".join(f"{s:.1f}/{m:.0f}/{g:.1f}" for s, m, g in
                        zip(r["load_s"], r["rss_growth_mib"], r["gpu_peak_gib"]))
        lines.append(f"{r['way']:6s} {r['ranks']:5d} {r['slowest_s']:9.1f}  {per}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    if args.worker:
        run_way(args)
        return 0
    from bench.distributed import _run_case_process

    ways = [w for w in args.ways.split(",") if w]
    if unknown := [w for w in ways if w not in WAYS]:
        raise SystemExit(f"--ways: unknown {unknown}; expected some of {list(WAYS)}")
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qerl-bench-load-") as tmp:
        model = _checkpoint(args, Path(tmp))
        for way in ways:
            part = Path(tmp) / f"{way}.json"
            # only the worker's own options on torchrun's line: it reads abbreviations of its options anywhere
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(args.ranks), "-m", "bench.model_load", "--ranks", str(args.ranks), "--model", model,
                   "--worker", way, "--worker-out", str(part)]
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            failed = _run_case_process(cmd, env, args.timeout_s, part, out.with_name(f"{out.stem}-{way}.log"))
            results.append({"way": way, "error": failed} if failed else json.loads(part.read_text()))
            print(f"{way}: " + (f"failed ({failed})" if failed else f"slowest rank {results[-1]['slowest_s']:.1f} s"),
                  flush=True)
    # the orchestrator never initialises CUDA (its context would take a GPU's memory): the workers name it
    payload = {"device": ", ".join(sorted({r["device"] for r in results if "device" in r})) or "unknown",
               "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
               "results": results}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(_table(results))
    print(f"-> {out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
