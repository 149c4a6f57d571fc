"""Floors and the Markdown table of `bench.e2e` (pure arithmetic on its JSON, testable anywhere).

Floors use the ceilings measured in the same run (device-to-device copy bandwidth, dense bf16 matmul rate):
  rollout, weights: one decode step must read every weight once -> rows / (weight bytes / bandwidth) tokens/s;
  rollout, weights + KV: plus the KV cache the static-cache decode step reads (every row, whole bucketed length);
  GRPO step: new_tokens such decode steps + the update's matmul FLOPs (forward, recompute, input-gradient
  backward; frozen base: no weight gradients) / bf16 rate.
"""
from __future__ import annotations

import math

GIB = 2**30
_STATIC_BUCKET = 128  # qerl.rollout.torch_engine rounds the static KV length up to this
MEMORY_LIMIT_GIB = 75.0


def _cache_len(prompt_len: int, new_tokens: int) -> int:
    return math.ceil((prompt_len + new_tokens) / _STATIC_BUCKET) * _STATIC_BUCKET


def _kv_bytes(size: str, rows: int, cache_len: int) -> int:
    from bench.random_models import kv_bytes_per_step, qwen25_config

    return kv_bytes_per_step(qwen25_config(size), rows, cache_len)


def update_flops(size: str, rows: int, prompt_len: int, completion_len: int) -> float:
    """Matmul FLOPs of one GRPO update with gradient checkpointing over a frozen base (LoRA's are negligible)."""
    from bench.random_models import qwen25_config

    c = qwen25_config(size)
    head_dim = c.hidden_size // c.num_attention_heads
    kv_dim = c.num_key_value_heads * head_dim
    linear = c.hidden_size * (2 * c.hidden_size + 2 * kv_dim) + 3 * c.hidden_size * c.intermediate_size
    seq = prompt_len + completion_len
    tokens = rows * seq
    lin = 2 * linear * c.num_hidden_layers * tokens
    attn = 2 * 2 * (seq / 2) * c.hidden_size * c.num_hidden_layers * tokens  # QK^T and PV, causal half
    head = 2 * c.vocab_size * c.hidden_size * rows * completion_len
    return 3 * lin + 4 * attn + 3 * head  # fwd + recompute + grad_input; attention backward is ~2x forward


def _rollout_floors(row: dict, weight_bytes: int, size: str, prompt_len: int, bw: float) -> None:
    kv = _kv_bytes(size, row["batch"], _cache_len(prompt_len, row["new_tokens"]))
    row["floor_weights_tokens_per_s"] = row["batch"] / (weight_bytes / bw)
    row["floor_weights_kv_tokens_per_s"] = row["batch"] / ((weight_bytes + kv) / bw)
    row["pct_of_weight_floor"] = 100 * row["tokens_per_s"] / row["floor_weights_tokens_per_s"]


def add_floors(payload: dict) -> None:
    """Add floors (when ceilings were measured) and FP4-over-bf16 ratios to payload['speed'] in place."""
    ceil = payload.get("ceilings")
    prompt_len = payload["config"]["prompt_len"]
    by_mode = {r.get("mode"): r for r in payload.get("speed", [])}
    for res in payload.get("speed", []):
        if not ceil or "decode_weight_bytes" not in res:
            continue
        bw, rate = ceil["copy_GBps"] * 1e9, ceil["bf16_tflops"] * 1e12
        for row in res.get("rollout", []) + ([res["hf_generate"]] if "hf_generate" in res else []):
            _rollout_floors(row, res["decode_weight_bytes"], res["size"], prompt_len, bw)
        step = res.get("grpo_step")
        if step:
            kv = _kv_bytes(res["size"], step["rows"], _cache_len(step["prompt_len"], step["completion_len"]))
            rollout = step["completion_len"] * (res["decode_weight_bytes"] + kv) / bw
            update = update_flops(res["size"], step["rows"], step["prompt_len"], step["completion_len"]) / rate
            step.update(floor_rollout_seconds=rollout, floor_update_seconds=update,
                        floor_step_seconds=rollout + update)
    fp4, bf16 = by_mode.get("fp4"), by_mode.get("bf16")
    if fp4 and bf16:
        base = {r["batch"]: r["tokens_per_s"] for r in bf16.get("rollout", [])}
        for row in fp4.get("rollout", []):
            if row["batch"] in base:
                row["x_bf16"] = row["tokens_per_s"] / base[row["batch"]]
        if fp4.get("grpo_step") and bf16.get("grpo_step"):
            fp4["grpo_step"]["x_bf16"] = bf16["grpo_step"]["step_seconds"] / fp4["grpo_step"]["step_seconds"]


