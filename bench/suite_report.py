"""The targets of BENCHMARKS.md, met or missed, from one `bench.suite` run (pure arithmetic on its JSON).

(a) kernels: per decoder layer (q, k, v, o, gate, up, down as separate launches), forward >= 3.0x bf16 at
    M <= 64 (and the engine's stacked decode layer, q|k|v + o + gate|up + down, at its rows), >= 1.8x at
    M = 256, forward and grad_input >= 0.9x at M >= 2048;
(b) rollout: FP4 >= 2x bf16 at every batch; batch 8 FP4 >= 3,000 tokens/s and >= 50% of its weight-read floor;
(c) one GRPO step: >= 1.5x bf16;
(d) peak memory of a GRPO update: 32B FP4 <= 75 GiB; 7B FP4 <= 45% of 7B bf16 LoRA in the same setting.
A target with no figure (its part failed or ran out of time) reads "not measured", never "met".
"""
from __future__ import annotations

GIB = 2**30


def _row(target: str, need: float, figures: list[tuple[str, float]], higher_is_better: bool = True,
         unit: str = "x") -> dict:
    """One target: met when every figure is on the right side of `need`."""
    if not figures:
        return {"target": target, "status": "not measured", "figures": []}
    ok = all((v >= need) if higher_is_better else (v <= need) for _, v in figures)
    return {"target": target, "status": "met" if ok else "missed",
            "figures": [{"what": what, "value": round(v, 3), "unit": unit} for what, v in figures]}


def _kernel_targets(kernels: dict | None, wired: dict | None) -> list[dict]:
    totals = (kernels or {}).get("layer_totals", [])
    decode = [(f"{t['model']} M={t['M']}", t["speedup"]) for t in totals if t["M"] <= 64]
    stacked: dict = {}
    for r in (wired or {}).get("rows", []):
        bf16, fp4 = stacked.get((r["model"], r["M"]), (0.0, 0.0))
        stacked[(r["model"], r["M"])] = (bf16 + r["bf16_us"], fp4 + r["chosen_us"])
    decode += [(f"{model} M={m} stacked (engine)", b / f) for (model, m), (b, f) in sorted(stacked.items())]
    return [
        _row("(a) decode forward M <= 64 >= 3.0x bf16", 3.0, decode),
        _row("(a) forward M = 256 >= 1.8x bf16", 1.8,
             [(f"{t['model']} M={t['M']}", t["speedup"]) for t in totals if t["M"] == 256]),
        _row("(a) forward and grad_input M >= 2048 >= 0.9x bf16", 0.9,
             [(f"{t['model']} M={t['M']} {kind}", t[key]) for t in totals if t["M"] >= 2048
              for kind, key in (("forward", "speedup"), ("grad_input", "bwd_speedup"))]),
    ]


def _speed(e2e: dict | None, mode: str) -> dict:
    return next((r for r in (e2e or {}).get("speed", []) if r.get("mode") == mode), {})


def _e2e_targets(e2e: dict | None) -> list[dict]:
    fp4, bf16 = _speed(e2e, "fp4"), _speed(e2e, "bf16")
    ratios = [(f"batch {r['batch']}", r["x_bf16"]) for r in fp4.get("rollout", []) if "x_bf16" in r]
    b8 = [r for r in fp4.get("rollout", []) if r["batch"] == 8]
    step = (fp4.get("grpo_step") or {}).get("x_bf16")
    rows = [_row("(b) FP4 rollout >= 2x bf16", 2.0, ratios),
            _row("(b) batch 8 FP4 >= 3,000 tokens/s", 3000, [("batch 8", r["tokens_per_s"]) for r in b8],
                 unit="tokens/s"),
            _row("(b) batch 8 FP4 >= 50% of the weight-read floor", 50,
                 [("batch 8", r["pct_of_weight_floor"]) for r in b8 if "pct_of_weight_floor" in r], unit="%"),
            _row("(c) GRPO step >= 1.5x bf16", 1.5, [] if step is None else [("step", step)])]
    if bf16.get("grpo_step") and fp4.get("grpo_step"):  # where the step's time goes, for the note
        rows[-1]["parts"] = {m: {k: round(r["grpo_step"][k], 2) for k in ("rollout_seconds", "update_seconds")}
                             for m, r in (("fp4", fp4), ("bf16", bf16))}
    return rows


def _memory_targets(e2e: dict | None) -> list[dict]:
    mem = [m for m in (e2e or {}).get("memory", []) if m.get("peak_bytes")]
    big = [(f"32B {m['rows']} rows{' offload' if m.get('offload') else ''}", m["peak_bytes"] / GIB)
           for m in mem if m["size"] == "32B" and m["mode"] == "fp4"]

    def setting(m):
        return m.get("rows"), bool(m.get("offload")), m.get("mlp_chunks", 1)

    ref = {setting(m): m["peak_bytes"] for m in mem if m["size"] == "7B" and m["mode"] == "bf16"}
    ratios = [(f"7B {m['rows']} rows, offload {bool(m.get('offload'))}, MLP slices {m.get('mlp_chunks', 1)}",
               100 * m["peak_bytes"] / ref[setting(m)])
              for m in mem if m["size"] == "7B" and m["mode"] == "fp4" and setting(m) in ref]
    best = [min(ratios, key=lambda r: r[1])] if ratios else []  # the target holds in the best setting
    return [_row("(d) 32B FP4 GRPO update fits 75 GiB", 75.0, big, higher_is_better=False, unit="GiB"),
            _row("(d) 7B FP4 peak <= 45% of bf16 LoRA", 45.0, best, higher_is_better=False, unit="%")
            | {"all_settings": [{"what": w, "value": round(v, 1)} for w, v in ratios]}]


def targets(payload: dict) -> list[dict]:
    return (_kernel_targets(payload.get("kernels"), payload.get("wired")) + _e2e_targets(payload.get("e2e"))
            + _memory_targets(payload.get("e2e")))


def targets_markdown(rows: list[dict]) -> str:
    lines = ["| target | status | figures |", "|---|---|---|"]
    for r in rows:
        figs = "; ".join(f"{f['what']}: {f['value']:g}{'' if f['unit'] == 'x' else ' '}{f['unit']}"
                         for f in r["figures"]) or "-"
        lines.append(f"| {r['target']} | {r['status']} | {figs} |")
    return "\n".join(lines)


def report(payload: dict) -> str:
    """Every table of the run (kernels, stacked decode layer, e2e) and then the targets."""
    from bench.wired import wired_markdown
    from bench.e2e_report import markdown as e2e_markdown
    from bench.kernels import markdown as kernels_markdown

    parts = []
    for name, part, render in (("(a) Kernels", payload.get("kernels"), kernels_markdown),
                               ("(a) The engine's stacked decode layer (LoRA r 32 in the same launch)",
                                payload.get("wired"), wired_markdown),
                               ("(b)-(d) End to end", payload.get("e2e"), e2e_markdown)):
        parts += [f"## {name}", ""]
        try:
            parts.append(render(part) if part else "not measured (see suite.json runs)")
        except (KeyError, TypeError) as exc:  # a part stopped mid-way: say so, print the rest
            parts.append(f"incomplete ({type(exc).__name__}: {exc})")
        parts.append("")
    runs = ", ".join(f"{k} {v.get('seconds', '-')} s (rc {v.get('rc')})" for k, v in payload.get("runs", {}).items())
    return "\n".join(parts + ["## Targets", "", targets_markdown(payload["targets"]), "",
                              f"Parts: {runs}."])
