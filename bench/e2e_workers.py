"""The two measurements of `bench.e2e`, each meant to run in its own process (clean allocator, own peak).

speed_worker: one random Qwen2.5 model (FP4 + LoRA or bf16 + LoRA, gradient checkpointing on), then
  (b) TorchEngine rollout tokens/s at each batch, (c) one GRPO step through qerl.trainer.GRPOTrainer
  (rollout + rewards + log-probs + policy_loss + backward + AdamW), and transformers' generate as a baseline.
memory_worker: (d) peak allocated memory of GRPO updates (forward + backward with gradient checkpointing +
  AdamW step) on one micro-batch, the model's own memory included: the larger peak of two updates (the
  second holds AdamW's moments from the start, as every update of a run does).
Both return plain dicts (JSON-ready); timings are host clocks around synchronized GPU work (whole rollouts and
steps, seconds long, so event timing adds nothing). With --gpu-lock (bench.gpu_lock) the set-up work (model,
compilation, graph capture, warm-up update) runs beside other workers and every timed part runs alone on the GPU.
"""
from __future__ import annotations

import tempfile
import time
import zlib

import torch

from bench.gpu_lock import GpuLock
from bench.random_models import attach_lora, build_random_model, decode_weight_bytes, qwen25_config
from bench.common import sync


def device_and_dtype(device: str) -> tuple[str, torch.dtype]:
    """auto -> cuda + bfloat16 when a GPU is present, cpu + float32 otherwise (CPU smoke runs)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, torch.bfloat16 if device == "cuda" else torch.float32


def random_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` ordinary (non-special) token ids, deterministic per seed."""
    gen = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    ids = [t for t in torch.randint(0, 30000, (count * length * 2,), generator=gen).tolist() if t not in special]
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def _random_reward(completions, answers=None, **kwargs) -> list[float]:
    """A reward in [0, 1) from each completion's text alone: rows differ inside every group (so advantages and the
    loss are non-zero), and a row scores the same whichever rank or batch graded it (1 and 2 GPUs compare)."""
    return [zlib.crc32(str(c).encode("utf-8", "surrogatepass")) / 2**32 for c in completions]


def _build(args, fp4: bool, size: str):
    from transformers import AutoTokenizer

    device, dtype = device_and_dtype(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = build_random_model(qwen25_config(size), fp4=fp4, device=device, dtype=dtype, seed=args.seed)
    model = attach_lora(model, r=args.lora_r, alpha=2 * args.lora_r, fp4=fp4, gradient_checkpointing=True,
                        fused=args.fused_lora == "on")
    return model, tokenizer, device


def make_trainer(model, tokenizer, prompts, *, fp4: bool, num_generations: int, completion_len: int,
                 micro_batch_size: int, lora_r: int, seed: int, offload: bool = False,
                 logprob_chunk: int | None = None, mlp_chunks: int = 1, fused_elementwise: bool = True):
    """The project's GRPOTrainer on synthetic prompts and a random reward (no AQN: sigma would be 0 at step 0)."""
    from qerl.config import TrainConfig
    from qerl.trainer import GRPOTrainer

    cfg = TrainConfig(mode="qlora_fp4" if fp4 else "lora", data={"source": "bench"},
                      rewards=["bench.e2e_workers:_random_reward"],  # the name the config accepts; passed below
                      num_generations=num_generations, batch_size=len(prompts), micro_batch_size=micro_batch_size,
                      max_steps=4, max_completion_length=completion_len, gradient_checkpointing=True, aqn=None,
                      offload_activations=offload, mlp_chunks=mlp_chunks, fused_elementwise=fused_elementwise,
                      lora={"lora_r": lora_r, "lora_alpha": 2 * lora_r}, seed=seed,
                      **({"logprob_chunk_size": logprob_chunk} if logprob_chunk else {}))
    return GRPOTrainer(cfg, model, tokenizer, prompts, ["0"] * len(prompts), [("random", _random_reward, 1.0)],
                       checkpoint_dir=tempfile.mkdtemp(prefix="qerl-bench-"))


def _timed_generate(engine, prompts, n: int, new_tokens: int, seed: int) -> dict:
    from qerl.rollout import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=seed)
    sync()
    start = time.perf_counter()
    out = engine.generate(prompts, n=n, sampling=sampling)
    sync()
    seconds = time.perf_counter() - start
    return {"rows": len(out.completion_ids), "seconds": seconds, "tokens": out.num_tokens,
            "tokens_per_s": out.num_tokens / seconds, "decode_calls": out.stats.get("decode_calls"),
            "graph_replays": out.stats.get("graph_replays"), "graph_captures": out.stats.get("graph_captures")}


