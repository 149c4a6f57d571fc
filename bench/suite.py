"""Every benchmark of BENCHMARKS.md's targets in one run, on one GPU, inside a time budget: (a) kernels, (b) rollout,
(c) GRPO step, (d) peak memory, then the targets, met or missed.

    python -m bench.suite --tokenizer ../shared/tokenizers/qwen2.5 --out-dir results/bench   # repo root; 8-9 min, H100

Three processes share the GPU through one `bench.gpu_lock.GpuLock`: this one holds it exclusively while the
kernel table (`bench.kernels`) and then the engine's stacked decode layer (`bench.wired`)
run in subprocesses, and `bench.e2e` (its own workers: FP4 and bf16 side by side, the memory workers beside
them one at a time) does its set-up while it can and takes the lock for every timed part. transformers' generate
baseline is left out (--hf-tokens 0; `bench.e2e` runs it by default). So no figure is taken while other work runs,
and the compilation and warm-up of one model overlap those of the other. Each part writes its own JSON as it goes
(a part stopped at the budget keeps what it measured); this process writes suite.json (all of it plus the targets)
and prints every table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_lock import GpuLock
from bench.kernels import write_json
from qerl.errors import QerlError

GIB = 2**30
# Memory workers of (d): size:mode[:micro_batch[:offload[:mlp_chunks]]], one at a time beside the speed workers,
# largest first (the speed workers need most memory last). The default micro-batch for all three sizes; the 45%
# comparison also at micro-batch 1 with activations offloaded and the MLP in 4 slices, where the frozen weights
# are most of the peak.
MEMORY_SPECS = "32B:fp4,14B:fp4,7B:bf16,7B:fp4,7B:bf16:1:offload:4,7B:fp4:1:offload:4"


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="results/bench")
    p.add_argument("--tokenizer", default="../shared/tokenizers/qwen2.5", help="the real Qwen2.5 tokenizer dir")
    p.add_argument("--budget-s", type=float, default=570, help="the whole run; parts still running then stop")
    p.add_argument("--kernel-models", default="7B,32B")
    p.add_argument("--kernel-rows", default="1,16,64,256,2048")
    p.add_argument("--wired-rows", default="1,8", help="rows of the engine's stacked decode layer ('' to skip)")
    p.add_argument("--memory", default=MEMORY_SPECS, help="(d) memory workers, see bench.e2e --memory")
    p.add_argument("--memory-jobs", type=int, default=1)
    p.add_argument("--e2e-args", default="", help="more options for bench.e2e, as one string")
    return p.parse_args(argv)


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _run_exclusive(lock: GpuLock, cmd: list[str], deadline: float, log: Path) -> dict:
    """Run cmd while holding the GPU alone; stopped at the deadline. Returns its exit status and wall time."""
    with lock.exclusive():
        start = time.perf_counter()
        if deadline - start < 5:
            return {"cmd": cmd, "rc": None, "error": "not started: budget spent"}
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(timeout=deadline - start)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    return {"cmd": cmd, "rc": rc, "seconds": round(time.perf_counter() - start, 1), "log": str(log)}


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def main(argv=None) -> int:
    args = _parse(argv)
    if not Path(args.tokenizer, "tokenizer_config.json").exists():
        raise QerlError(f"--tokenizer: expected a tokenizer directory, got {args.tokenizer}")
    out = Path(args.out_dir)
    parts = out / "suite_parts"
    parts.mkdir(parents=True, exist_ok=True)
    for stale in ("kernels.json", "wired.json", "e2e.json"):
        (parts / stale).unlink(missing_ok=True)
    lock_path = parts / "gpu.lock"
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    e2e_cmd = _python("bench.e2e", "--out-dir", str(parts), "--parts-dir", str(parts / "e2e_workers"),
                      "--out-name", "e2e.json", "--tokenizer", args.tokenizer, "--gpu-lock", str(lock_path),
                      "--budget-s", str(max(1.0, args.budget_s - 20)), "--timeout-s", str(args.budget_s),
                      "--hf-tokens", "0", "--memory", args.memory, "--memory-jobs", str(args.memory_jobs),
                      *args.e2e_args.split())
    print(f"[suite] start e2e: {' '.join(e2e_cmd)}", flush=True)
    e2e_log = open(parts / "e2e.log", "w")
    e2e = subprocess.Popen(e2e_cmd, stdout=e2e_log, stderr=subprocess.STDOUT)
    lock = GpuLock(lock_path)
    runs = {"kernels": _run_exclusive(lock, _python(
        "bench.kernels", "--models", args.kernel_models, "--rows", args.kernel_rows, "--no-naive",
        "--out", str(parts / "kernels.json")), deadline, parts / "kernels.log")}
    print(f"[suite] kernels: {runs['kernels']}", flush=True)
    if args.wired_rows:
        runs["wired"] = _run_exclusive(lock, _python(
            "bench.wired", "--models", "7B", "--rows", args.wired_rows, "--lora-rank", "32",
            "--out", str(parts / "wired.json")), deadline, parts / "wired.log")
        print(f"[suite] wired: {runs['wired']}", flush=True)
    try:
        rc = e2e.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        e2e.kill()
        rc = e2e.wait()
    e2e_log.close()
    runs["e2e"] = {"cmd": e2e_cmd, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                   "log": str(parts / "e2e.log")}
    from bench.suite_report import report, targets

    payload = {"budget_s": args.budget_s, "runs": runs, "kernels": _read(parts / "kernels.json"),
               "wired": _read(parts / "wired.json"), "e2e": _read(parts / "e2e.json")}
    payload["targets"] = targets(payload)
    payload["wall_seconds"] = round(time.perf_counter() - t0, 1)
    write_json(out / "suite.json", payload)
    print(report(payload))
    print(f"wrote {out / 'suite.json'} ({payload['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
