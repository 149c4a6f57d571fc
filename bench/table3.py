"""The paper's Table 3 measured: per experiment, model size, rollout tokens/s and the GRPO step time, one GPU.

    python -m bench.table3 --experiments qwen7b-bf16-lora,qwen7b-nf4-lora,qwen7b-nvfp4-lora   # config/config.yaml
    python -m bench.table3 --size 7B --method qerl --out results/bench/qwen7b-nvfp4-lora.json  # no config
    snakemake --cores 1 --resources gpu=1 results/bench/qwen7b-nvfp4-lora.json                # the rule

Writes results/bench/<experiment>.json, the file qerl.tables reads for Table 3 (then `snakemake
results/tables/table3.md` shows ours beside the paper's): model_size_gb (decimal GB, as the paper), rollout_tokens_per_s
{"2", "8"} (the paper's Tables 5-8: batch = rows, 256-token prompts, completions up to 2,048) and e2e_step_seconds
{"2", "4", "8"} (Table 3: batch = prompts x G = 8 completions, same lengths, the mean of --steps steps after a
warm-up, one GPU), plus the device, what weights ran, the completion-length law and every part's detail. The
JSON is rewritten after every part, so a run stopped at its budget keeps what it measured.

An experiment's weights: its quantize stage's output (results/<experiment>/quantized) when present, else its base
model when that is a local directory or in the HF cache (BF16 and NF4 rows), else random weights of the real
Qwen2.5 shapes (sizes 3B, 7B, 14B, 32B; `tiny` for CPU tests). Random weights never sample EOS: rows end at
lengths drawn from a log-normal (median --median, sigma --sigma, capped at --max-completion), the same draws for
every method; bench.table3_worker says how. Rollouts (and the GRPO steps' rollouts) run on --engine: paged (the
default, what the recipes train with: paged KV cache, continuous batching, captured decode buckets) or torch (a
static KV cache and one CUDA graph per batch, the engine of the tables before the paged one); --compile auto (the
default: each decoder layer torch.compile'd, as a training run does) or off, the same for every method.
--jobs N runs N experiments at once (each its own process; set-up side by side, every timed part alone on the GPU
through bench.gpu_lock). Parts missing after such a pass (two 14B workers do not fit one 80 GB card), or after a
worker died, are measured once more, alone, in a fresh process, and merged into the JSON (`retried_alone` names them).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.kernels import write_json
from bench.table3_worker import LOST, METHODS, measure, part_names
from qerl.errors import QerlError
from bench.common import add_workload_args, ints

ENGINES = {"paged": "paged (paged KV cache, continuous batching, CUDA-graph decode buckets)",
           "torch": "torch (static KV cache, CUDA graphs)"}
MODE_METHODS = {"lora": "lora", "qlora_nf4": "qlora", "qlora_fp4": "qerl"}  # train.mode -> Table 3 method


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.table3", description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--experiments", help="comma list of experiments of --config (Table 3 rows)")
    what.add_argument("--size", help="3B | 7B | 14B | 32B | tiny, with --method (no config)")
    p.add_argument("--method", choices=sorted(METHODS), help="lora (BF16), qlora (NF4), qerl (NVFP4)")
    p.add_argument("--name", help="experiment name recorded with --size (default: <size>-<method>)")
    p.add_argument("--checkpoint", help="with --size: the experiment's quantize output, used when it exists")
    p.add_argument("--model", help="with --size: the base model, used for lora/qlora when local or cached")
    p.add_argument("--out", help="with --size: the JSON to write (default: <out-dir>/<name>.json)")
    p.add_argument("--config", default="config/config.yaml")
    p.add_argument("--out-dir", help="default: <config results_dir>/bench, or results/bench")
    p.add_argument("--tokenizer", default="../shared/tokenizers/qwen2.5", help="the Qwen2.5 tokenizer (random weights)")
    p.add_argument("--device", default="auto")
    p.add_argument("--rollout-batches", type=ints, default=[2, 8], help="rows of the rollout figure")
    p.add_argument("--e2e-batches", type=ints, default=[2, 4, 8], help="prompts per GRPO step")
    add_workload_args(p, prompt_len=256, micro_batch=8, lora_help="LoRA rank (alpha = 2 r); an experiment's own wins")
    p.add_argument("--max-completion", type=int, default=2048, help="completion cap (max_tokens)")
    p.add_argument("--steps", type=int, default=2, help="timed GRPO steps per batch, after the warm-up")
    p.add_argument("--engine", choices=sorted(ENGINES), default="paged", help="the rollout engine (module doc)")
    p.add_argument("--compile", choices=["auto", "off"], default="auto", help="torch.compile of the decode step")
    p.add_argument("--jobs", type=int, default=1, help="experiments measured at once (processes)")
    p.add_argument("--budget-s", type=float, default=None, help="workers still running then are stopped")
    p.add_argument("--in-process", action="store_true", help="no worker processes (CPU tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge", action="store_true", help=argparse.SUPPRESS)  # keep the JSON's other parts
    p.add_argument("--gpu-lock", help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.size and not args.method:
        p.error("--size needs --method")
    if not (args.size or args.experiments or args.worker_spec):
        p.error("give --experiments or --size/--method")
    return args


# ------------------------------------------------------------------------------------------ what to measure
def _local_model(ref: str | None, revision: str | None = None) -> str | None:
    """The base model's directory when it is local or already in the HF cache (never downloaded), else None."""
    if not ref:
        return None
    if Path(ref).is_dir():
        return ref
    from qerl.hub import resolve_model

    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        return str(resolve_model(ref, revision))
    except Exception:  # noqa: BLE001 - not cached (or no hub client here): random weights instead
        return None
    finally:
        os.environ.pop("HF_HUB_OFFLINE") if old is None else os.environ.__setitem__("HF_HUB_OFFLINE", old)


