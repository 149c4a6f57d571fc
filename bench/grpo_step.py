"""One whole GRPO step (rollout + update) of a configured recipe, FP4 + LoRA vs bf16 + LoRA, on random weights.

    python -m bench.grpo_step --experiment qwen7b --modes fp4,bf16 --out results/bench/grpo_step.json

The step is the experiment's own train section from config/config.yaml (prompts per step, G, micro-batch, caps,
LoRA rank, rollout engine and its memory knob, gradient checkpointing, offload); only `mode` differs between the
two runs (qlora_fp4 with the recipe's AQN, lora without; a third, fp4-packed, is FP4 with train.dense_weights false:
every update over the packed weights instead of dense copies; fp4-padded and bf16-padded set train.padding_free
false: the update's rows padded instead of packed; fp4-shared and bf16-shared set it to shared_prompts: each prompt
computed once per group; fp4-unshared and bf16-unshared to true: packed rows, each with its own prompt).
--prompts / --completion-cap shrink it and --num-iterations sets the policy updates per batch (all said in the
JSON). Weights are random Qwen2.5 tensors of the experiment's size (bench.random_models: speed and memory do not
depend on the values); the reward is random within each group. Random weights never emit EOS, so each row ends at a
length drawn from a fixed log-normal (median --median, sigma --sigma, capped at the recipe's completion cap; the same
draws for both modes): the paged engine finishes it there as if it had sampled EOS (bench.paged's
ForcedLengthEngine).

Per mode: build, then untimed warm-up (a rollout whose rows end after at most --warmup-tokens, staggered so that
it meets every decode bucket: bench.paged.warmup_lengths; and one update of one random micro-batch, which creates
AdamW's moments), then one timed step of fresh data. Reported: rollout s and tokens/s, decode steps, the rollout's
floor (per decode step the larger of: the weights once + each running row's KV at the copy bandwidth, and the
running rows' linear-layer FLOPs at the bf16 matmul rate, both measured in the same run; rollout_floor_s), the
engine's step time by rows run, update s and tokens/s, step s, peak GiB. Prints a table and writes JSON atomically
after each mode. --profile-update runs the update twice more, timed (the steady state) and under torch.profiler
(kernels per micro-batch) and once more counting where it waits for the GPU (sync sites, CUDA's sync debug mode), then
profiles the update of a rollout of fresh lengths (new shapes).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.paged import ForcedLengthEngine, build_lora_model, draw_lengths, warmup_lengths
from bench.random_models import decode_weight_bytes
from bench.common import sync, sync_sites
from qerl.compile_cache import configure


VARIANTS = {"packed": {"dense_weights": False}, "padded": {"padding_free": False},  # a mode's train keys after "-"
            "shared": {"padding_free": "shared_prompts"}, "unshared": {"padding_free": True}}
MODES = ("fp4", "bf16", "fp4-packed", "fp4-padded", "bf16-padded", "fp4-shared", "bf16-shared", "fp4-unshared",
         "bf16-unshared")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="config/config.yaml")
    p.add_argument("--experiment", default="qwen7b")
    p.add_argument("--modes", default="fp4,bf16", help="comma list of fp4, bf16, fp4-packed (FP4 with "
                   "train.dense_weights false: every update over the packed weights), fp4-padded, bf16-padded "
                   "(train.padding_free false: the update's rows padded), fp4-shared, bf16-shared (shared_prompts: "
                   "each prompt once per group), fp4-unshared, bf16-unshared (true: packed rows, prompts per row)")
    p.add_argument("--size", default=None, help="random model size (default: the experiment's model_size)")
    p.add_argument("--prompts", type=int, default=0, help="prompts per step (0: the recipe's batch_size)")
    p.add_argument("--completion-cap", type=int, default=0, help="0: the recipe's max_completion_length")
    p.add_argument("--num-iterations", type=int, default=0, help="policy updates per rollout batch "
                   "(0: the recipe's; each one is another pass over the step's rows)")
    p.add_argument("--optim", default="", help="override train.optim (e.g. adamw_torch where bitsandbytes is absent)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--median", type=float, default=400.0)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--warmup-tokens", type=int, default=48)
    p.add_argument("--compile", default="off", choices=("off", "auto"), help="torch.compile the decode step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=1, help="timed steps, each on fresh length draws: the first meets "
                   "the run's new shapes (one-time costs), the mean of the later ones is a training run's steady state")
    p.add_argument("--profile-update", action="store_true",
                   help="then the same update again, timed and under torch.profiler, and the profiled update of "
                   "a fresh-length rollout: GPU kernels per micro-batch, host ops")
    p.add_argument("--profile-rollout", action="store_true",
                   help="then step 2's rollout again under torch.profiler: kernels by kind, the GPU's idle gaps")
    p.add_argument("--rollout-only", action="store_true",
                   help="time the rollout alone (no update): a recipe's full rollout whose step outlasts one call")
    p.add_argument("--progress-s", type=float, default=60.0,
                   help="print the timed rollout's tokens so far this often (0: never)")
    p.add_argument("--out", default="results/bench/grpo_step.json")
    return p.parse_args(argv)


def recipe(args):
    """The experiment's TrainConfig and model size, shrunk as asked."""
    from qerl.config import load_config

    exp = load_config(args.config).experiments[args.experiment]
    changes = {"max_steps": 4, "save_steps": 1000}
    if args.prompts:
        changes["batch_size"] = args.prompts
    if args.completion_cap:
        changes["max_completion_length"] = args.completion_cap
    if args.num_iterations:
        changes["num_iterations"] = args.num_iterations
    if args.optim:
        changes["optim"] = args.optim
    return exp.train.model_copy(update=changes), args.size or exp.model_size