def _batch_of(prompts, batch: int) -> tuple[list[list[int]], int]:
    """The prompts and samples per prompt n that make `batch` rows (n = batch // len(prompts), at least 1)."""
    n = max(1, batch // len(prompts))
    return prompts[:max(1, batch // n)], n


def _rollout_rows(engine, prompts, batch: int, new_tokens: int, seed: int, lock: GpuLock) -> dict:
    """One batch size: the engine's warm-up (compiles and captures the decode step: the prefill and a few steps
    of the same call) beside other workers, then the timed run alone on the GPU."""
    from qerl.rollout import SamplingParams

    chosen, n = _batch_of(prompts, batch)
    with lock.shared():
        sync()
        start = time.perf_counter()
        warm = engine.warm_up(chosen, n=n, sampling=SamplingParams(temperature=1.0, max_tokens=new_tokens,
                                                                    seed=seed))
        sync()
        warm_seconds = time.perf_counter() - start
    captures = engine.stats["graph_captures"]
    with lock.exclusive():
        row = _timed_generate(engine, chosen, n, new_tokens, seed + 1)
    return {"batch": row["rows"], "new_tokens": new_tokens, "warm_up_seconds": round(warm_seconds, 3),
            "warm_up": warm, "captures_while_timed": engine.stats["graph_captures"] - captures, **row}


def _profile_rollout(engine, prompts, batch: int, new_tokens: int, seed: int) -> dict:
    """GPU kernels of one (already warm) rollout under torch.profiler: what a decode step is made of.

    Under programmatic dependent launch (QERL_PDL; on by default in Hopper CUDA graphs) a kernel starts before the
    one it depends on has finished and its profiled time includes that wait, so the kernel times add up to more
    than the step's wall time: take per-kernel breakdowns with QERL_PDL=0 (recorded as pdl_mode)."""
    from qerl.quant.dispatch import pdl_mode

    chosen, n = _batch_of(prompts, batch)
    with _kernel_profile() as prof:
        row = _timed_generate(engine, chosen, n, new_tokens, seed)
    steps = max(1, new_tokens - 1)
    return {"batch": row["rows"], "new_tokens": new_tokens, "decode_calls": row["decode_calls"],
            "seconds_profiled": row["seconds"], "pdl_mode": pdl_mode(),
            "wall_us_per_step": row["seconds"] * 1e6 / steps, **_kernel_table(prof, steps, "step")}


def _kernel_profile():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _kernel_table(prof, per: int, unit: str, top: int = 40) -> dict:
    """The profiled GPU kernels, longest total first, as counts and microseconds per `unit` (per = units run)."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {f"kernels_per_{unit}": sum(e.count for e in kernels) / per,
            f"gpu_us_per_{unit}": sum(e.self_device_time_total for e in kernels) / per,
            "top": [{"name": e.key[:120], f"count_per_{unit}": round(e.count / per, 2),
                     f"us_per_{unit}": round(e.self_device_time_total / per, 2)} for e in kernels[:top]]}


def _allocator_counts() -> dict:
    """cudaMalloc calls and allocation retries so far (a retry frees the cache: a device sync plus cudaFree)."""
    if not torch.cuda.is_available():
        return {"device_allocs": 0, "alloc_retries": 0}
    stats = torch.cuda.memory_stats()
    return {"device_allocs": stats.get("num_device_alloc", 0), "alloc_retries": stats.get("num_alloc_retries", 0)}


def _since(before: dict) -> dict:
    return {k: v - before[k] for k, v in _allocator_counts().items()}


def random_batch(rows: int, prompt_len: int, completion_len: int, device, seed: int):
    """A trainer Batch of random token ids (every completion token counted, random advantages)."""
    from qerl.trainer import Batch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30000, (rows, prompt_len + completion_len), generator=gen)
    return Batch(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                 completion_mask=torch.ones(rows, completion_len, device=device),
                 rollout_logprobs=torch.zeros(rows, completion_len, device=device),
                 advantages=torch.randn(rows, generator=gen).to(device))


def _grpo_step(trainer, prompts, lock: GpuLock, profile_update: bool = False) -> dict:
    """Beside other workers: the rollout's warm-up (the engine compiles and captures the step's decode call) and
    one update of a random micro-batch of the step's shape (compiles the training kernels, creates AdamW's
    moments). Then alone on the GPU: a full step (rollout + update) of fresh data.
    profile_update: then one more step, its update (every micro-batch, right after the rollout as in training)
    under torch.profiler: kernels per update, and the GPU's idle time (wall minus kernel time)."""
    cfg, device = trainer.cfg, next(trainer.model.parameters()).device
    with lock.shared():
        warm = trainer.engine.warm_up(prompts, n=cfg.num_generations, sampling=trainer.sampling(1))
        trainer.update(random_batch(cfg.micro_batch_size, len(prompts[0]), cfg.max_completion_length, device,
                                    cfg.seed), 0)
        sync()
    captures = trainer.engine.stats["graph_captures"]
    with lock.exclusive():
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        counts = _allocator_counts()
        start = time.perf_counter()
        batch = trainer.rollout(1)
        rollout_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        metrics = trainer.update(batch, 1)  # resets the peak counter when it starts (residency's measurement)
        sync()
        step = time.perf_counter() - start
    peak = max(rollout_peak, torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
    result = {"rows": batch.input_ids.shape[0], "prompt_len": batch.input_ids.shape[1] - batch.completion_len,
              "completion_len": batch.completion_len, "micro_batch_size": cfg.micro_batch_size,
              "rollout_seconds": batch.metrics["timing/rollout"], "rollout_tokens": batch.metrics["rollout_tokens"],
              "update_seconds": metrics["timing/update"], "step_seconds": step, "peak_bytes": peak,
              "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "allocator": _since(counts),
              "warm_up": warm, "captures_while_timed": trainer.engine.stats["graph_captures"] - captures}
    if profile_update:
        with lock.exclusive():
            batch = trainer.rollout(2)
            counts = _allocator_counts()
            with _kernel_profile() as prof:
                seconds = trainer.update(batch, 2)["timing/update"]
                sync()
        table = _kernel_table(prof, 1, "update", top=60)
        result["update_profile"] = {
            "rows": batch.input_ids.shape[0], "tokens": int(batch.attention_mask.sum()), "seconds_profiled": seconds,
            "gpu_idle_us": seconds * 1e6 - table["gpu_us_per_update"], "allocator": _since(counts), **table}
    return result


def _hf_generate(model, prompts, new_tokens: int, pad_id: int) -> dict:
    """transformers' generate (sampling, dynamic cache, eager) on the same model: the baseline to beat."""
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            sync()
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad_id)
            sync()
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"batch": ids.shape[0], "new_tokens": new_tokens, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds}


