"""The paper's Tables 1-3 rebuilt from our runs, side by side with the paper's numbers, plus training curves.

    python -m qerl.tables --experiments-json results/tables/experiments.json --out-dir results/tables
    python -m qerl.tables --config-json "$(config as JSON)" --results-dir results --out-dir results/tables
    python -m qerl.tables --summary results/demo/eval.json     # the accuracies of finished runs, on the console

experiments.json maps an experiment name to
    {"row_key": "nvfp4_lora_aqn", "model_size": "7B", "eval_path": "results/qwen7b-nvfp4-lora-aqn/eval.json",
     "bench_path": "results/bench/qwen7b-nvfp4.json" (optional, Table 3), "metrics_path": "...csv" (optional, plots)}
row_key is one of qerl.paper.ROW_LABELS, or "demo" for the demo task (an extra row, not in the paper).

A cell is filled only from a file that exists and validates; anything else reads "missing". No-training rows come
from an experiment of that row key, or else from the "base" (bf16 row) / "quantized_base" (nf4, mxfp4, nvfp4 rows)
results that a trained experiment of the same size and format evaluated alongside its trained model.
Accuracies are shown in percent with the 95% interval of qerl.evaluation.pass_at_1_stats. Table 2's average of
ours is the mean of the four benchmarks with a normal interval from their (independent) standard errors.

bench json (Table 3, written by `python -m bench.table3`; every key optional): {"model_size_gb": float (decimal GB),
"rollout_tokens_per_s": {"2": float, "8": float}, "e2e_step_seconds": {"2": float, "4": float, "8": float},
"device": str, "weights": str, "protocol": {"engine": str, "lengths": {"law", "median", "sigma", "cap"}, ...}}; our
speedup = BF16-LoRA step time / this step time, given only when both ran on the same device and rollout engine.
"""
from __future__ import annotations

import argparse
import sys
import csv
import json
import math
from pathlib import Path
from typing import Any

from qerl import paper
from qerl.errors import QerlError
from qerl.evaluation import Z95, find_result, load_eval_json
from qerl.paths import Layout, eval_records_dir
from qerl.tracking import add_mlflow_args, stage_run

MISSING = "missing"
NOT_REPORTED = "not reported"
BENCH_LABELS = {"gsm8k": "GSM8K", "math500": "MATH 500", "aime24": "AIME 24", "aime25": "AIME 25",
                "amc23": "AMC 23", "average": "Average", "demo": "demo (a - b)"}


# ------------------------------------------------------------------------------------------ inputs
def _norm_size(size: Any) -> str:
    return str(size).strip().upper() if size is not None else ""


def load_experiments(experiments: dict[str, dict]) -> dict[str, dict]:
    """Each experiment with its eval.json (None if not yet produced) and bench json (None if absent)."""
    loaded = {}
    for name in sorted(experiments):
        exp = experiments[name]
        if "row_key" not in exp or "model_size" not in exp:
            raise QerlError(f"experiment {name!r}: needs 'row_key' and 'model_size'; got {', '.join(exp)}")
        if exp["row_key"] not in paper.ROW_LABELS and exp["row_key"] != "demo":
            raise QerlError(f"experiment {name!r}: row_key {exp['row_key']!r} is not one of "
                            f"{', '.join(paper.ROW_LABELS)}, demo")
        eval_path = Path(exp["eval_path"]) if exp.get("eval_path") else None
        bench_path = Path(exp["bench_path"]) if exp.get("bench_path") else None
        loaded[name] = {**exp, "model_size": _norm_size(exp["model_size"]),
                        "eval": load_eval_json(eval_path) if eval_path and eval_path.is_file() else None,
                        "bench": _load_json(bench_path) if bench_path and bench_path.is_file() else None}
    return loaded


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise QerlError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _candidates(loaded: dict, size: str, row: str) -> list[tuple[str, list[str]]]:
    """(experiment, variants to try) in order of preference for one table row."""
    out = []
    if row in paper.NO_TRAINING_ROWS:
        own = ["base"] if row == "bf16" else ["quantized_base", "base"]
        out += [(n, own) for n, e in loaded.items() if e["model_size"] == size and e["row_key"] == row]
        if row == "bf16":
            out += [(n, ["base"]) for n, e in loaded.items() if e["model_size"] == size and e["row_key"] != row]
        else:
            out += [(n, ["quantized_base"]) for n, e in loaded.items()
                    if e["model_size"] == size and e["row_key"].startswith(f"{row}_")]
    else:
        out += [(n, ["trained"]) for n, e in loaded.items() if e["model_size"] == size and e["row_key"] == row]
    return out