def _f(value, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def _rollout_table(payload: dict) -> list[str]:
    lines = ["| mode | engine | batch | new tokens | s | tokens/s | x bf16 | floor (weights) tok/s | % of floor "
             "| floor (weights+KV) tok/s | warm-up s |", "|---" * 11 + "|"]
    for res in payload.get("speed", []):
        rows = [("torch", r) for r in res.get("rollout", [])]
        rows += [("hf generate", res["hf_generate"])] if "hf_generate" in res else []
        for engine, r in rows:
            lines.append(f"| {res['mode']} | {engine} | {r['batch']} | {r['new_tokens']} | {_f(r['seconds'], '.2f')} "
                         f"| {_f(r['tokens_per_s'])} | {_f(r.get('x_bf16'), '.2f')} "
                         f"| {_f(r.get('floor_weights_tokens_per_s'))} | {_f(r.get('pct_of_weight_floor'))}% "
                         f"| {_f(r.get('floor_weights_kv_tokens_per_s'))} "
                         f"| {_f(r.get('warm_up_seconds'), '.1f')} |")
    return lines


def _step_table(payload: dict) -> list[str]:
    lines = ["| mode | rows x (prompt + completion) | rollout s | update s | step s | x bf16 | floor s "
             "(rollout + update) | peak GiB |", "|---" * 8 + "|"]
    for res in payload.get("speed", []):
        s = res.get("grpo_step")
        if not s:
            continue
        floor = (f"{_f(s.get('floor_step_seconds'), '.1f')} ({_f(s.get('floor_rollout_seconds'), '.1f')} + "
                 f"{_f(s.get('floor_update_seconds'), '.1f')})")
        peak = None if s.get("peak_bytes") is None else s["peak_bytes"] / GIB
        lines.append(f"| {res['mode']} | {s['rows']} x ({s['prompt_len']} + {s['completion_len']}) "
                     f"| {_f(s['rollout_seconds'], '.1f')} | {_f(s['update_seconds'], '.1f')} "
                     f"| {_f(s['step_seconds'], '.1f')} | {_f(s.get('x_bf16'), '.2f')} | {floor} | {_f(peak, '.1f')} |")
    return lines


# Kernel-name fragments of each part of an update (torch.profiler names; first match wins, the rest is "other").
KERNEL_KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "splitkreduce", "_fp4_mm", "_small_mm", "fp4_gemv")),
                ("attention", ("sdpa", "flash", "fmha", "cudnn")),
                ("dequant", ("_dequant_kernel",)))


def update_breakdown(profile: dict) -> dict:
    """Seconds per update by kernel kind (KERNEL_KINDS, "other" = the rest incl. kernels beyond the profile's top
    list), GPU total, GPU idle and wall, from `--profile-update`'s grpo_step.update_profile."""
    parts = {kind: 0.0 for kind, _ in KERNEL_KINDS}
    for row in profile.get("top", []):
        name = row["name"].lower()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in name for f in frags)), None)
        if kind:
            parts[kind] += row["us_per_update"] / 1e6
    total = profile["gpu_us_per_update"] / 1e6
    return {**parts, "other": total - sum(parts.values()), "gpu": total, "idle": profile["gpu_idle_us"] / 1e6,
            "wall": profile["seconds_profiled"]}