def _weights(method: str, checkpoint: str | None, model: str | None, revision: str | None = None) -> str | None:
    """The checkpoint to measure: the quantize stage's output, else the base model (BF16 / NF4-on-load rows)."""
    if checkpoint and Path(checkpoint, "config.json").is_file():
        return checkpoint
    return _local_model(model, revision) if method != "qerl" else None


def specs_from_config(names: list[str], config_path: str, out_dir: str | None) -> list[dict]:
    from qerl.config import load_config
    from qerl.paths import Layout

    cfg = load_config(config_path)
    layout = Layout(cfg.results_dir)
    specs = []
    for name in names:
        if name not in cfg.experiments:
            raise QerlError(f"--experiments: {name!r} is not an experiment of {config_path}")
        exp = cfg.experiments[name]
        method = MODE_METHODS.get(exp.train.mode)
        if method is None or exp.quantize.scheme == "mxfp4" or not exp.model_size:
            raise QerlError(f"experiment {name}: not a Table 3 row (train.mode {exp.train.mode}, quantize.scheme "
                            f"{exp.quantize.scheme}, model_size {exp.model_size}); Table 3 has BF16 LoRA, NF4 "
                            f"QLoRA and NVFP4 LoRA of a sized model")
        out = Path(out_dir) / f"{name}.json" if out_dir else layout.bench_json(name)
        specs.append({"name": name, "size": exp.model_size.upper(), "method": method, "out": str(out),
                      "lora_r": exp.train.lora.lora_r,
                      "checkpoint": _weights(method, str(layout.quantized(name)), exp.model, exp.model_revision)})
    return specs


def _specs(args) -> list[dict]:
    if args.experiments:
        return specs_from_config([n.strip() for n in args.experiments.split(",") if n.strip()], args.config,
                                 args.out_dir)
    name = args.name or f"{args.size}-{args.method}"
    out = args.out or str(Path(args.out_dir or "results/bench") / f"{name}.json")
    return [{"name": name, "size": args.size if args.size == "tiny" else args.size.upper(), "method": args.method,
             "out": out, "lora_r": None, "checkpoint": _weights(args.method, args.checkpoint, args.model)}]


# ------------------------------------------------------------------------------------------ running
def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version()}
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        env["bitsandbytes"] = None
    env["device"] = (torch.cuda.get_device_name() if torch.cuda.is_available()
                     else f"cpu x{torch.get_num_threads()} threads")
    return env


def protocol(args) -> dict:
    """The measurement's settings, stored in every JSON (the table's caption reads them)."""
    return {"prompt_len": args.prompt_len, "max_completion_length": args.max_completion, "num_generations": args.group,
            "micro_batch_size": args.micro_batch, "rollout_batches": args.rollout_batches,
            "e2e_batches": args.e2e_batches, "timed_steps": args.steps, "engine": ENGINES[args.engine],
            "compile": args.compile, "lengths": {
                "law": "log-normal", "median": args.median, "sigma": args.sigma, "cap": args.max_completion,
                "why": "random weights never sample EOS: each row ends at its drawn length, as if it sampled EOS "
                       "there (a checkpoint's EOS is ignored the same way); the same draws for every method"},
            "warm_up": "per batch: the engine's compile/graph capture of that shape, one full-length update"}


def _run_one(spec: dict, args) -> dict:
    """Measure in this process, writing the spec's JSON after every part (--merge: into the JSON already there)."""
    out = Path(spec["out"])
    previous = json.loads(out.read_text()) if args.merge and out.is_file() else None
    head = {**environment(), "protocol": protocol(args)}
    if previous:  # the protocol covers every part the JSON holds; the retried ones are named
        for key in ("rollout_batches", "e2e_batches"):
            head["protocol"][key] = sorted({*previous.get("protocol", {}).get(key, []), *head["protocol"][key]})
        head["retried_alone"] = [*previous.get("retried_alone", []),
                                 *part_names(args.rollout_batches, args.e2e_batches)]

    def save(result: dict) -> None:
        write_json(out, {**head, **result})

    result = measure(spec, args, on_part=save, previous=previous)
    save(result)
    return {**head, **result}


