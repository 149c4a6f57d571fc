"""End-to-end GPU benchmark: rollout tokens/s, one GRPO step and peak training memory, FP4 vs bf16 LoRA.

    python -m bench.e2e --out-dir results/bench          # on a CUDA machine, from the repository root

Random weights of the real Qwen2.5 shapes (bench.random_models; FP4 models never hold a bf16 copy):
  (b) TorchEngine rollout, 7B, batches 8 and 64, 256 prompt + 1024 new tokens, FP4 vs bf16 (+ HF generate);
  (c) one GRPO step (8 prompts x G = 8) through qerl.trainer.GRPOTrainer with gradient checkpointing;
  (d) peak allocated memory of one GRPO update (micro-batch 8 x (256 + 2048) tokens), 7B/14B/32B FP4, 7B bf16.
Every model runs in its own subprocess (own allocator peak, a crash or timeout loses only that part). The copy
bandwidth and bf16 matmul rate are measured first and give each figure's floor. Writes e2e.json atomically
under --out-dir and prints a Markdown table.

--gpu-lock PATH (bench.gpu_lock; `python -m bench.suite` passes one): the speed workers run at the same
time, their set-up (weights, compilation, graph capture, warm-up update) side by side and each timed part alone on
the GPU; the memory workers run beside them, --memory-jobs at a time, in the order given (largest first keeps the
GPU's memory for the speed workers' later, larger parts). --budget-s: every worker is stopped by then, and the
report holds what each had measured.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench.e2e_workers import memory_worker, speed_worker
from bench.gpu_lock import GpuLock
from bench.e2e_report import add_floors, markdown
from bench.kernels import write_json
from qerl.errors import QerlError
from bench.common import add_workload_args, ints


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="results/bench")
    p.add_argument("--parts-dir", default=None, help="per-worker JSON (default: <out-dir>/e2e_parts)")
    p.add_argument("--tokenizer", default="../shared/tokenizers/qwen2.5", help="the real Qwen2.5 tokenizer dir")
    p.add_argument("--device", default="auto")
    p.add_argument("--speed-size", default="7B")
    p.add_argument("--speed-modes", default="fp4,bf16")
    p.add_argument("--memory", default="7B:fp4,14B:fp4,32B:fp4,7B:bf16",
                   help="size:mode[:micro_batch[:offload[:mlp_chunks]]] list for (d) (offload: the word 'offload' "
                        "or empty; mlp_chunks: default --mlp-chunks)")
    p.add_argument("--batches", type=ints, default=[8, 64], help="rollout rows for (b)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per GRPO step")
    add_workload_args(p, prompt_len=256, micro_batch=8, lengths=False)
    p.add_argument("--new-tokens", type=int, default=1024, help="generated tokens per row in (b)")
    p.add_argument("--step-completion", type=int, default=2048, help="completion tokens of the (c) step")
    p.add_argument("--memory-completion", type=int, default=2048, help="completion tokens in (d)")
    p.add_argument("--hf-tokens", type=int, default=64, help="new tokens of the HF generate baseline (0: skip)")
    p.add_argument("--memory-jobs", type=int, default=1, help="memory workers run at once (peaks are per process)")
    p.add_argument("--timeout-s", type=float, default=300, help="per worker subprocess")
    p.add_argument("--budget-s", type=float, default=None, help="the whole run: workers still running by then stop")
    p.add_argument("--gpu-lock", default=None,
                   help="lock file shared with other benchmark processes: set-up beside them, timed parts alone")
    p.add_argument("--cuda-graph", choices=["auto", "off"], default="auto", help="TorchEngine decode graphs")
    p.add_argument("--compile", choices=["auto", "off"], default="auto", help="torch.compile of the decode forward")
    p.add_argument("--fuse-projections", choices=["auto", "off", "all"], default="auto",
                   help="q/k/v and gate/up stacked into one launch during rollouts (qerl.quant.grouped): auto = "
                        "the engine's default (FP4 and bf16 LoRA layers on CUDA), all = both kinds on any device")
    p.add_argument("--logprob-chunk", type=int, default=None,
                   help="train.logprob_chunk_size of the trainer (default: the config's)")
    p.add_argument("--mlp-chunks", type=int, default=1, help="train.mlp_chunks of the trainer (qerl.tiled_mlp)")
    p.add_argument("--profile-tokens", type=int, default=0,
                   help="also profile one rollout of this many tokens at the first batch (kernels per step)")
    p.add_argument("--fused-lora", choices=["on", "off"], default="on",
                   help="LoRA layers train as one autograd node each (qerl.fused_lora), or through peft's own ops")
    p.add_argument("--fused-elementwise", choices=["on", "off"], default="on",
                   help="RMSNorm, SiLU(gate) * up and the log-prob head of the update as compiled kernels "
                        "(qerl.fused_elementwise, train.fused_elementwise), or eager ops")
    p.add_argument("--profile-update", action="store_true",
                   help="(c) then one more step, its whole update under torch.profiler (kernels, GPU idle time)")
    p.add_argument("--out-name", default="e2e.json")
    p.add_argument("--in-process", action="store_true", help="run workers in this process (CPU smoke tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=["speed", "memory"], help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _worker_argv(args, kind: str, spec: str, out: Path) -> list[str]:
    """This process's options, forwarded to a worker subprocess."""
    keep = {k: v for k, v in vars(args).items() if k not in ("worker", "worker_spec", "worker_out", "in_process")}
    argv = [sys.executable, "-m", "bench.e2e"]
    for key, value in keep.items():
        if value is None or value is False:
            continue
        if value is True:  # a flag
            argv.append(f"--{key.replace('_', '-')}")
            continue
        value = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        argv += [f"--{key.replace('_', '-')}", value]
    return argv + ["--worker", kind, "--worker-spec", spec, "--worker-out", str(out)]