def _update_profile_table(payload: dict) -> list[str]:
    rows = [(r["mode"], r["grpo_step"]["update_profile"]) for r in payload.get("speed", [])
            if (r.get("grpo_step") or {}).get("update_profile")]
    if not rows:
        return []
    kinds = [k for k, _ in KERNEL_KINDS] + ["other"]
    lines = ["", "(c) One update under torch.profiler, seconds", "",
             "| mode | " + " | ".join(kinds) + " | GPU total | GPU idle | wall | kernels |",
             "|---" * (len(kinds) + 5) + "|"]
    for mode, prof in rows:
        b = update_breakdown(prof)
        lines.append(f"| {mode} | " + " | ".join(_f(b[k], ".2f") for k in kinds)
                     + f" | {_f(b['gpu'], '.2f')} | {_f(b['idle'], '.2f')} | {_f(b['wall'], '.2f')} "
                     f"| {_f(prof.get('kernels_per_update'))} |")
    return lines


def _memory_table(payload: dict) -> list[str]:
    mem = payload.get("memory", [])
    def ref_of(m):  # 7B bf16 LoRA at the same micro-batch, offload and MLP slicing
        return next((r.get("peak_bytes") for r in mem if r.get("size") == "7B" and r.get("mode") == "bf16"
                     and r.get("rows") == m.get("rows") and r.get("offload") == m.get("offload")
                     and r.get("mlp_chunks", 1) == m.get("mlp_chunks", 1)), None)

    lines = ["| model | mode | tokens | offload, MLP slices | model GiB | peak GiB | <= 75 GiB | vs 7B bf16 LoRA (same "
             "setting) |",
             "|---" * 8 + "|"]
    for m in mem:
        ref = ref_of(m)
        peak = m.get("peak_bytes")
        model = None if m.get("model_bytes") is None else m["model_bytes"] / GIB
        tokens = f"{m['rows']} x ({m['prompt_len']} + {m['completion_len']})" if "rows" in m else "-"
        fits = "-" if peak is None else ("yes" if peak / GIB <= MEMORY_LIMIT_GIB else "no")
        ratio = "-" if peak is None or not ref else f"{100 * peak / ref:.0f}%"
        lines.append(f"| {m.get('size')} | {m.get('mode')} | {tokens} | {'yes' if m.get('offload') else 'no'}, "
                     f"{m.get('mlp_chunks', 1)} "
                     f"| {_f(model, '.1f')} "
                     f"| {_f(None if peak is None else peak / GIB, '.1f')} | {fits} | {ratio} |")
    return lines


def _errors(payload: dict) -> list[str]:
    out = []
    for res in payload.get("memory", []) + payload.get("speed", []):
        for part, msg in (res.get("errors") or {}).items():
            out.append(f"- {res.get('size')} {res.get('mode')} {part}: {msg}")
    return (["", "Errors:"] + out) if out else []


def markdown(payload: dict) -> str:
    ceil = payload.get("ceilings") or {}
    head = (f"Device: **{payload['device']}**, {payload['date']}, torch {payload['torch']}. Ceilings: copy "
            f"{_f(ceil.get('copy_GBps'))} GB/s, bf16 matmul {_f(ceil.get('bf16_tflops'))} TFLOP/s.")
    config = payload.get("config") or {}
    lora = "fused" if config.get("fused_lora", "on") == "on" else "peft"
    elementwise = "compiled" if config.get("fused_elementwise", "off") == "on" else "eager"
    return "\n".join([head, "", "(b) Rollout", ""] + _rollout_table(payload)
                     + ["", f"(c) One GRPO step (LoRA ops: {lora}; RMSNorm, SiLU * up, log-probs: {elementwise})", ""]
                     + _step_table(payload) + _update_profile_table(payload)
                     + ["", "(d) Peak memory of one GRPO update", ""]
                     + _memory_table(payload) + _errors(payload))