def _worker_argv(args, spec: dict, lock: Path) -> list[str]:
    argv = [sys.executable, "-m", "bench.table3", "--worker-spec", json.dumps(spec), "--gpu-lock", str(lock)]
    for key in ("tokenizer", "device", "group", "prompt_len", "max_completion", "median", "sigma", "steps",
                "micro_batch", "lora_r", "engine", "compile", "seed"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    for key in ("rollout_batches", "e2e_batches"):
        argv += [f"--{key.replace('_', '-')}", ",".join(map(str, getattr(args, key)))]
    return argv + (["--merge"] if args.merge else [])


def missing_parts(path: Path, args) -> tuple[list[int], list[int]]:
    """(rollout batches, e2e batches) of args that the JSON at path has no figure for (all without a JSON)."""
    doc = json.loads(path.read_text()) if path.is_file() else {}
    return ([r for r in args.rollout_batches if str(r) not in doc.get("rollout_tokens_per_s", {})],
            [b for b in args.e2e_batches if str(b) not in doc.get("e2e_step_seconds", {})])


def retry_plan(specs: list[dict], args, exit_codes: dict[str, int | None]) -> list[tuple[dict, list, list]]:
    """Experiments to measure once more, alone, in a fresh process, and which parts: those with parts missing after
    a pass that ran several at once (another worker's memory may have been the cause), or whose worker died (a
    CUDA error leaves its process unusable, not the next one)."""
    plan = []
    for spec in specs:
        if args.jobs > 1 or exit_codes.get(spec["name"]) not in (0, None):
            rollout, e2e = missing_parts(Path(spec["out"]), args)
            if rollout or e2e:
                plan.append((spec, rollout, e2e))
    return plan


def _run_workers(specs: list[dict], args, deadline: float) -> dict[str, int | None]:
    """`--jobs` worker processes at a time, one per experiment; all stopped at the deadline. Returns each started
    experiment's exit code."""
    codes: dict[str, int | None] = {}
    lock = Path(specs[0]["out"]).parent / "table3.gpu.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    pending, running = list(specs), []
    while pending or running:
        while pending and len(running) < max(1, args.jobs) and time.perf_counter() < deadline:
            spec = pending.pop(0)
            print(f"[table3] start {spec['name']} ({spec['size']} {spec['method']})", flush=True)
            running.append((spec, subprocess.Popen(_worker_argv(args, spec, lock))))
        if not running:
            print(f"[table3] budget spent; not started: {', '.join(s['name'] for s in pending)}", flush=True)
            break
        time.sleep(1.0)
        for spec, proc in list(running):
            if proc.poll() is None and time.perf_counter() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
                print(f"[table3] {spec['name']}: stopped at the budget (its JSON keeps what it measured)", flush=True)
            proc.wait()
            running.remove((spec, proc))
            codes[spec["name"]] = proc.returncode
            print(f"[table3] done {spec['name']}: exit {proc.returncode}", flush=True)
    return codes


def summary(paths: list[Path]) -> str:
    """One Markdown line per JSON: size, rollout tokens/s, step seconds."""
    lines = ["| experiment | device | weights | size GB | rollout tok/s | step s (prompts) | errors |",
             "|---|---|---|---|---|---|---|"]
    for path in paths:
        if not path.is_file():
            lines.append(f"| {path.stem} | - | - | - | - | - | no JSON |")
            continue
        d = json.loads(path.read_text())
        tps = ", ".join(f"{v:,.0f} (bs{k})" for k, v in d.get("rollout_tokens_per_s", {}).items())
        steps = ", ".join(f"{v:.1f} ({k})" for k, v in d.get("e2e_step_seconds", {}).items())
        lines.append(f"| {d['experiment']} | {d['device']} | {d.get('weights', '?')} | {d.get('model_size_gb')} | "
                     f"{tps} | {steps} | {'; '.join(d.get('errors', {})) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.worker_spec:  # exit 1 when the CUDA context was lost: the driver retries the missing parts
        return 1 if _run_one(json.loads(args.worker_spec), args).get(LOST) else 0
    try:
        specs = _specs(args)
    except QerlError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if any(s["checkpoint"] is None for s in specs) and not Path(args.tokenizer, "tokenizer_config.json").exists():
        print(f"error: --tokenizer: random weights need the Qwen2.5 tokenizer directory, got {args.tokenizer}",
              file=sys.stderr)
        return 2
    if args.in_process:
        for spec in specs:
            _run_one(spec, args)
    else:
        deadline = time.perf_counter() + (args.budget_s or float("inf"))
        codes = _run_workers(specs, args, deadline)
        for spec, rollout, e2e in retry_plan(specs, args, codes):
            if time.perf_counter() >= deadline:
                print("[table3] budget spent: no retries", flush=True)
                break
            print(f"[table3] {spec['name']}: {', '.join(part_names(rollout, e2e))} again, alone (failed or not run "
                  f"{'beside other workers' if args.jobs > 1 else 'before its worker died'})", flush=True)
            alone = argparse.Namespace(**{**vars(args), "rollout_batches": rollout, "e2e_batches": e2e,
                                          "merge": True, "jobs": 1})
            _run_workers([spec], alone, deadline)
    print(summary([Path(s["out"]) for s in specs]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