def lookup(loaded: dict, size: str, row: str, benchmark: str) -> tuple[dict | None, str | None]:
    """Our result for one cell and the experiment it came from, or (None, None)."""
    for name, variants in _candidates(loaded, size, row):
        doc = loaded[name]["eval"]
        for variant in variants:
            res = find_result(doc, benchmark, variant) if doc else None
            if res is not None:
                return res, name
    return None, None


# ------------------------------------------------------------------------------------------ formatting
def _pct(x: float | None) -> str:
    return MISSING if x is None else f"{100 * x:.1f}"


def fmt_ours(res: dict | None) -> str:
    if res is None:
        return MISSING
    low, high = res["ci95"]
    return f"{100 * res['accuracy']:.1f} [{100 * low:.1f}, {100 * high:.1f}]"


def fmt_paper(value: float | None) -> str:
    return NOT_REPORTED if value is None else f"{value:.1f}"


def _protocol(res: dict | None) -> str:
    return "" if res is None else f"{res['n_problems']}x{res['k']} {res['mode']}"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _csv_row(table: str, size: str, row: str, benchmark: str, res: dict | None, paper_value, source) -> dict:
    ours = None if res is None else res["accuracy"]
    ci = (None, None) if res is None else res["ci95"]
    scale = lambda v: None if v is None else round(100 * v, 4)  # noqa: E731
    return {"table": table, "model_size": size, "row_key": row, "benchmark": benchmark,
            "status": MISSING if res is None else "ok", "ours_pct": scale(ours), "ci95_low_pct": scale(ci[0]),
            "ci95_high_pct": scale(ci[1]), "stderr_pct": None if res is None else scale(res["stderr"]),
            "n_problems": None if res is None else res["n_problems"], "k": None if res is None else res["k"],
            "mode": None if res is None else res["mode"], "variant": None if res is None else res["variant"],
            "paper_pct": paper_value, "source": source}


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)


# ------------------------------------------------------------------------------------------ tables
def _demo_rows(loaded: dict) -> list[tuple[str, dict | None, str]]:
    rows = []
    for name, exp in loaded.items():
        if exp["row_key"] == "demo":
            for variant in ("base", "quantized_base", "trained"):
                res = find_result(exp["eval"], "demo", variant) if exp["eval"] else None
                if res is not None or variant != "quantized_base":
                    rows.append((f"{name} ({variant})", res, name))
    return rows


def table1(loaded: dict) -> tuple[str, list[dict]]:
    """GSM8K for 3B and 7B (+ demo rows)."""
    header = ["Model", "W#", "Training", "GSM8K ours [95% CI]", "GSM8K paper", "problems x k", "source"]
    md_rows, csv_rows = [], []
    for size in paper.TABLE1_SIZES:
        for row in paper.TABLE1_ROWS:
            res, src = lookup(loaded, size, row, "gsm8k")
            w, training = paper.ROW_LABELS[row]
            value = paper.table1_value(size, row)
            md_rows.append([f"Qwen2.5-{size}-Instruct", w, training, fmt_ours(res), fmt_paper(value),
                            _protocol(res), src or ""])
            csv_rows.append(_csv_row("table1", size, row, "gsm8k", res, value, src))
    for label, res, src in _demo_rows(loaded):
        md_rows.append([label, "", "", fmt_ours(res), "not in paper", _protocol(res), src])
        csv_rows.append(_csv_row("table1", "demo", label, "demo", res, None, src))
    title = ("# Table 1: GSM8K accuracy (%), ours vs. the paper\n\nOurs: pass@1 with 95% interval over problems; "
             f"paper: {paper.SOURCE}. Rows without a finished run read \"{MISSING}\".\n\n")
    return title + _md_table(header, md_rows), csv_rows


def _average(results: list[dict | None]) -> dict | None:
    if any(r is None for r in results):
        return None
    acc = sum(r["accuracy"] for r in results) / len(results)
    se = math.sqrt(sum(r["stderr"] ** 2 for r in results)) / len(results)
    return {"accuracy": acc, "stderr": se, "ci95": [max(0.0, acc - Z95 * se), min(1.0, acc + Z95 * se)],
            "n_problems": sum(r["n_problems"] for r in results), "k": max(r["k"] for r in results),
            "mode": "/".join(sorted({r["mode"] for r in results})), "variant": results[0]["variant"]}