def speed_worker(args, mode: str, size: str, on_part=None) -> dict:
    """(b) rollout rows, (c) one GRPO step and the HF baseline for one model; each part fails on its own and
    on_part(result) is called after each, so a worker killed at its time limit still leaves what it measured."""
    on_part = on_part or (lambda result: None)
    fp4, lock = mode == "fp4", GpuLock(getattr(args, "gpu_lock", None))
    with lock.shared():
        model, tokenizer, device = _build(args, fp4, size)
        prompts = random_prompts(tokenizer, args.prompts, args.prompt_len, args.seed)
        trainer = make_trainer(model, tokenizer, prompts, fp4=fp4, num_generations=args.group,
                               completion_len=max(1, args.step_completion), micro_batch_size=args.micro_batch,
                               lora_r=args.lora_r, seed=args.seed, logprob_chunk=args.logprob_chunk,
                               mlp_chunks=args.mlp_chunks,
                               fused_elementwise=args.fused_elementwise == "on")
    if args.cuda_graph == "off":  # eager decode steps (the engine's own fallback path), static cache kept
        trainer.engine.use_cuda_graph = False
    if args.compile == "off":
        trainer.engine.use_compile = False
    if args.fuse_projections == "off":  # q/k/v and gate/up as separate layers
        trainer.engine.unfuse_projections()
    elif args.fuse_projections == "all":  # dense (bf16 LoRA) layers too
        trainer.engine.fuse_projections(("fp4", "dense"))
    result = {"mode": mode, "size": size, "device": device, "decode_weight_bytes": decode_weight_bytes(model),
              "cuda_graph": trainer.engine.use_cuda_graph, "compile": trainer.engine.use_compile,
              "projection_groups": trainer.engine.stats["projection_groups"],
              "rollout": [], "errors": {}}
    for batch in args.batches:
        _guard(result, f"rollout_b{batch}", lambda b=batch: result["rollout"].append(
            _rollout_rows(trainer.engine, prompts, b, args.new_tokens, args.seed, lock)))
        on_part(result)
        _give_back_cached_memory()  # the last decoder's cache and graph pool: other workers may need the room
    if args.profile_tokens:
        def profile():
            with lock.exclusive():
                result["profile"] = _profile_rollout(trainer.engine, prompts, args.batches[0], args.profile_tokens,
                                                     args.seed + 2)
        _guard(result, "profile", profile)
        on_part(result)
    if args.step_completion:
        _guard(result, "grpo_step", lambda: result.__setitem__(
            "grpo_step", _grpo_step(trainer, prompts, lock, args.profile_update)))
        on_part(result)
    trainer.engine.close()
    if args.hf_tokens:
        def hf_generate():
            with lock.exclusive():
                result["hf_generate"] = _hf_generate(model, prompts[:args.batches[0]], args.hf_tokens,
                                                     tokenizer.pad_token_id)
        _guard(result, "hf_generate", hf_generate)
    result["gpu_lock_wait_s"] = round(lock.waited_s, 1)
    return result