def _run_in_process(args, kind: str, spec: str, on_part=None) -> dict:
    size, mode, *extra = spec.split(":")
    start = time.perf_counter()
    if kind == "speed":
        result = speed_worker(args, mode, size, on_part)
    else:  # size:mode[:micro_batch[:offload[:mlp_chunks]]]
        result = memory_worker(args, mode, size, micro_batch=int(extra[0]) if extra and extra[0] else None,
                               offload=len(extra) > 1 and extra[1] == "offload",
                               mlp_chunks=int(extra[2]) if len(extra) > 2 else None)
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    return result


def _start(args, kind: str, spec: str, parts: Path):
    out = parts / f"{kind}_{spec.replace(':', '_')}.json"
    out.unlink(missing_ok=True)
    print(f"[e2e] start {kind} {spec}", flush=True)
    return kind, spec, out, time.perf_counter(), subprocess.Popen(_worker_argv(args, kind, spec, out))


def _finish(job, timeout: float, deadline: float) -> dict:
    kind, spec, out, start, proc = job
    try:
        proc.wait(timeout=max(1.0, min(timeout - (time.perf_counter() - start), deadline - time.perf_counter())))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    wall = round(time.perf_counter() - start, 1)
    print(f"[e2e] done {kind} {spec}: rc {proc.returncode}, {wall} s", flush=True)
    if out.exists():
        return json.loads(out.read_text())
    size, mode = spec.split(":")[:2]
    return {"mode": mode, "size": size, "errors": {"worker": f"exit code {proc.returncode} after {wall} s "
                                                             f"(timeout {timeout} s), no result"}}


def _run_workers(args, kind: str, specs: list[str], jobs: int, parts: Path, deadline: float) -> list[dict]:
    """Run workers `jobs` at a time (subprocesses), or all in this process with --in-process."""
    if args.in_process:
        return [_run_in_process(args, kind, spec) for spec in specs]
    results, pending, running = [], list(specs), []
    while pending or running:
        while pending and len(running) < jobs and time.perf_counter() < deadline:
            running.append(_start(args, kind, pending.pop(0), parts))
        if not running:  # out of time: the rest never started
            results += [{"mode": s.split(":")[1], "size": s.split(":")[0],
                         "errors": {"worker": "not started: --budget-s spent"}} for s in pending]
            break
        results.append(_finish(running.pop(0), args.timeout_s, deadline))
    return results


def _environment(device: str, lock: GpuLock) -> dict:
    env = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version()}
    if device == "cuda":
        from bench.kernels import measure_ceilings

        props = torch.cuda.get_device_properties(0)
        with lock.exclusive():
            ceilings = measure_ceilings()
        env.update(device=torch.cuda.get_device_name(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   ceilings=ceilings)
        torch.cuda.empty_cache()
    else:
        env.update(device=f"cpu x{torch.get_num_threads()} threads", ceilings=None)
    return env


def _worker_main(args) -> int:
    out = Path(args.worker_out)
    result = _run_in_process(args, args.worker, args.worker_spec, on_part=lambda part: write_json(out, part))
    write_json(out, result)
    return 0


def main(argv=None) -> int:
    args = _parse(argv)
    if args.worker:
        return _worker_main(args)
    if not Path(args.tokenizer, "tokenizer_config.json").exists():
        raise QerlError(f"--tokenizer: expected a tokenizer directory, got {args.tokenizer}")
    device = "cuda" if (args.device == "auto" and torch.cuda.is_available()) else (
        "cpu" if args.device == "auto" else args.device)
    out_dir = Path(args.out_dir)
    parts = Path(args.parts_dir) if args.parts_dir else out_dir / "e2e_parts"
    parts.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = t0 + (args.budget_s if args.budget_s else float("inf"))
    payload = {**_environment(device, GpuLock(args.gpu_lock)),
               "config": {k: v for k, v in vars(args).items() if not k.startswith("worker")}}
    memory_specs = [s for s in args.memory.split(",") if s]
    speed_specs = [f"{args.speed_size}:{m}" for m in args.speed_modes.split(",") if m]
    if args.gpu_lock and not args.in_process:  # every speed worker at once (timed parts take turns), memory
        # workers beside them (subprocesses only: two models in one process's threads would share compile state)
        payload["memory"] = []  # filled by the thread (left empty if it fails)
        memory = threading.Thread(target=lambda: payload.__setitem__("memory", _run_workers(
            args, "memory", memory_specs, args.memory_jobs, parts, deadline)))
        memory.start()
        payload["speed"] = _run_workers(args, "speed", speed_specs, len(speed_specs), parts, deadline)
        memory.join()
    else:  # one worker at a time
        payload["memory"] = _run_workers(args, "memory", memory_specs, args.memory_jobs, parts, deadline)
        payload["speed"] = _run_workers(args, "speed", speed_specs, 1, parts, deadline)
    payload["wall_seconds"] = round(time.perf_counter() - t0, 1)
    add_floors(payload)
    write_json(out_dir / args.out_name, payload)
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