def table2(loaded: dict) -> tuple[str, list[dict]]:
    """MATH 500, AIME 24/25, AMC 23 and their average for 7B/14B/32B."""
    benches = paper.TABLE2_BENCHMARKS + ("average",)
    header = ["Model", "W#", "Training"] + [f"{BENCH_LABELS[b]} {who}" for b in benches
                                            for who in ("ours [95% CI]", "paper")] + ["source"]
    md_rows, csv_rows = [], []
    for size in paper.TABLE2_SIZES:
        for row in paper.TABLE2_ROWS:
            found = {b: lookup(loaded, size, row, b) for b in paper.TABLE2_BENCHMARKS}
            found["average"] = (_average([found[b][0] for b in paper.TABLE2_BENCHMARKS]), None)
            sources = sorted({s for _, s in found.values() if s})
            cells = []
            for b in benches:
                res, src = found[b]
                value = paper.table2_value(size, row, b)
                cells += [fmt_ours(res), fmt_paper(value)]
                csv_rows.append(_csv_row("table2", size, row, b, res, value, src or ",".join(sources) or None))
            md_rows.append([f"Qwen2.5-{size}-Instruct", *paper.ROW_LABELS[row], *cells, ", ".join(sources)])
    title = ("# Table 2: MATH 500 / AIME 24 / AIME 25 / AMC 23 accuracy (%), ours vs. the paper\n\n"
             "AIME has 30 problems and AMC 40: their intervals are wide. Paper: " + paper.SOURCE + ".\n\n")
    return title + _md_table(header, md_rows), csv_rows


def _bench_value(bench: dict | None, key: str, batch: int | None = None):
    if bench is None or key not in bench:
        return None
    value = bench[key]
    if batch is None:
        return value
    return value.get(str(batch), value.get(batch)) if isinstance(value, dict) else None


def _bench_for(loaded: dict, size: str, method: str) -> tuple[dict | None, str | None]:
    row = paper.METHOD_ROW_KEYS[method]
    for name, exp in loaded.items():
        if exp["model_size"] == size and exp["bench"] is not None and exp["row_key"] in (row, f"{row}_aqn"):
            return exp["bench"], name
    return None, None


def _num(x) -> str:
    return MISSING if x is None else (f"{x:.1f}" if isinstance(x, (int, float)) else str(x))


def _speedup(base: dict | None, bench: dict | None, batch: int) -> tuple[float | None, str]:
    """BF16-LoRA step time / this step time at `batch` prompts, and the cell: x speedup (step seconds)."""
    t_base, t = (_bench_value(x, "e2e_step_seconds", batch) for x in (base, bench))
    if not t:
        return None, MISSING
    if not t_base or base.get("device") != bench.get("device") or _engine(base) != _engine(bench):
        return None, f"- ({t:.1f} s)"  # a ratio across devices or rollout engines measures those
    ratio = t_base / t  # the cell formats the ratio itself: rounding twice turned 0.5950 into "x0.59"
    return round(ratio, 3), f"x{ratio:.2f} ({t:.1f} s)"


def _engine(bench: dict) -> str | None:  # the rollout engine a bench JSON was measured on (bench.table3 --engine)
    return bench.get("protocol", {}).get("engine")


def _table3_caption(benches: list[dict]) -> str:
    """Where and how our figures were measured, from the bench JSONs themselves."""
    if not benches:
        return f"No measurement yet (`python -m bench.table3`): ours read \"{MISSING}\".\n\n"
    devices = sorted({str(b.get("device", "unknown device")) for b in benches})
    laws = sorted({json.dumps(b.get("protocol", {}).get("lengths", {}), sort_keys=True) for b in benches})
    engines = " / ".join(sorted({str(_engine(b) or "not recorded") for b in benches}))
    text = f"Ours: measured on {', '.join(devices)} (`python -m bench.table3`), rollout engine {engines}."
    if any(str(b.get("weights", "")).startswith("random") for b in benches):
        text += " Rows marked random ran random weights of the real Qwen2.5 shapes (speed does not depend on them)."
    for law in map(json.loads, laws):
        if law:
            text += (f" Random weights never sample EOS, so every completion ends at a length drawn from a "
                     f"{law.get('law', '?')} law (median {law.get('median')}, sigma {law.get('sigma')}, capped at "
                     f"{law.get('cap')}), the same draws for every method.")
    proto = benches[0].get("protocol", {})
    if proto:
        text += (f" Rollout: rows = batch, {proto.get('prompt_len')}-token prompts; E2E: batch prompts x "
                 f"G = {proto.get('num_generations')}, the mean of {proto.get('timed_steps')} GRPO step(s) after a "
                 f"warm-up, step seconds in brackets.")
    return text + "\n\n"