def memory_worker(args, mode: str, size: str, micro_batch: int | None = None, offload: bool = False,
                  mlp_chunks: int | None = None) -> dict:
    """(d) peak allocated bytes of one GRPO update on one micro-batch of prompt + completion tokens
    (micro_batch rows, default --micro-batch; offload: saved activations in pinned CPU memory). Beside other
    workers under --gpu-lock: a peak of allocated memory is per process, whatever else runs."""
    with GpuLock(getattr(args, "gpu_lock", None)).shared():
        return _memory_peaks(args, mode, size, micro_batch, offload, mlp_chunks or args.mlp_chunks)


def _memory_peaks(args, mode: str, size: str, micro_batch: int | None, offload: bool, mlp_chunks: int) -> dict:
    fp4 = mode == "fp4"
    model, tokenizer, device = _build(args, fp4, size)
    rows, plen, clen = micro_batch or args.micro_batch, args.prompt_len, args.memory_completion
    prompts = random_prompts(tokenizer, rows, plen, args.seed)
    trainer = make_trainer(model, tokenizer, prompts[:1], fp4=fp4, num_generations=max(2, rows), completion_len=clen,
                           micro_batch_size=rows, lora_r=args.lora_r, seed=args.seed, offload=offload,
                           logprob_chunk=args.logprob_chunk, mlp_chunks=mlp_chunks,
                           fused_elementwise=args.fused_elementwise == "on")
    batch = random_batch(rows, plen, clen, device, args.seed)
    on_cuda = device == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    model_bytes = torch.cuda.memory_allocated() if on_cuda else None
    updates = []
    for step in range(2):  # the first update creates AdamW's moments; the second is the steady state
        start = time.perf_counter()
        metrics = trainer.update(batch, step)
        sync()
        updates.append({"seconds": time.perf_counter() - start, "loss": metrics["loss"],
                        "peak_bytes": torch.cuda.max_memory_allocated() if on_cuda else None})
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
    return {"mode": mode, "size": size, "device": device, "rows": rows, "offload": offload, "prompt_len": plen,
            "completion_len": clen, "logprob_chunk": trainer.cfg.logprob_chunk_size,
            "mlp_chunks": trainer.cfg.mlp_chunks, "model_bytes": model_bytes,
            "peak_bytes": max(u["peak_bytes"] for u in updates) if on_cuda else None,
            "first_update_peak_bytes": updates[0]["peak_bytes"], "update_seconds": updates[1]["seconds"],
            "first_update_seconds": updates[0]["seconds"], "loss": updates[0]["loss"]}


def _give_back_cached_memory() -> None:
    """Return the allocator's unused cached blocks to the device (other benchmark processes share the GPU)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _guard(result: dict, name: str, fn) -> None:
    """Run one part; an exception is recorded (type and message) so the other parts still report."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a bench reports what failed and goes on
        result["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
        _give_back_cached_memory()