def measure_ceilings(device: str) -> tuple[float, float]:
    """(copy bytes/s, dense bf16 matmul FLOP/s) of the device, measured now (bench.kernels.measure_ceilings)."""
    if device != "cuda":
        return float("nan"), float("nan")
    from bench.kernels import measure_ceilings as measure

    got = measure()
    return got["copy_GBps"] * 1e9, got["bf16_tflops"] * 1e12


def decode_matmul_params(model) -> int:
    """Multiply-adds per decoded token in the linear layers (the LM head and LoRA factors included; the input
    embedding is a gather)."""
    from qerl.quant.linear import FP4Linear

    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, (torch.nn.Linear, FP4Linear)))


def rollout_floor_bytes(model, lengths: list[int], prompt_len: int, steps: int) -> int:
    """Bytes a rollout must read at least: the weights once per decode step, and at each row's t-th token its
    prompt_len + t cached positions (K and V of every layer)."""
    kv = sum(length * prompt_len + length * (length + 1) // 2 for length in lengths) * _kv_bytes_per_position(model)
    return steps * decode_weight_bytes(model) + kv


def rollout_floor_s(model, lengths: list[int], prompt_len: int, bandwidth: float, matmul_rate: float) -> float:
    """Seconds a rollout takes at least: each decode step t (every row still running reads prompt_len + t cached
    positions) costs max(its bytes / bandwidth, 2 * matmul params * running rows / matmul rate). Few rows: the
    weight and KV reads bound it; hundreds of rows: the FLOPs do (a bytes-only floor flatters that regime)."""
    per_pos, weights = _kv_bytes_per_position(model), decode_weight_bytes(model)
    flops_per_row = 2 * decode_matmul_params(model)
    ends = np.sort(np.asarray(lengths))
    total = 0.0
    for t in range(1, int(ends[-1]) + 1 if len(ends) else 1):
        running = len(ends) - int(np.searchsorted(ends, t))  # rows with length >= t
        step_bytes = weights + running * (prompt_len + t) * per_pos
        total += max(step_bytes / bandwidth, flops_per_row * running / matmul_rate)
    return total


def _kv_bytes_per_position(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2


class _Recording(ForcedLengthEngine):
    """ForcedLengthEngine that keeps its last output's stats."""

    last_stats: dict = {}

    def generate(self, prompts, n, sampling):
        out = super().generate(prompts, n, sampling)
        self.last_stats = dict(out.stats)
        return out


def run_mode(args, mode: str, train_cfg, size: str, lengths: list[int], bandwidth: float,
             matmul_rate: float) -> dict:
    from transformers import AutoTokenizer

    from bench.e2e_workers import _random_reward, random_batch, random_prompts
    from qerl.compile_cache import CompileClock, install_triton_clock
    from qerl.trainer import GRPOTrainer, engine_options

    shared = Path(os.environ.get("QERL_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    tok = AutoTokenizer.from_pretrained(shared / "tokenizers" / "qwen2.5")
    rollout = train_cfg.rollout.model_copy(update={"engine": "paged",  # the bench's engine, whatever the recipe's
                                                   "compile": "auto" if args.compile == "auto" else False})
    fp4 = mode.startswith("fp4")
    variant = VARIANTS.get(mode.partition("-")[2], {})
    cfg = train_cfg.model_copy(update={"mode": "qlora_fp4" if fp4 else "lora", "aqn": train_cfg.aqn if fp4 else None,
                                       "rollout": rollout, **variant})
    model = build_lora_model(size, "fp4" if fp4 else "bf16", cfg.lora.lora_r, args.seed, args.device)
    prompts = random_prompts(tok, cfg.batch_size, args.prompt_len, args.seed)
    trainer = GRPOTrainer(cfg, model, tok, prompts, ["0"] * len(prompts), [("random", _random_reward, 1.0)],
                          checkpoint_dir=tempfile.mkdtemp(prefix="qerl-bench-"))
    trainer.engine.close()  # its projection groups go back: the recording engine groups them again
    engine = _Recording(model, tok, eos_token_ids=(), **engine_options(cfg))
    trainer.engine = engine
    engine.lengths = warmup_lengths(len(lengths), args.warmup_tokens)  # meets every decode bucket
    install_triton_clock()  # our Triton kernels' first launches, timed (the warm-up's remainder, broken down)
    clock = CompileClock()
    t = time.perf_counter()
    warm = trainer.rollout(0)
    engine.sleep()  # as GRPOTrainer.train: the pool and dense copies go back before the update
    if not args.rollout_only:
        trainer.update(random_batch(cfg.micro_batch_size, args.prompt_len, cfg.max_completion_length,
                                    args.device, cfg.seed), 0)
    sync(args.device)
    warm_s = time.perf_counter() - t
    compiled, triton_by_kernel = clock.summary(), clock.triton_by_kernel()
    print(f"{mode}: built and warmed up in {warm_s:.1f} s; timing the step", flush=True)  # a call cut short says where
    for name, v in sorted(triton_by_kernel.items(), key=lambda kv: -kv[1]["seconds"])[:10]:
        print(f"  Triton JIT {name}: {v['kernels']} specializations, {v['seconds']:.1f} s", flush=True)
    warm_peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0  # a full-length micro-batch
    del warm
    engine.lengths, engine.progress_s = lengths, args.progress_s
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    batch = trainer.rollout(1)
    rollout_peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
    engine.sleep()
    compiles_before = _compile_counts()
    metrics = ({"timing/update": None, "loss": None, "grad_norm": None} if args.rollout_only
               else trainer.update(batch, 1))
    sync(args.device)
    step_s = time.perf_counter() - t
    compiles = {k: v - compiles_before.get(k, 0) for k, v in _compile_counts().items()}
    stats = engine.last_stats  # the timed rollout's (dense_copy_bytes among them)
    floor = rollout_floor_bytes(model, lengths, args.prompt_len, int(stats.get("steps", 0)))
    floor_s = rollout_floor_s(model, lengths, args.prompt_len, bandwidth, matmul_rate)
    rollout_s, update_s = batch.metrics["timing/rollout"], metrics["timing/update"]
    update_tokens = int(batch.attention_mask.sum())
    result = dict(mode=f"{mode}+lora", rows=len(lengths), useful_tokens=sum(lengths), warmup_s=warm_s,
                  warmup_torch_compile_s=compiled["torch_compile_s"],
                  warmup_humming_s=compiled["humming_prepare_s"], warmup_humming_kernels=compiled["humming_kernels"],
                  warmup_humming_background_s=compiled["humming_background_s"],
                  warmup_cuda_build_s=compiled["cuda_build_s"], warmup_triton_jit_s=compiled["triton_jit_s"],
                  warmup_triton_kernels=compiled["triton_kernels"], warmup_triton_by_kernel=triton_by_kernel,
                  rollout_s=rollout_s, rollout_tok_s=sum(lengths) / rollout_s, decode_steps=stats.get("steps"),
                  preemptions=stats.get("preemptions"), peak_running=stats.get("peak_running"),
                  dense_copy_gib=stats.get("dense_copy_bytes", 0) / 2**30,
                  **{k.replace("dense_check_", "dense_check_gib_"): v / 2**30 for k, v in stats.items()
                     if k.startswith("dense_check_") and k != "dense_check_kept"},
                  dense_check_kept=stats.get("dense_check_kept"),
                  humming_gib=stats.get("humming_bytes", 0) / 2**30,
                  humming_build_s=stats.get("humming_check_build_s", 0.0),
                  num_blocks=stats.get("num_blocks"), graph_captures_timed=stats.get("graph_captures"),
                  projection_groups=stats.get("projection_groups"),
                  graph_build_s=stats.get("graph_build_s"),
                  floor_bytes=floor, bytes_floor_s=floor / bandwidth, floor_s=floor_s,
                  floor_pct=100 * floor_s / rollout_s,
                  **{k: v for k, v in stats.items() if k.startswith(("step_s_", "steps_", "step_wait_s_"))},
                  update_s=update_s, update_tokens=update_tokens,
                  update_tok_s=update_tokens / update_s if update_s else None,
                  update_padded_tokens_ratio=metrics.get("update/padded_tokens_ratio"),
                  update_rows_packed=trainer.packable, update_prompts_packed=trainer.prompts_packed,
                  update_compiles=compiles, update_dense_copies_gib=metrics.get("update_dense_copies_gib"),
                  step_s=step_s, loss=metrics["loss"], grad_norm=metrics["grad_norm"],
                  rollout_peak_gib=rollout_peak / 2**30, warmup_peak_gib=warm_peak / 2**30,
                  resident_pool=stats.get("resident_pool"), update_reserve_gib=stats.get("update_bytes", 0) / 2**30,
                  # the trainer resets the peak at each update: the larger of the rollout's and the update's
                  peak_gib=max(rollout_peak, torch.cuda.max_memory_allocated()) / 2**30 if args.device == "cuda"
                  else 0.0)
    result["later_steps"] = [_later_step(args, trainer, engine, len(lengths), cfg.max_completion_length, i)
                             for i in range(1, args.steps if not args.rollout_only else 1)]
    if args.profile_rollout:
        from bench.rollout_profile import profile_rollout

        engine.lengths = draw_lengths(len(lengths), args.median, args.sigma, cfg.max_completion_length, args.seed + 1)
        result["rollout_profile"] = profile_rollout(lambda: trainer.rollout(2))  # step 2's draw and prompts
        engine.sleep()
    if args.profile_update and not args.rollout_only:
        result["update_repeat_s"] = _timed_update(trainer, batch, args.device)  # steady state: no first-call costs
        result["update_profile"] = _profile_update(trainer, batch, cfg.micro_batch_size, args.device)
        with sync_sites() as sites:  # where the update waits for the GPU, by call site (one more update)
            trainer.update(batch, 2)
        result["update_sync_sites"] = [{"site": k, "count": v} for k, v in sites.most_common(20)]
        engine.lengths = draw_lengths(len(lengths), args.median, args.sigma, cfg.max_completion_length, args.seed + 99)
        fresh = trainer.rollout(99)  # fresh lengths: the update meets new shapes, as every step of a training run
        engine.sleep()
        result["update_profile_fresh"] = _profile_update(trainer, fresh, cfg.micro_batch_size, args.device)
    engine.close()
    del trainer, engine, model, batch
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _later_step(args, trainer, engine, rows: int, cap: int, i: int) -> dict:
    """One more timed step on fresh length draws (seed + i)."""
    engine.lengths = draw_lengths(rows, args.median, args.sigma, cap, args.seed + i)
    sync(args.device)
    t = time.perf_counter()
    batch = trainer.rollout(1 + i)
    engine.sleep()
    metrics = trainer.update(batch, 1 + i)
    sync(args.device)
    stats = engine.last_stats
    return {"useful_tokens": sum(engine.lengths), "rollout_s": batch.metrics["timing/rollout"],
            "update_s": metrics["timing/update"], "step_s": time.perf_counter() - t,
            "update_dense_copies_gib": metrics.get("update_dense_copies_gib"),
            "graph_captures": stats.get("graph_captures"), "graph_build_s": stats.get("graph_build_s"),
            "pool_kept": stats.get("pool_kept"), "humming_build_s": stats.get("humming_check_build_s", 0.0),
            **{k: v for k, v in stats.items() if k.startswith(("step_s_", "steps_", "step_wait_s_"))}}


def _compile_counts() -> dict:
    """Compilations so far: dynamo's frames and recompiles, and kernels in Triton's on-disk cache (a timed part
    that compiles shows it here)."""
    from torch._dynamo.utils import counters

    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {"dynamo_frames": sum(counters["frames"].values()),
            "dynamo_recompiles": sum(counters["recompiles"].values()),
            "triton_cache_entries": sum(1 for _ in cache.iterdir()) if cache.is_dir() else 0}


def _timed_update(trainer, batch, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    trainer.update(batch, 2)
    sync(device)
    return time.perf_counter() - t


def _profile_update(trainer, batch, micro_batch_size: int, device: str) -> dict:
    """One update of `batch` under torch.profiler: the GPU kernels per micro-batch, longest first, and the host ops
    (where an FP4 update spends what a bf16 one does not)."""
    from bench.e2e_workers import _allocator_counts, _kernel_profile, _kernel_table

    micro_batches = max(1, -(-int(batch.input_ids.shape[0]) // micro_batch_size))
    sync(device)
    t = time.perf_counter()
    allocs = _allocator_counts()
    with _kernel_profile() as prof:
        trainer.update(batch, 2)
        sync(device)
    wall = time.perf_counter() - t
    allocs = {k: v - allocs[k] for k, v in _allocator_counts().items()}
    table = _kernel_table(prof, micro_batches, "micro_batch", top=25)
    events = prof.key_averages()
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    cpu_total = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:12]
    return {"micro_batches": micro_batches, "wall_s_profiled": wall, **allocs, **table,
            "cpu_top": [{"name": e.key[:120], "count": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6}
                        for e in cpu],
            "cpu_total_top": [{"name": e.key[:120], "count": e.count, "cpu_s": e.cpu_time_total / 1e6,
                               "device_s": e.device_time_total / 1e6} for e in cpu_total]}


def _print_profile(row: dict) -> None:
    if "rollout_profile" in row:
        from bench.rollout_profile import format_profile

        later = row.get("later_steps") or [{}]
        print(format_profile(row["mode"], row["rollout_profile"], later[0].get("rollout_s")), flush=True)
    if "update_profile" in row:
        _print_one_profile(row, row["update_profile"])
        for k in row.get("update_sync_sites", []):
            print(f"  host waits x{k['count']:<5} {k['site'][:150]}")
    if "update_profile_fresh" in row:
        print(f"{row['mode']} the update of another rollout, fresh lengths:")
        _print_one_profile(row, row["update_profile_fresh"])


def _print_one_profile(row: dict, prof: dict) -> None:
    print(f"{row['mode']} update: timed {row['update_s']:.1f} s (compilations {row['update_compiles']}), the same "
          f"batch again {row['update_repeat_s']:.1f} s; profile: {prof['micro_batches']} micro-batches, "
          f"{prof['gpu_us_per_micro_batch'] / 1e3:.1f} GPU ms each, wall {prof['wall_s_profiled']:.1f} s, "
          f"device allocs {prof['device_allocs']}, alloc retries {prof['alloc_retries']}", flush=True)
    for k in prof["top"][:15]:
        print(f"  {k['us_per_micro_batch'] / 1e3:9.2f} ms  x{k['count_per_micro_batch']:<7} {k['name'][:90]}")
    for k in prof["cpu_top"][:6]:
        print(f"  CPU {k['self_cpu_s']:7.2f} s  x{k['count']:<7} {k['name'][:90]}")
    for k in prof["cpu_total_top"]:
        print(f"  CPU total {k['cpu_s']:7.2f} s (GPU {k['device_s']:6.2f} s) x{k['count']:<7} {k['name'][:80]}")


def _table(rows: list[dict]) -> str:
    head = (f"{'model':10s} {'rows':>5s} {'rollout s':>9s} {'tok/s':>8s} {'floor%':>6s} {'steps':>6s} "
            f"{'update s':>8s} {'upd tok/s':>9s} {'step s':>7s} {'peak GiB':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['mode']:10s} {r['rows']:5d} {r['rollout_s']:9.1f} {r['rollout_tok_s']:8,.0f} "
                     f"{r['floor_pct']:6.1f} {r['decode_steps'] or 0:6d} {r['update_s'] or 0:8.1f} "
                     f"{r['update_tok_s'] or 0:9,.0f} {r['step_s']:7.1f} {r['peak_gib']:8.2f}")
    for r in rows:
        lines.append(f"{r['mode']:10s} warm-up {r['warmup_s']:.1f} s: torch.compile {r['warmup_torch_compile_s']:.1f} s, "
                     f"humming {r['warmup_humming_kernels']} kernels {r['warmup_humming_s']:.1f} s waited "
                     f"({r.get('warmup_humming_background_s', 0):.1f} s in the background), our CUDA kernels "
                     f"{r.get('warmup_cuda_build_s', 0):.1f} s, our Triton kernels {r.get('warmup_triton_kernels', 0)} "
                     f"{r.get('warmup_triton_jit_s', 0):.1f} s; graph builds "
                     f"in the timed rollout {r.get('graph_build_s') or 0:.2f} s; projection groups "
                     f"{r.get('projection_groups')}")
    for r in rows:
        bins = [(k[len("steps_"):], r[k]) for k in r if k.startswith("steps_decode_") and r[k]]
        parts = [f"{b.replace('decode_', '').replace('_', '-')} rows {n} steps {1e3 * r[f'step_s_{b}'] / n:.2f} ms "
                 f"(host {1e3 * (r[f'step_s_{b}'] - r.get(f'step_wait_s_{b}', 0.0)) / n:.2f})" for b, n in bins]
        if parts:
            lines.append(f"{r['mode']:10s} per decode step, first timed rollout: " + "; ".join(parts))
    for r in rows:
        if r.get("later_steps"):
            later = r["later_steps"]
            mean = {k: sum(x[k] for x in later) / len(later) for k in ("rollout_s", "update_s", "step_s")}
            lines.append(f"{r['mode']:10s} steps 2-{len(later) + 1} (fresh lengths), mean: rollout "
                         f"{mean['rollout_s']:.1f} s, update {mean['update_s']:.1f} s, step {mean['step_s']:.1f} s; "
                         f"pool kept {sum(bool(x.get('pool_kept')) for x in later)} of {len(later)}, graph builds "
                         f"{sum(x.get('graph_build_s') or 0 for x in later):.2f} s, humming copies "
                         f"{sum(x.get('humming_build_s') or 0 for x in later):.2f} s (resident pool "
                         f"{r.get('resident_pool')}, update reserve {r.get('update_reserve_gib', 0):.1f} GiB)")
    for r in rows:
        if r.get("later_steps"):
            copies = [x.get("update_dense_copies_gib") or 0 for x in r["later_steps"]]
            lines.append(f"{r['mode']:10s} update over dense copies of the FP4 base (train.dense_weights): "
                         f"{', '.join(f'{c:.1f}' for c in copies)} GiB in steps 2-{len(copies) + 1}")
    by = {r["mode"]: r for r in rows}
    if "fp4+lora" in by and "bf16+lora" in by and by["fp4+lora"]["update_s"] and by["bf16+lora"]["update_s"]:
        f, b = by["fp4+lora"], by["bf16+lora"]
        lines.append(f"FP4/bf16: rollout tokens/s x{f['rollout_tok_s'] / b['rollout_tok_s']:.2f}, update "
                     f"x{b['update_s'] / f['update_s']:.2f} faster, step x{b['step_s'] / f['step_s']:.2f} faster, "
                     f"peak x{f['peak_gib'] / max(b['peak_gib'], 1e-9):.2f}")
    return "\n".join(lines)


def _write(out: Path, payload: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, out)


def main(argv=None) -> int:
    args = _parse(argv)
    caches = configure()  # as a stage: compiled kernels kept for the next run (QERL_COMPILE_CACHE)
    train_cfg, size = recipe(args)
    rows = train_cfg.batch_size * train_cfg.num_generations
    lengths = draw_lengths(rows, args.median, args.sigma, train_cfg.max_completion_length, args.seed)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    bandwidth, matmul_rate = measure_ceilings(args.device)
    print(f"{device_name}: {args.experiment} recipe, random Qwen2.5-{size}, {train_cfg.batch_size} prompts x "
          f"{train_cfg.num_generations}, prompts {args.prompt_len} tokens, micro-batch {train_cfg.micro_batch_size}, "
          f"rollout engine paged (the bench's; the recipe names {train_cfg.rollout.engine}); completion lengths "
          f"log-normal (median {args.median:.0f}, "
          f"sigma {args.sigma}, cap {train_cfg.max_completion_length}): mean {np.mean(lengths):.0f}, max "
          f"{max(lengths)}, rows end there (random weights never emit EOS); copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s", flush=True)
    print(f"compile caches: {caches}", flush=True)
    payload = {"device": device_name, "torch": torch.__version__, "args": vars(args), "size": size, "caches": caches,
               "recipe": json.loads(train_cfg.model_dump_json()), "bandwidth_bytes_s": bandwidth,
               "matmul_flops_s": matmul_rate,
               "note": "random weights; rows end at drawn log-normal lengths (forced EOS); floor_s = sum over decode "
                       "steps of max(weights + running rows' KV bytes / copy bandwidth, linear-layer FLOPs of the "
                       "running rows / bf16 matmul rate), both measured in the same run", "results": []}
    for mode in [m for m in args.modes.split(",") if m]:
        if mode not in MODES:
            raise SystemExit(f"--modes: expected some of {', '.join(MODES)}, got {mode!r}")
        payload["results"].append(run_mode(args, mode, train_cfg, size, lengths, bandwidth, matmul_rate))
        print(_table(payload["results"]), flush=True)
        _print_profile(payload["results"][-1])
        _write(Path(args.out), payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