def table3(loaded: dict) -> tuple[str, list[dict]]:
    """Model size, rollout throughput and end-to-end speedup per size and method."""
    header = ["Model", "Method", "W#", "size GB ours", "paper"]
    header += [f"rollout tok/s bs{b} {w}" for b in paper.BATCH_SIZES_ROLLOUT for w in ("ours", "paper")]
    header += [f"E2E speedup bs{b} {w}" for b in paper.BATCH_SIZES_E2E for w in ("ours", "paper")]
    header += ["measured on", "source"]
    md_rows, csv_rows, benches = [], [], []
    for size in paper.TABLE3_SIZES:
        base_bench, _ = _bench_for(loaded, size, "lora")
        for method in paper.TABLE3_METHODS:
            bench, src = _bench_for(loaded, size, method)
            benches += [bench] if bench else []
            ref = paper.TABLE3[(size, method)]
            cells = [_num(_bench_value(bench, "model_size_gb")), fmt_paper(ref["model_size_gb"])]
            metrics = [("model_size_gb", None, _bench_value(bench, "model_size_gb"), ref["model_size_gb"])]
            for b in paper.BATCH_SIZES_ROLLOUT:
                ours = _bench_value(bench, "rollout_tokens_per_s", b)
                cells += [_num(ours), fmt_paper(ref["rollout_tokens_per_s"][b])]
                metrics.append(("rollout_tokens_per_s", b, ours, ref["rollout_tokens_per_s"][b]))
            for b in paper.BATCH_SIZES_E2E:
                ours, cell = _speedup(base_bench, bench, b)
                cells += [cell, fmt_paper(ref["e2e_speedup"][b])]
                metrics.append(("e2e_speedup", b, ours, ref["e2e_speedup"][b]))
                metrics.append(("e2e_step_seconds", b, _bench_value(bench, "e2e_step_seconds", b), None))
            where = f"{bench.get('device', '?')}, {bench.get('weights', '?')}" if bench else ""
            label, w = paper.METHOD_LABELS[method]
            md_rows.append([f"Qwen2.5-{size}-Instruct", label, w, *cells, where, src or ""])
            csv_rows += [{"table": "table3", "model_size": size, "method": method, "metric": m, "batch_size": b,
                          "status": MISSING if o is None else "ok", "ours": o, "paper": p, "source": src,
                          "device": bench.get("device") if bench else None} for m, b, o, p in metrics]
    title = ("# Table 3: model size, rollout throughput and end-to-end GRPO speedup, ours vs. the paper\n\n"
             "Speedups are relative to BF16 LoRA of the same size on the same device. Paper: " + paper.SOURCE +
             " (vLLM rollouts).\n" + _table3_caption(benches))
    return title + _md_table(header, md_rows), csv_rows


# ------------------------------------------------------------------------------------------ plots
def _read_metrics_csv(path: Path) -> list[tuple[float, float, float, float]]:
    def get(row, *names):
        for n in names:
            if row.get(n) not in (None, ""):
                return float(row[n])
        return math.nan

    with Path(path).open(encoding="utf-8") as fh:
        return [(get(r, "step"), get(r, "reward"), get(r, "entropy"), get(r, "aqn/sigma", "sigma"))
                for r in csv.DictReader(fh)]


