"""One GRPO step (rollout + update) of a random 7B model on 1 to N GPUs: data-parallel speed-up, what bounds the
rollout's scaling (its tail on each rank), and memory per GPU beside qerl/memory.py's estimate.

    python -m bench.distributed --out results/bench/distributed.json      # from the repository root, 2 GPUs
    python -m bench.distributed --cases fp4-lora-x1,fp4-lora-x2,fp4-lora-x4,full-x2,full-x4     # 4 GPUs

Cases (--cases, a comma list; default fp4-lora-x1,fp4-lora-x2,full-x2), each its own process group (torchrun
--nproc-per-node N for N > 1 ranks), one after the other:
  fp4-lora-xN   random Qwen2.5-7B, NVFP4 base + LoRA r 32 (bench.random_models), the global batch over N >= 1 ranks
                (qerl.distributed: each rank rolls out 1/N of the prompt groups, LoRA gradients all-reduced)
  full-xN       random bf16 Qwen2.5-7B, every weight trained, sharded by FSDP2 over N >= 2 ranks (qerl.fsdp: rollouts
                on the whole model gathered per step, parameters / gradients / AdamW states 1/N per rank)
N may not exceed the visible GPUs (on a machine without any, ranks are gloo processes); --prompts must split evenly.
Each case runs qerl.trainer.GRPOTrainer (paged rollout engine, gradient checkpointing, the recipe's loss) on
--prompts x --group rows of --prompt-len random prompt tokens. Random weights never emit EOS, so row r ends at a
completion length drawn once from a log-normal (median --median, sigma --sigma, capped at --max-tokens; the
rollout benchmarks' distribution, bench.paged): the same lengths in every case, each rank taking its rows' share.
One untimed step (rows cut to --warmup-tokens, staggered per rank as bench.paged.warmup_lengths: compiles,
captures decode graphs, creates AdamW's states), then one timed step: step seconds (the slowest rank), tokens/s
(generated tokens / step seconds), rollout and update seconds, peak allocated GPU memory of every rank during the
timed step. Speed-ups (same global batch): every fp4-lora-xN against fp4-lora-x1, every full-xN against the
fewest-rank full case that ran.
The rollout's tail, per rank (the engine's stats of its one generate call): rollout seconds, decode steps, seconds in
decode steps of <= 32 live rows, the longest row; per case the slowest and fastest rank's rollout seconds and tail_s,
the slowest rank's seconds in those few-row steps: each rank decodes until its own longest row ends, so the tail
does not shrink with N and bounds the rollout's speed-up.
Memory: qerl.memory.rank_memory_gib for the case's TrainConfig (the bench's workload) and the size's Shape, split in
its update (every term but gathered: weights, adapter, activations, overhead) and rollout (every term but
activations: weights, adapter, gathered, overhead) phases, beside the fullest rank's measured update peak and
rollout peak less its KV pool (the estimate has no pool term: the paged pool takes --gpu-memory-utilization of
what is free), with measured / estimated. A failed case keeps its estimate.
Prints a table (a row per case, then its per-rank and memory lines) and writes JSON atomically after each case (a
case cut short keeps the others; bench.distributed_report); each case's output goes to <out stem>-<case>.log beside
the JSON, with rank 0's progress lines (a timeout names the phase it cut).
A 7B FP4 case compiles its Triton kernels in the warm-up (about a minute on a fresh machine; --compile auto adds
torch.compile of the decode step, minutes more at 7B): on a 10-minute device call run one or two cases per call
(--cases), the Triton cache carrying over between cases of one machine.

CPU smoke run (gloo, a tiny model; tests/bench/test_distributed_bench.py): python -m bench.distributed --size tiny
    --prompts 4 --group 2 --prompt-len 8 --max-tokens 6 --median 4 --micro-batch 2 --lora-r 4 --warmup-tokens 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench.common import add_workload_args, sync
from bench.distributed_report import memory_estimate, memory_fields, table, tail_fields, write

DEFAULT_CASES = "fp4-lora-x1,fp4-lora-x2,full-x2"
_CASE = re.compile(r"(fp4-lora|full)-x([0-9]+)")


def parse_cases(text: str, gpus: int | None = None, prompts: int | None = None) -> list[tuple[str, str, int]]:
    """(name, mode, ranks) of each case of a --cases list: fp4-lora-xN (N >= 1) or full-xN (N >= 2), N at most the
    `gpus` visible (None: no limit, gloo on the CPU) and splitting `prompts` evenly; else SystemExit, one line."""
    cases = []
    for name in (c.strip() for c in text.split(",") if c.strip()):
        m = _CASE.fullmatch(name)
        n = int(m.group(2)) if m else 0
        if m is None or n < (2 if m.group(1) == "full" else 1):
            raise SystemExit(f"--cases: {name!r} is not a case; expected fp4-lora-xN (N >= 1) or full-xN (N >= 2)")
        if gpus is not None and n > gpus:
            raise SystemExit(f"--cases: {name} needs {n} GPUs, {gpus} visible")
        if prompts is not None and prompts % n:
            raise SystemExit(f"--cases: {name} cannot split --prompts {prompts} evenly over {n} ranks")
        cases.append((name, "fp4" if m.group(1) == "fp4-lora" else "full", n))
    if not cases:
        raise SystemExit("--cases: no case named")
    return cases


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list of fp4-lora-xN (N >= 1), full-xN (N >= 2)")
    p.add_argument("--size", default="7B", help="7B | 14B | 32B | tiny (CPU smoke runs)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (the global batch)")
    add_workload_args(p, prompt_len=128, micro_batch=16)
    p.add_argument("--max-tokens", type=int, default=1024, help="max_completion_length, the lengths' cap")
    p.add_argument("--warmup-tokens", type=int, default=32, help="the untimed step's rows end after this many")
    p.add_argument("--compile", default="off", choices=("off", "auto"),
                   help="torch.compile the decode step (off: eager steps in CUDA graphs, as bench.grpo_step)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="paged KV pool: fraction of free memory")
    p.add_argument("--rollout-weights", default="policy", choices=("policy", "nvfp4"),
                   help="full cases: roll out on the gathered bf16 weights or an NVFP4 copy (rollout.weights; with "
                   "rollout_correction tis)")
    p.add_argument("--timeout-s", type=float, default=280, help="per case, build and warm-up included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--padding-free", default="auto", choices=("auto", "true", "false", "shared_prompts"),
                   help="train.padding_free: auto (the default), the update's rows packed (true), padded, or packed "
                   "with each prompt once")
    p.add_argument("--tokenizer", default="../shared/tokenizers/qwen2.5", help="the real Qwen2.5 tokenizer dir")
    p.add_argument("--out", default="results/bench/distributed.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------ one case, inside its process group
def _model(args, mode: str, device: str, dtype: torch.dtype):
    from bench.random_models import attach_lora, build_random_model

    if mode == "fp4":
        model = build_random_model(args.size, fp4=True, device=device, dtype=dtype, seed=args.seed)
        return attach_lora(model, r=args.lora_r, alpha=2 * args.lora_r, fp4=True, gradient_checkpointing=True)
    model = build_random_model(args.size, fp4=False, device=device, dtype=dtype, seed=args.seed)
    model.requires_grad_(True).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def train_config(args, mode: str, world: int):
    """The TrainConfig of a case (the orchestrator's memory estimate reads the same one)."""
    from qerl.config import TrainConfig

    on_cuda = torch.cuda.is_available()
    return TrainConfig(mode="qlora_fp4" if mode == "fp4" else "full", data={"source": "bench"},
                       rewards=["bench.e2e_workers:_random_reward"], num_generations=args.group,
                       batch_size=args.prompts, micro_batch_size=args.micro_batch, max_steps=4,
                       max_prompt_length=args.prompt_len, max_completion_length=args.max_tokens,
                       gradient_checkpointing=True, aqn=None,
                       lora={"lora_r": args.lora_r, "lora_alpha": 2 * args.lora_r},
                       rollout={"engine": "paged", "temperature": 1.0,
                                "compile": "auto" if args.compile == "auto" else False,
                                "gpu_memory_utilization": args.gpu_memory_utilization,
                                "weights": args.rollout_weights if mode == "full" else "policy"},
                       rollout_correction="tis" if mode == "full" and args.rollout_weights == "nvfp4" else "none",
                       dtype="bfloat16" if on_cuda else "float32", num_gpus=world, seed=args.seed,
                       padding_free={"true": True, "false": False}.get(args.padding_free, args.padding_free))


def _trainer(args, mode: str, ranks, tokenizer, prompts):
    from bench.e2e_workers import _random_reward
    from bench.paged import ForcedLengthEngine
    from qerl.trainer import GRPOTrainer, engine_options

    on_cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_cuda else torch.float32
    cfg = train_config(args, mode, ranks.world_size)
    device = f"cuda:{torch.cuda.current_device()}" if on_cuda else "cpu"
    model = _model(args, mode, device, dtype)
    trainer = GRPOTrainer(cfg, model, tokenizer, prompts, ["0"] * len(prompts),
                          [("random", _random_reward, 1.0)], checkpoint_dir=tempfile.mkdtemp(prefix="qerl-bench-"),
                          ranks=ranks)
    trainer.parallel.start(trainer.trainable)  # as train() does: every replica starts from rank 0's adapter
    trainer.engine.close()  # its projection groups go back: the forced-length engine groups them again
    trainer.engine = ForcedLengthEngine(trainer.parallel.rollout_model, tokenizer, eos_token_ids=(),
                                        **engine_options(cfg))
    generate = trainer._generate

    def timed(*a, **kw):  # this rank's own rollout seconds and longest row (timing/rollout is the ranks' maximum)
        start = time.perf_counter()
        out, noise = generate(*a, **kw)
        sync()
        trainer.rank_rollout = (time.perf_counter() - start, max((len(c) for c in out.completion_ids), default=0))
        return out, noise

    trainer._generate = timed
    return trainer


def _peak_gib(reset: bool = True) -> float:
    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def _allocated_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _step(trainer, step: int, lengths: list[int], last: bool = False) -> dict:
    """One GRPO step as GRPOTrainer.train runs it, this rank's rows ending at their drawn lengths; peaks of the
    rollout (the paged KV pool included: it takes a fraction of the memory free then) and of the update apart.
    last: then release the engine and count what it kept through the update (a resident pool, weight copies,
    graphs), which the memory estimate leaves to the pool's share of free memory."""
    rows = trainer.ranks.share(len(lengths), "rows")
    trainer.engine.lengths = lengths[rows]
    trainer.ranks.barrier()
    sync()
    _peak_gib()
    start = time.perf_counter()
    batch = trainer.rollout(step)
    pool = trainer.engine.stats.get("kv_bytes", 0) / 2**30
    trainer.engine.sleep()
    sync()
    rollout_peak = _peak_gib()
    stats = trainer.engine.stats  # this rank's one generate call: its steps by live rows (qerl.rollout.paged_engine)
    decode_steps = sum(v for k, v in stats.items() if k.startswith("steps_decode_"))
    rollout_s, longest = trainer.rank_rollout
    copies = (stats.get("dense_copy_bytes", 0) + stats.get("humming_bytes", 0)) / 2**30  # taken where memory allows
    metrics = trainer.update(batch, step)
    sync()
    seconds = time.perf_counter() - start
    resident = _allocated_gib()
    if last:
        trainer.engine.release()
        sync()
    resident = resident - _allocated_gib() if last else 0.0
    update_copies = metrics.get("update_dense_copies_gib") or 0.0  # qerl.update_copies: where memory allows
    mine = torch.tensor([[seconds, rollout_peak, pool, _peak_gib(reset=False), rollout_s, decode_steps,
                          stats.get("step_s_decode_1_32", 0.0), longest, copies, resident, update_copies]],
                        dtype=torch.float64)
    ranks = trainer.ranks.all_gather(mine)
    per_rank = {key: [round(float(x), 2) for x in ranks[:, i]] for i, key in
                enumerate(("step_s", "rollout_peak_gib", "kv_pool_gib", "update_peak_gib", "rollout_s",
                           "decode_steps", "tail_s", "longest_row", "weight_copies_gib", "engine_resident_gib",
                           "update_copies_gib"))}
    tail = tail_fields({k: per_rank.pop(k) for k in ("rollout_s", "decode_steps", "tail_s", "longest_row")})
    return {"step_s": max(per_rank.pop("step_s")), "rollout_s": batch.metrics["timing/rollout"],  # slowest rank's
            "update_s": metrics["timing/update"], "generated_tokens": int(batch.metrics["rollout_tokens"]),
            "peak_gib_per_rank": [max(a, b) for a, b in zip(per_rank["rollout_peak_gib"], per_rank["update_peak_gib"])],
            **per_rank, **tail, "grad_norm": metrics["grad_norm"], "loss": metrics["loss"]}


def run_case(args) -> None:
    """The --worker case in this process group; rank 0 writes its result to --worker-out."""
    from transformers import AutoTokenizer

    from bench.paged import draw_lengths, random_prompts, warmup_lengths
    from qerl.distributed import close, init_ranks

    _, mode, world = parse_cases(args.worker)[0]
    ranks = init_ranks(world)
    begin = time.perf_counter()

    def say(what: str) -> None:  # progress in the case's log: a timeout then says which phase it cut
        if ranks.is_main:
            print(f"[{args.worker} +{time.perf_counter() - begin:.0f} s] {what}", flush=True)

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        prompts = random_prompts(args.prompts, args.prompt_len, 150000, args.seed)
        lengths = draw_lengths(args.prompts * args.group, args.median, args.sigma, args.max_tokens, args.seed)
        say(f"{world} rank(s) up; building the model and trainer")
        t0 = time.perf_counter()
        trainer = _trainer(args, mode, ranks, tokenizer, prompts)
        build_s = time.perf_counter() - t0
        say(f"built in {build_s:.0f} s; warm-up step (kernels compile, graphs are captured)")
        t0 = time.perf_counter()
        per_rank = warmup_lengths(len(lengths) // world, args.warmup_tokens)  # each rank's share meets every bucket
        _step(trainer, 0, per_rank * world + per_rank[:len(lengths) - len(per_rank) * world])
        warmup_s = time.perf_counter() - t0
        say(f"warm-up step {warmup_s:.0f} s; timed step")
        result = _step(trainer, 1, lengths, last=True)
        say(f"timed step {result['step_s']:.1f} s (rollout {result['rollout_s']:.1f} s, "
            f"update {result['update_s']:.1f} s)")
        result.update(case=args.worker, mode=mode, gpus=world, device=_device_name(), build_s=round(build_s, 1),
                      warmup_s=round(warmup_s, 1),
                      drawn_tokens=sum(lengths), tokens_per_s=sum(lengths) / result["step_s"],
                      rollout_tokens_per_s=sum(lengths) / result["rollout_s"])
        if ranks.is_main:
            Path(args.worker_out).write_text(json.dumps(result))
        ranks.barrier()
    finally:
        close(ranks)


# ------------------------------------------------------------------ the orchestrator
def _launch(argv: list[str], case: str, world: int, out: Path) -> list[str]:
    """The command of one case: this command's options, as a worker (under torchrun for several ranks)."""
    worker = ["-m", "bench.distributed", *argv, "--worker", case, "--worker-out", str(out)]
    if world == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *worker]


def _device_name() -> str:
    """The worker's GPU (the orchestrator never initialises CUDA: its context would take a GPU's memory)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"


def _visible_gpus() -> int | None:
    """GPUs the cases may use (None on a machine without any: gloo ranks). Counts without creating a context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the case's process group and every process below it: torchrun may start its workers in their own
    sessions, and workers outliving a case would hold their GPU memory through the next cases."""
    import signal

    for pid in [proc.pid, *_descendants(proc.pid)]:  # listed before any dies: orphans lose their parent link
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _run_case_process(cmd: list[str], env: dict, timeout_s: float, part: Path, log: Path) -> str | None:
    """Run one case in its own process group, its output (every rank's, and rank 0's progress lines) into `log`;
    None on success, else one line: its error, or the timeout and the last progress line before it."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            progress = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("[")]
            return f"timed out after {timeout_s:g} s" + (f"; last: {progress[-1]}" if progress else "")
    if proc.returncode == 0 and part.is_file():
        return None
    lines = log.read_text(errors="replace").strip().splitlines()
    sys.stderr.write("\n".join(lines[-60:]) + "\n")
    errors = [line for line in lines if "Error" in line or "error:" in line]  # the exception, not torchrun's banner
    return (errors or lines or ["no output"])[-1]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    if args.worker:
        run_case(args)
        return 0
    cases = parse_cases(args.cases, _visible_gpus(), args.prompts)
    print(f"random Qwen2.5-{args.size}, {args.prompts} prompts x {args.group}, completions log-normal "
          f"(median {args.median:.0f}, cap {args.max_tokens}), micro-batch {args.micro_batch}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="qerl-bench-dist-") as tmp:
        for case, mode, world in cases:
            part = Path(tmp) / f"{case}.json"
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            start = time.perf_counter()
            log = Path(args.out).with_name(f"{Path(args.out).stem}-{case}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            failed = _run_case_process(_launch(argv, case, world, part), env, args.timeout_s, part, log)
            wall = round(time.perf_counter() - start, 1)
            estimate = memory_estimate(args.size, mode, train_config(args, mode, world), world)
            if failed:  # the estimate still shows what the case would have needed
                r = {"case": case, "error": failed, "wall_s": wall, "memory": {"estimate": estimate}}
            else:
                r = json.loads(part.read_text())
                r.update(wall_s=wall, memory=memory_fields(estimate, r))
            results.append(r)
            print(f"{case}: " + (f"failed ({r['error']})" if "error" in r else f"step {r['step_s']:.1f} s") +
                  f", {wall:.0f} s with start-up", flush=True)
            write(args, results)
    print(f"devices: {', '.join(sorted({r['device'] for r in results if 'device' in r}))}")
    print(table(results))
    print(f"-> {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
