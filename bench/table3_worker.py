"""One experiment of the paper's Table 3, measured in its own process: model size, rollout tokens/s, GRPO step time.

measure(spec, args, on_part) builds the experiment's policy - its checkpoint when one is given and present, else
random weights of the real Qwen2.5 shapes (speed does not depend on the values): bf16 + LoRA, NF4 (bitsandbytes) +
LoRA or NVFP4 (FP4Linear) + LoRA - then measures, each timed part alone on the GPU under --gpu-lock:
  rollout  rows = each --rollout-batches (the paper's Tables 5-8: batch 2 and 8), one --prompt-len prompt each;
  e2e      GRPO steps of each --e2e-batches prompts x G completions (Table 3: batch 2/4/8) through
           qerl.trainer.GRPOTrainer (rollout + rewards + log-probs + loss + backward + AdamW), --steps timed after
           a warm-up (the engine's compile/capture for that shape and one update of a full-length micro-batch).
Random weights never sample EOS, so every rollout row ends at a length drawn from a log-normal (median --median,
sigma --sigma, capped at --max-completion), as if it had sampled EOS there (ForcedLengths); a real checkpoint's
EOS is ignored the same way, so every method decodes the same lengths. on_part(result) follows every part.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.e2e_workers import _random_reward, device_and_dtype, random_batch, random_prompts
from bench.gpu_lock import GpuLock
from bench.random_models import LINEAR_TARGETS, attach_lora, build_random_model, qwen25_config
from bench.common import sync

# method -> (train.mode, base weight format); the paper's Table 3 rows
METHODS = {"lora": ("lora", "bf16"), "qlora": ("qlora_nf4", "nf4"), "qerl": ("qlora_fp4", "nvfp4")}
ROW_KEYS = {"lora": "bf16_lora", "qlora": "nf4_lora", "qerl": "nvfp4_lora"}
# Qwen2.5-3B-Instruct's public config (bench.random_models holds 7B/14B/32B): tied embeddings
SHAPES_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def model_config(size: str):
    return qwen25_config("7B", **SHAPES_3B) if size == "3B" else qwen25_config(size)


def draw_lengths(rows: int, median: float, sigma: float, cap: int, seed: tuple[int, ...]) -> list[int]:
    """Completion lengths ~ round(exp(N(log median, sigma))) clipped to [1, cap] (bench.paged's law), fixed by the
    seed tuple, so every method decodes the same lengths."""
    z = np.random.default_rng(list(seed)).standard_normal(rows)
    return np.clip(np.round(median * np.exp(sigma * z)), 1, cap).astype(int).tolist()


WARMUP_TOKENS = 48  # a paged warm-up's longest row: enough steps to meet every decode bucket (bench.paged)


class ForcedLengths:
    """Rows of a rollout engine that end at drawn lengths, as if each had sampled EOS there. The engine's own
    generate is replaced on the instance, so every path to it (the trainer's policy_rollout included) is forced.

    TorchEngine: a call keeps max_tokens (its CUDA-graph key and KV bucket stay those of the cap) and stops after
    the longest drawn row, as a static batch does when its last row sees EOS; each row is then cut to its length
    (finish reason "stop"). warm_up calls (their own early stop set) pass through unforced and draw nothing.
    PagedEngine: each row finishes ("stop") at its length inside the engine, so finished rows leave the batch as
    they would with EOS (bench.paged.ForcedLengthEngine's rule); its warm_up (added here: the paged engine has
    none) runs rows that end after 1..WARMUP_TOKENS tokens, falling geometrically, so that every decode bucket
    is compiled and captured before a timed call."""

    def __init__(self, engine, median: float, sigma: float, cap: int, seed: int):
        self.engine, self.median, self.sigma, self.cap, self.seed = engine, median, sigma, cap, seed
        self.calls: dict[int, int] = {}  # rows -> calls so far: the k-th call of a width draws the same everywhere
        self.paged = paged(engine)
        self.row_lengths: list[int] | None = None  # a paged call's lengths, by row
        self._generate = engine.generate
        engine.generate = self.generate
        if self.paged:
            self._finish = engine._finish_reasons
            engine._finish_reasons = self._finish_reasons
            engine.warm_up = self.warm_up

    def lengths(self, rows: int) -> list[int]:
        k = self.calls.get(rows, 0)
        self.calls[rows] = k + 1
        return draw_lengths(rows, self.median, self.sigma, self.cap, (self.seed, rows, k))

    def generate(self, prompt_ids, n: int = 1, sampling=None):
        from qerl.rollout import RolloutOutput

        if self.paged:
            return self._paged(prompt_ids, n, sampling, self.lengths(len(prompt_ids) * n))
        if self.engine._stop_after is not None:  # a warm_up call
            return self._generate(prompt_ids, n=n, sampling=sampling)
        lengths = self.lengths(len(prompt_ids) * n)
        self.engine._stop_after = max(lengths) - 1  # index of the last token sampled (the engine's warm_up knob)
        try:
            out = self._generate(prompt_ids, n=n, sampling=sampling)
        finally:
            self.engine._stop_after = None
        return RolloutOutput(prompt_ids=out.prompt_ids, stats=out.stats,
                             completion_ids=[ids[:k] for ids, k in zip(out.completion_ids, lengths)],
                             logprobs=[lps[:k] for lps, k in zip(out.logprobs, lengths)],
                             finish_reasons=["stop"] * len(lengths))

    def _paged(self, prompt_ids, n, sampling, lengths):
        self.row_lengths = lengths
        try:
            return self._generate(prompt_ids, n=n, sampling=sampling)
        finally:
            self.row_lengths = None

    def _finish_reasons(self, seqs, tokens, sampling):
        from bench.paged import end_at_lengths

        return end_at_lengths(self._finish(seqs, tokens, sampling), seqs, self.row_lengths)

    def warm_up(self, prompt_ids, n: int = 1, sampling=None) -> dict:
        """The paged engine's warm-up: its buckets compiled and captured, no length drawn; returns what it did."""
        from bench.paged import warmup_lengths

        rows = len(prompt_ids) * n
        out = self._paged(prompt_ids, n, sampling, warmup_lengths(rows, min(WARMUP_TOKENS, self.cap)))
        return {k: v for k, v in out.stats.items() if isinstance(v, (int, float))}


def captures(engine) -> int:
    """CUDA graphs captured: TorchEngine counts over its life, PagedEngine's `stats` are its last call's."""
    return int(engine.stats.get("graph_captures", 0))


def state_dict_bytes(model) -> int:
    """Bytes of every tensor of the model's state dict, shared ones once: what save_pretrained writes."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.data_ptr(), t.numel()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _checkpoint_policy(spec: dict, device: str, dtype: torch.dtype, lora_r: int):
    from qerl.policy import LoraSpec, load_policy

    path = Path(spec["checkpoint"])
    model, tokenizer = load_policy(path, mode=METHODS[spec["method"]][0], dtype=dtype, device=device,
                                   lora=LoraSpec(r=lora_r, alpha=2 * lora_r), gradient_checkpointing=True)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return model, tokenizer, {"weights": "checkpoint", "checkpoint": str(path), "model_bytes": size,
                              "size_source": "safetensors files of the checkpoint"}


def _random_policy(spec: dict, args, device: str, dtype: torch.dtype, lora_r: int):
    from peft import get_peft_model
    from transformers import AutoTokenizer

    from qerl.policy import LoraSpec

    method = spec["method"]
    model = build_random_model(model_config(spec["size"]), fp4=method == "qerl", device=device, dtype=dtype,
                               seed=args.seed)
    if method == "qlora":
        from qerl.quant.nf4 import quantize_linears_nf4

        quantize_linears_nf4(model, dtype, LINEAR_TARGETS)
    size = state_dict_bytes(model)
    if method == "qlora":  # peft's LoRA for bitsandbytes layers, as qerl.policy attaches it in mode qlora_nf4
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, LoraSpec(r=lora_r, alpha=2 * lora_r).to_config()).train()
    else:
        model = attach_lora(model, r=lora_r, alpha=2 * lora_r, fp4=method == "qerl", gradient_checkpointing=True)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    return model, tokenizer, {"weights": f"random, Qwen2.5-{spec['size']} shapes", "checkpoint": None,
                              "model_bytes": size, "size_source": "state-dict bytes of the base model"}


def make_trainer(model, tokenizer, prompts, spec: dict, args, lora_r: int, batch: int):
    """The project's GRPOTrainer on random prompts and a random reward (no AQN: speed is the same with it)."""
    import tempfile

    from qerl.config import TrainConfig
    from qerl.trainer import GRPOTrainer

    cfg = TrainConfig(mode=METHODS[spec["method"]][0], data={"source": "bench"},
                      rewards=["bench.e2e_workers:_random_reward"], num_generations=args.group, batch_size=batch,
                      micro_batch_size=args.micro_batch, max_steps=1000, max_completion_length=args.max_completion,
                      gradient_checkpointing=True, aqn=None, lora={"lora_r": lora_r, "lora_alpha": 2 * lora_r},
                      rollout={"engine": getattr(args, "engine", "torch"),
                               "compile": "auto" if args.compile == "auto" else False}, seed=args.seed)
    return GRPOTrainer(cfg, model, tokenizer, prompts, ["0"] * len(prompts), [("random", _random_reward, 1.0)],
                       checkpoint_dir=tempfile.mkdtemp(prefix="qerl-table3-"))


def _rollout(engine, tokenizer, rows: int, args, lock: GpuLock) -> dict:
    """`rows` prompts, one completion each, up to --max-completion tokens: warm-up beside others, timed alone."""
    from qerl.rollout import SamplingParams

    prompts = random_prompts(tokenizer, rows, args.prompt_len, args.seed + rows)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_completion, seed=args.seed)
    with lock.shared():
        warm = engine.warm_up(prompts, n=1, sampling=sampling)
        sync()
    before = captures(engine)
    with lock.exclusive():
        sync()
        start = time.perf_counter()
        out = engine.generate(prompts, n=1, sampling=sampling)
        sync()
        seconds = time.perf_counter() - start
    lengths = [len(c) for c in out.completion_ids]
    timed = _captured(engine, before)
    if paged(engine):  # its pool (a share of the free memory, kept by the engine) goes back to the other workers
        engine.sleep()
    return {"rows": rows, "tokens": sum(lengths), "seconds": seconds, "tokens_per_s": sum(lengths) / seconds,
            "decode_steps": max(lengths), "lengths": lengths, "warm_up": warm, "captures_while_timed": timed}


def paged(engine) -> bool:
    from qerl.rollout.paged_engine import PagedEngine

    return isinstance(engine, PagedEngine)


def _captured(engine, before: int) -> int:
    """Graphs captured by the engine's last call (paged: its stats are that call's) or since `before` (torch)."""
    return captures(engine) if paged(engine) else captures(engine) - before


def _e2e(trainer, batch: int, args, lock: GpuLock, first_step: int) -> dict:
    """Steps of `batch` prompts x G: warm-up beside others, then --steps timed steps, each alone on the GPU."""
    cfg = trainer.cfg = trainer.cfg.model_copy(update={"batch_size": batch})
    device = next(trainer.model.parameters()).device
    prompts = [trainer.prompts[i] for i in trainer.batch_indices(first_step)]
    with lock.shared():
        warm = trainer.engine.warm_up(prompts, n=cfg.num_generations, sampling=trainer.sampling(first_step))
        trainer.update(random_batch(min(cfg.micro_batch_size, batch * cfg.num_generations), args.prompt_len,
                                    args.max_completion, device, args.seed), first_step)
        sync()
    steps = []
    for step in range(first_step, first_step + args.steps):
        before = captures(trainer.engine)
        with lock.exclusive():
            sync()
            start = time.perf_counter()
            data = trainer.rollout(step)
            trainer.engine.sleep()
            metrics = trainer.update(data, step)
            sync()
            seconds = time.perf_counter() - start
        steps.append({"step_seconds": seconds, "rollout_seconds": data.metrics["timing/rollout"],
                      "update_seconds": metrics["timing/update"], "rows": data.input_ids.shape[0],
                      "rollout_tokens": data.metrics["rollout_tokens"], "completion_len": data.completion_len,
                      "loss": metrics["loss"], "captures_while_timed": _captured(trainer.engine, before)})
    return {"prompts": batch, "rows": batch * cfg.num_generations, "warm_up": warm, "steps": steps,
            "step_seconds": statistics.mean(s["step_seconds"] for s in steps)}


LOST = "cuda_context_lost"  # result key: a sticky CUDA error ended this process's use of the GPU


def part_names(rollout_batches, e2e_batches) -> list[str]:
    """The parts' names in a result's `errors`: rollout_b<rows>, then e2e_b<prompts>."""
    return [f"rollout_b{r}" for r in rollout_batches] + [f"e2e_b{b}" for b in e2e_batches]


def cuda_alive() -> bool:
    """False after a sticky CUDA error (an illegal address, a device-side assert): every later CUDA call fails."""
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return True
    except Exception:  # noqa: BLE001 - whatever the error, the context is unusable
        return False


def _guard(result: dict, name: str, fn) -> None:
    """One part; its exception is recorded (type and message) and the other parts still run, unless the CUDA
    context is lost: then `cuda_context_lost` is set and the worker skips the rest (a fresh process may pass)."""
    if result.get(LOST):
        result["errors"][name] = "not run: the CUDA context was lost in an earlier part"
        return
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what failed and goes on
        result["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
        if not cuda_alive():
            result[LOST] = True


def measure(spec: dict, args, on_part=None, previous: dict | None = None) -> dict:
    """The Table 3 figures of one experiment (spec: name, size, method, checkpoint or None); see the module doc.
    previous: an earlier run's JSON whose figures are kept (the parts measured now replace theirs and their errors)."""
    on_part = on_part or (lambda result: None)
    device, dtype = device_and_dtype(args.device)
    lock, lora_r = GpuLock(getattr(args, "gpu_lock", None)), spec.get("lora_r") or args.lora_r
    start = time.perf_counter()
    result = {"experiment": spec["name"], "model_size": spec["size"], "method": spec["method"],
              "row_key": ROW_KEYS[spec["method"]], "train_mode": METHODS[spec["method"]][0],
              "rollout_tokens_per_s": {}, "e2e_step_seconds": {}, "rollout": {}, "e2e": {}, "errors": {}}
    for key in ("rollout_tokens_per_s", "e2e_step_seconds", "rollout", "e2e", "errors"):
        result[key].update((previous or {}).get(key, {}))
    for part in part_names(args.rollout_batches, args.e2e_batches):
        result["errors"].pop(part, None)
    with lock.shared():
        real = spec.get("checkpoint") and Path(spec["checkpoint"], "config.json").is_file()
        model, tokenizer, about = (_checkpoint_policy(spec, device, dtype, lora_r) if real
                                   else _random_policy(spec, args, device, dtype, lora_r))
        result.update(about, model_size_gb=round(about["model_bytes"] / 1e9, 2))
        prompts = random_prompts(tokenizer, max([*args.e2e_batches, 1]) * 4, args.prompt_len, args.seed)
        trainer = make_trainer(model, tokenizer, prompts, spec, args, lora_r, max([*args.e2e_batches, 1]))
    engine = trainer.engine
    if args.compile == "off" and not paged(engine):
        engine.use_compile = False
    ForcedLengths(engine, args.median, args.sigma, args.max_completion, args.seed)
    on_part(result)
    for rows in args.rollout_batches:
        def rollout(rows=rows):
            part = result["rollout"][str(rows)] = _rollout(trainer.engine, tokenizer, rows, args, lock)
            result["rollout_tokens_per_s"][str(rows)] = round(part["tokens_per_s"], 2)
        _guard(result, *part_names([rows], []), rollout)
        on_part(result)
    for i, batch in enumerate(args.e2e_batches):
        def e2e(batch=batch, i=i):
            part = result["e2e"][str(batch)] = _e2e(trainer, batch, args, lock, first_step=100 * (i + 1))
            result["e2e_step_seconds"][str(batch)] = round(part["step_seconds"], 3)
        _guard(result, *part_names([], [batch]), e2e)
        on_part(result)
    is_paged = paged(engine)
    result.update(engine="paged" if is_paged else "torch", compile=engine.compile if is_paged else engine.use_compile,
                  cuda_graph=engine.device.type == "cuda" if is_paged else engine.use_cuda_graph,
                  gpu_lock_wait_s=round(lock.waited_s, 1), wall_seconds=round(time.perf_counter() - start, 1))
    if not result.get(LOST):
        engine.close()
    return result