def plot_training_curves(source: list | dict, out_png: str | Path, title: str | None = None) -> Path:
    """Reward, entropy and AQN sigma per step: csv paths (columns step, reward, entropy, aqn/sigma) or
    {name: csv path | [(step, reward, entropy, sigma), ...]}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = source if isinstance(source, dict) else {Path(p).parent.name or Path(p).stem: p for p in source}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, data in runs.items():
        points = _read_metrics_csv(Path(data)) if isinstance(data, (str, Path)) else [tuple(p) for p in data]
        if not points:
            continue
        steps = [p[0] for p in points]
        for ax, col in zip(axes, (1, 2, 3)):
            ax.plot(steps, [p[col] for p in points], label=name)
    for ax, label in zip(axes, ("reward", "entropy", "AQN sigma")):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if runs:
        axes[0].legend(fontsize=8)
    else:
        axes[1].text(0.5, 0.5, "no runs with metrics yet", ha="center", transform=axes[1].transAxes)
    fig.suptitle(title or "training curves")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------------ entry points
def render_tables(experiments: dict[str, dict], out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write table{1,2,3}.md/.csv (and training_curves.png) under out_dir; returns the paths by name."""
    loaded = load_experiments(experiments)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, build in (("table1", table1), ("table2", table2), ("table3", table3)):
        markdown, rows = build(loaded)
        (out / f"{name}.md").write_text(markdown, encoding="utf-8")
        _write_csv(out / f"{name}.csv", rows)
        written[f"{name}.md"], written[f"{name}.csv"] = out / f"{name}.md", out / f"{name}.csv"
    if plots:
        metrics = {n: e["metrics_path"] for n, e in loaded.items()
                   if e.get("metrics_path") and Path(e["metrics_path"]).is_file()}
        written["training_curves.png"] = plot_training_curves(metrics, out / "training_curves.png")
    return written


def experiments_from_config(config: dict | str, results_dir: str | Path = "results") -> dict[str, dict]:
    """Table entries from the workflow config ({"experiments": {name: {row, model_size, ...}}}, dict or JSON text)
    with the standard result paths; experiments without a `row` are not in any table."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise QerlError(f"--config-json: not valid JSON ({exc.msg})") from None
    layout = Layout(results_dir)
    out = {}
    for name, exp in (config.get("experiments", config) or {}).items():
        row = exp.get("row") or exp.get("row_key")
        if row:
            out[name] = {"row_key": row, "model_size": exp.get("model_size") or "",
                         "eval_path": str(layout.eval_json(name)), "bench_path": str(layout.bench_json(name)),
                         "metrics_path": str(layout.metrics_csv(name))}
    return out


def summary(eval_paths: list[str | Path]) -> str:
    """A short console table of finished evaluations: one line per benchmark, variant and mode."""
    lines = [f"{'experiment':<20} {'result':<32} {'accuracy [95% CI]':<24} {'problems x k':>12}"]
    for path in eval_paths:
        doc = load_eval_json(path)
        for key, res in doc["benchmarks"].items():
            cell = f"{fmt_ours(res)} %"
            size = f"{res['n_problems']} x {res['k']}"
            lines.append(f"{doc['experiment']:<20} {key:<32} {cell:<24} {size:>12}")
        lines.append(f"  details: {path} (per problem: {eval_records_dir(path)}/)")
    return "\n".join(lines)


def _experiments_arg(args) -> dict[str, dict]:
    if args.experiments_json:
        path = Path(args.experiments_json)
        if not path.is_file():
            raise QerlError(f"experiments file {path} does not exist")
        return _load_json(path)
    text = args.config_json
    if not text.lstrip().startswith("{"):
        if not Path(text).is_file():
            raise QerlError(f"--config-json: {text} is neither JSON nor an existing file")
        text = Path(text).read_text(encoding="utf-8")
    return experiments_from_config(text, args.results_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qerl.tables", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--experiments-json", help="file: {name: {row_key, model_size, eval_path, ...}}")
    source.add_argument("--config-json", help="workflow config JSON (text or file) with an 'experiments' map")
    source.add_argument("--summary", nargs="+", metavar="EVAL_JSON", help="print these results; write nothing")
    parser.add_argument("--out-dir", help="where the tables go (default: <results-dir>/tables)")
    parser.add_argument("--no-plots", action="store_true")
    add_mlflow_args(parser)
    args = parser.parse_args(argv)
    try:
        if args.summary:
            print(summary(args.summary))
            return 0
        experiments = _experiments_arg(args)
        layout = Layout(args.results_dir)
        out_dir = args.out_dir or layout.tables()
        with stage_run(experiment="tables", stage="tables", params={"experiments": sorted(experiments)},
                       run_file=layout.tables_run_file(), results_dir=args.results_dir,
                       mlflow_experiment=args.mlflow_experiment, uri=args.tracking_uri) as run:
            written = render_tables(experiments, out_dir, plots=not args.no_plots)
            for path in written.values():
                run.log_artifact(path)
    except QerlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
