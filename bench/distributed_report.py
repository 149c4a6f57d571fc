"""bench.distributed's report: speed-ups, the rollout's tail across ranks, the memory estimate (qerl/memory.py) beside
the measured peaks, the printed table and the JSON."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

TAIL_ROWS = 32  # "tail": decode steps of at most this many live rows (the engine's decode_1_32 bin)


def case_parts(case: str) -> tuple[str, int]:
    """("fp4-lora", 2) of "fp4-lora-x2"."""
    label, _, n = case.rpartition("-x")
    return label, int(n)


def speedups(results: list[dict]) -> dict[str, float]:
    """Step-seconds ratios of the cases that ran: every fp4-lora-xN (N > 1) against fp4-lora-x1, and every full-xN
    against the fewest-rank full case, each keyed "<case> vs <baseline>"."""
    done = {r["case"]: r for r in results if "error" not in r}
    out = {}
    for label, base_n in (("fp4-lora", 1), ("full", None)):
        runs = sorted((case_parts(c)[1], r) for c, r in done.items() if case_parts(c)[0] == label)
        if not runs:
            continue
        base = done.get(f"{label}-x{base_n}") if base_n is not None else runs[0][1]
        for n, r in runs:
            if base is not None and r is not base:
                out[f"{r['case']} vs {base['case']}"] = base["step_s"] / r["step_s"]
    return out


def speedup_lines(results: list[dict]) -> list[str]:
    lines = []
    for key, s in speedups(results).items():
        case, _, base = key.partition(" vs ")
        (label, n), (_, m) = case_parts(case), case_parts(base)
        lines.append(f"speed-up {label} {n} GPUs vs {m}: x{s:.2f} (same global batch)")
    return lines


def tail_fields(per_rank: dict[str, list[float]]) -> dict:
    """The rollout's tail across ranks from the per-rank lists (rollout_s, decode_steps, tail_s, longest_row): the
    slowest and fastest rank's rollout seconds and the slowest rank's seconds in steps of <= TAIL_ROWS rows."""
    per_rank = {**per_rank, **{k: [int(v) for v in per_rank[k]] for k in ("decode_steps", "longest_row")}}
    slowest = max(range(len(per_rank["rollout_s"])), key=per_rank["rollout_s"].__getitem__)
    return {"rollout_s_slowest": max(per_rank["rollout_s"]), "rollout_s_fastest": min(per_rank["rollout_s"]),
            "slowest_rank": slowest, "tail_s": per_rank["tail_s"][slowest],
            **{f"{k}_per_rank": per_rank[k] for k in ("rollout_s", "decode_steps", "tail_s", "longest_row")}}


# ------------------------------------------------------------------ the memory estimate beside the measured peaks
def shape_of(size: str):
    """qerl.memory's Shape of the bench's model size (its own table; the bench's config for sizes it lacks)."""
    from bench.random_models import qwen25_config
    from qerl.memory import SHAPES, Shape

    if size in SHAPES:
        return SHAPES[size]
    c = qwen25_config(size)
    return Shape(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                 c.num_key_value_heads, c.hidden_size // c.num_attention_heads, c.vocab_size, c.tie_word_embeddings)


def memory_estimate(size: str, mode: str, train, ranks: int) -> dict:
    """qerl.memory.rank_memory_gib (GiB) for one of `ranks` ranks of this TrainConfig: its total, its terms, and its
    two phases, update and rollout (the paged pool is no term of the estimate: it takes a fraction of whatever is
    free)."""
    from qerl.memory import rank_memory_gib

    est = rank_memory_gib(shape_of(size), "nvfp4" if mode == "fp4" else "bf16", train, ranks)
    phases = ("total", "update_total", "rollout_total")
    return {"update": round(est["update_total"], 4), "rollout": round(est["rollout_total"], 4),
            "total": round(est["total"], 4), "terms": {k: round(v, 4) for k, v in est.items() if k not in phases}}


def memory_fields(estimate: dict, result: dict) -> dict:
    """Estimated vs measured GiB per GPU and their ratios measured / estimated (the fullest rank). The estimate
    leaves what is free to what takes it where memory allows: measured are the update's peak without what the engine
    kept through it (a resident pool, weight copies, graphs) and without the update's own dense copies of an FP4
    base (qerl.update_copies), and the rollout's peak without its KV pool and the weight copies it takes
    (qerl.quant.dense_copies, humming_copies)."""
    resident = result.get("engine_resident_gib") or [0.0] * len(result["update_peak_gib"])
    own = result.get("update_copies_gib") or [0.0] * len(result["update_peak_gib"])
    copies = result.get("weight_copies_gib") or [0.0] * len(result["rollout_peak_gib"])
    measured = {"update": max(u - r - c for u, r, c in zip(result["update_peak_gib"], resident, own)),
                "rollout": max(a - k - c for a, k, c in zip(result["rollout_peak_gib"], result["kv_pool_gib"], copies)),
                "update_with_engine": max(result["update_peak_gib"]),
                "rollout_with_pool": max(result["rollout_peak_gib"])}
    ratio = {k: round(measured[k] / estimate[k], 3) if estimate[k] else None for k in ("update", "rollout")}
    return {"estimate": estimate, "measured": {k: round(v, 2) for k, v in measured.items()}, "ratio": ratio}


# ------------------------------------------------------------------ the table and the JSON
def _ranks(values, fmt: str) -> str:
    return " ".join(format(v, fmt) for v in values)


def table(results: list[dict]) -> str:
    head = f"{'case':13s} {'GPUs':>4s} {'step s':>7s} {'rollout s slow/fast':>19s} {'tail s':>6s} " \
           f"{'update s':>8s} {'tokens/s':>9s}  {'GiB/GPU update est/meas':>23s}  {'rollout est/meas':>16s}"
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:13s} failed: {r['error'][:100]}")
            est = r.get("memory", {}).get("estimate")
            if est:
                lines.append(f"  estimate per GPU (qerl/memory.py): update {est['update']:.1f} GiB, rollout "
                             f"{est['rollout']:.1f} GiB + the KV pool")
            continue
        m = r["memory"]
        e, got = m["estimate"], m["measured"]
        lines.append(f"{r['case']:13s} {r['gpus']:4d} {r['step_s']:7.1f} "
                     f"{r['rollout_s_slowest']:9.1f} /{r['rollout_s_fastest']:8.1f} {r['tail_s']:6.1f} "
                     f"{r['update_s']:8.1f} {r['tokens_per_s']:9,.0f}  "
                     f"{e['update']:11.1f} /{got['update']:10.1f}  {e['rollout']:7.1f} /{got['rollout']:7.1f}")
        lines.append(f"  per rank: rollout s {_ranks(r['rollout_s_per_rank'], '.1f')}; decode steps "
                     f"{_ranks(r['decode_steps_per_rank'], '.0f')}; s in steps of <= {TAIL_ROWS} rows "
                     f"{_ranks(r['tail_s_per_rank'], '.1f')}; longest row {_ranks(r['longest_row_per_rank'], '.0f')}")
        peaks = ", ".join(f"{a:.1f} ({k:.1f}) / {b:.1f}" for a, k, b in
                          zip(r["rollout_peak_gib"], r["kv_pool_gib"], r["update_peak_gib"]))
        ratio = m["ratio"]
        lines.append(f"  peak GiB per GPU, rollout (KV pool) / update: {peaks}; engine kept through the update "
                     f"{_ranks(r.get('engine_resident_gib', []), '.1f')}, weight copies "
                     f"{_ranks(r.get('weight_copies_gib', []), '.1f')}, the update's dense copies "
                     f"{_ranks(r.get('update_copies_gib', []), '.1f')}; measured / estimated: update without the "
                     f"engine and its copies x{ratio['update'] or 0:.2f}, rollout without pool and copies "
                     f"x{ratio['rollout'] or 0:.2f}")
    lines += speedup_lines(results)
    return "\n".join(lines)


def write(args, results: list[dict]) -> None:
    """The JSON, atomically (rewritten after each case: a case cut short keeps the others)."""
    named = sorted({r["device"] for r in results if "device" in r})
    options = {k: v for k, v in vars(args).items() if not k.startswith("worker")}
    found = speedups(results)
    payload = {"device": ", ".join(named) or "unknown", "torch": torch.__version__, "args": options,
               "speedups": found, "speedup_fp4_lora_2_vs_1": found.get("fp4-lora-x2 vs fp4-lora-x1"),
               "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, out)
