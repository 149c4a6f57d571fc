"""Ablations: one base experiment trained by several methods over several seeds, rendered as the paper's figures.

    snakemake --cores 1 demo_ablation          # every run, then this stage's render
    python -m qerl.ablation render --name demo_ablation --config config/config.yaml     # the render alone, by hand

`expand_ablations` turns each `ablations:` entry of the config into ordinary experiments named
<ablation>-<method>-s<seed> (the base experiment with the method's and the ablation's keys changed, train.seed set,
no table row), so each run is quantize -> train -> merge -> evaluate like any other. The first run of each method
that brings a new base also evaluates it without training (base for a 16-bit method, quantized_base for a
quantized one). `render` reads their metrics.csv and eval.json and writes, under results/ablations/<name>/:
  curves.png   reward, correct rollouts and entropy per step: the mean over seeds and the band between the lowest and highest seed
               (a moving average over smooth_steps steps), the paper's Figures 3, 4 and 8 in small
  diagnostics.png  the same for the trainer's diagnostics (qerl.diagnostics): correctness and format reward, groups of
               equal rewards (no gradient) and with no correct completion, rollout entropy, adapter update norm, and
               KL(quantized || dense policy) where train.quant_kl_steps measured it
  table1.md    greedy accuracy per method and benchmark: the mean over seeds with a Wilson 95% interval over the
               seeds' pooled problems, each seed's accuracy, their standard deviation; the untrained bases
  ablation.json  the same numbers, for scripts
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qerl.config import Config, ExperimentConfig, load_config
from qerl.errors import QerlError
from qerl.paths import Layout
from qerl.tracking import add_mlflow_args

# metrics.csv column -> axis title; correctness apart from the total, which also pays for the answer format
CURVES = (("reward", "reward (weighted sum)"), ("rewards/correctness/mean", "correct rollouts (fraction)"),
          ("entropy", "policy entropy (nats per token)"))
FORMAT = "rewards/format"  # whichever reward's name holds "format" (format, answer_line_format_if_correct, ...)
# the trainer's per-step diagnostics (qerl.diagnostics), in diagnostics.png: how a run collapses, or does not
DIAGNOSTICS = (("rewards/correctness/mean", "correctness reward (mean)"),
               (FORMAT, "format reward (mean, unweighted)"),
               ("frac_reward_zero_std", "groups of equal rewards (no gradient)"),
               ("frac_groups_none_correct", "groups with no correct completion"),
               ("rollout/entropy", "rollout entropy (nats/token, sampled estimate)"),
               ("adapter/update_norm", "adapter update norm per step"),
               ("quant/kl", "KL(quantized || dense policy), nats/token"))


# ------------------------------------------------------------------------------------------ expansion
def run_name(ablation: str, method: str, seed: int) -> str:
    return f"{ablation}-{method}-s{seed}"


def _merged(base: dict, changes: dict) -> dict:
    """base with changes applied key by key; nested sections are merged, any other value (null too) replaces."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _base_variant(experiment: ExperimentConfig) -> str:
    return "base" if experiment.quantize.scheme == "bf16" else "quantized_base"


def ablation_runs(cfg: Config, name: str) -> dict[str, dict[int, ExperimentConfig]]:
    """method -> seed -> the experiment of that run (validated like any experiment)."""
    ablation = cfg.ablations[name]
    base = cfg.experiments[ablation.base].model_dump(mode="json")
    runs, bases_seen = {}, set()
    for method, spec in ablation.methods.items():
        runs[method] = {}
        for i, seed in enumerate(ablation.seeds):
            changes = {"row": None, "quantize": spec.quantize,
                       "train": _merged(_merged(ablation.train, spec.train), {"seed": seed}), "eval": ablation.eval}
            data = _merged(base, changes)
            try:
                experiment = ExperimentConfig.model_validate(data)
            except ValidationError as err:
                e = err.errors()[0]
                where = ".".join(str(p) for p in e["loc"])
                raise QerlError(f"ablations.{name}.methods.{method}: {where}: {e['msg']}") from None
            variants = ["trained"]
            if i == 0 and experiment.quantize.scheme not in bases_seen:  # one untrained evaluation per base
                bases_seen.add(experiment.quantize.scheme)
                variants.append(_base_variant(experiment))
            runs[method][seed] = experiment.model_copy(
                update={"eval": experiment.eval.model_copy(update={"variants": variants})})
    return runs


def expand_ablations(cfg: Config) -> Config:
    """cfg with every ablation run added to its experiments (a name already taken is an error)."""
    added = {}
    for name in cfg.ablations:
        for method, seeds in ablation_runs(cfg, name).items():
            for seed, experiment in seeds.items():
                key = run_name(name, method, seed)
                if key in cfg.experiments or key in added:
                    raise QerlError(f"ablations.{name}: run {key!r} is also an experiment of that name")
                added[key] = experiment
    if added:
        cfg = cfg.model_copy(update={"experiments": {**cfg.experiments, **added}})
    return cfg


def ablation_run_names(cfg: Config) -> set[str]:
    """Every run the ablations add to the experiments."""
    return {run_name(name, method, seed) for name, a in cfg.ablations.items() for method in a.methods
            for seed in a.seeds}


def quantize_sources(cfg: Config) -> dict[str, str]:
    """run -> the ablation run whose quantized checkpoint it reuses (same model and quantize section): a seed or a
    method that only changes training does not quantize again."""
    sources, first = {}, {}
    for name in cfg.ablations:
        for method, seeds in ablation_runs(cfg, name).items():
            for seed, e in seeds.items():
                key = json.dumps([e.model, e.model_revision, e.quantize.model_dump(mode="json")], sort_keys=True)
                run = run_name(name, method, seed)
                if first.setdefault(key, run) != run:
                    sources[run] = first[key]
    return sources


def render_spec(cfg: Config, name: str, results_dir: str | Path) -> dict[str, Any]:
    """What `render` needs (the rule passes it as JSON): labels, smoothing, each run's metrics and eval paths."""
    layout, ablation = Layout(results_dir), cfg.ablations[name]
    methods = {}
    for method, seeds in ablation_runs(cfg, name).items():
        methods[method] = {"label": ablation.methods[method].label, "runs": {
            str(seed): {"metrics": str(layout.metrics_csv(run_name(name, method, seed))),
                        "eval": str(layout.eval_json(run_name(name, method, seed)))} for seed in seeds}}
    return {"name": name, "base": ablation.base, "smooth_steps": ablation.smooth_steps, "methods": methods}


# ------------------------------------------------------------------------------------------ curves
def read_curves(path: str | Path) -> dict[str, list[float]]:
    """step, CURVES' and DIAGNOSTICS' columns of a run's metrics.csv (nan where a run did not log one: an older run,
    a dense method's quant/kl, the steps between two KL measurements)."""
    path = Path(path)
    if not path.is_file():
        raise QerlError(f"ablation: training metrics {path} do not exist (has the run trained?)")
    with path.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    cols = {"step": []} | {key: [] for key, _ in CURVES + DIAGNOSTICS}
    fmt = next((k for k in (rows[0] if rows else {}) if k.startswith("rewards/") and k.endswith("/mean")
                and "format" in k), None)
    for row in rows:
        for key in cols:
            value = row.get(fmt if key == FORMAT else key)
            cols[key].append(float(value) if value not in (None, "") else math.nan)
    return cols


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of the last `window` values at each step (fewer at the start): the trend, not the step noise."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
        out.append(sum(seen) / len(seen) if seen else math.nan)
    return out


def band(curves: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """mean, lowest and highest over seeds at each step (up to the shortest run), of the seeds that have a value
    there (nan where none has)."""
    n = min(len(c) for c in curves)
    columns = [[c[i] for c in curves if not math.isnan(c[i])] or [math.nan] for i in range(n)]
    return ([sum(col) / len(col) for col in columns], [min(col) for col in columns], [max(col) for col in columns])


def finished(method: dict) -> list[dict]:
    """The runs of a method that trained and were evaluated (a render by hand may come before the last run)."""
    return [run for run in method["runs"].values() if Path(run["metrics"]).is_file() and Path(run["eval"]).is_file()]


def plot_curves(spec: dict, out_png: str | Path, panels=CURVES, columns: int = 3) -> Path:
    """One panel per (metrics.csv column, title) of `panels`, `columns` to a row: each method's mean over seeds
    and the band between its lowest and highest seed, as moving averages over smooth_steps steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = spec["smooth_steps"]
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), squeeze=False)
    axes = axes.reshape(-1)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for method in spec["methods"].values():
        runs = [read_curves(run["metrics"]) for run in finished(method)]
        if not runs:
            continue
        steps = runs[0]["step"][:min(len(r["step"]) for r in runs)]
        for ax, (key, _) in zip(axes, panels):
            mean, low, high = band([moving_average(r[key], window) for r in runs])
            line, = ax.plot(steps, mean, label=f"{method['label']} ({len(runs)} seeds)")
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    for ax, (_, title) in zip(axes, panels):
        ax.set_xlabel("training step")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{spec['name']}: mean over seeds, band = lowest to highest seed, moving average over {window} "
                 "steps", fontsize=10)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------------ table
def _greedy(doc: dict, benchmark: str, variant: str) -> dict | None:
    from qerl.evaluation import find_result

    return find_result(doc, benchmark, variant, "greedy")


def method_summary(results: list[dict]) -> dict:
    """Seeds' greedy results of one benchmark -> mean, pooled Wilson interval, per-seed accuracies, their SD."""
    from qerl.evaluation import wilson_interval

    accs = [r["accuracy"] for r in results]
    n = sum(r["n_problems"] for r in results)
    low, high = wilson_interval(sum(r["accuracy"] * r["n_problems"] for r in results), n)
    return {"mean": sum(accs) / len(accs), "ci95_low": low, "ci95_high": high, "seeds": accs,
            "sd": statistics.stdev(accs) if len(accs) > 1 else 0.0, "n_problems": results[0]["n_problems"]}


def _tail_mean(values: list[float], n: int) -> float:
    tail = [v for v in values[-n:] if not math.isnan(v)]
    return sum(tail) / len(tail) if tail else math.nan


def summarise(spec: dict) -> dict:
    """Per method: each benchmark's summary, the last smooth_steps steps' reward and the mean entropy; the bases."""
    from qerl.evaluation import load_eval_json

    methods, bases, benchmarks = {}, {}, []
    for key, method in spec["methods"].items():
        runs = finished(method)
        if not runs:
            continue
        docs = [load_eval_json(run["eval"]) for run in runs]
        curves = [read_curves(run["metrics"]) for run in runs]
        for doc in docs:
            for result in doc["benchmarks"].values():
                if result["benchmark"] not in benchmarks:
                    benchmarks.append(result["benchmark"])
                if result["variant"] != "trained" and result.get("mode") == "greedy":
                    bases.setdefault(result["variant"], {})[result["benchmark"]] = result
        per_bench = {b: method_summary([_greedy(d, b, "trained") for d in docs]) for b in benchmarks
                     if all(_greedy(d, b, "trained") for d in docs)}
        methods[key] = {"label": method["label"], "benchmarks": per_bench, "seeds_finished": len(runs),
                        "seeds_configured": len(method["runs"]),
                        "final_reward": [_tail_mean(c["reward"], spec["smooth_steps"]) for c in curves],
                        "final_correct": [_tail_mean(c["rewards/correctness/mean"], spec["smooth_steps"])
                                          for c in curves],
                        "mean_entropy": [_tail_mean(c["entropy"], len(c["entropy"])) for c in curves],
                        # each diagnostic's mean over the whole run, per seed (nan: not logged)
                        "diagnostics": {key: [_or_none(_tail_mean(c[key], len(c[key]))) for c in curves]
                                        for key, _ in DIAGNOSTICS}}
    return {"name": spec["name"], "base": spec["base"], "benchmarks": benchmarks, "methods": methods,
            "untrained": bases}


def _or_none(x: float) -> float | None:
    return None if math.isnan(x) else x  # JSON has no nan


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table_markdown(summary: dict, smooth_steps: int) -> str:
    benches = summary["benchmarks"]
    header = (["Method"] + [f"{b} greedy % [95% CI]" for b in benches] + [f"{b} per seed (SD)" for b in benches]
              + [f"reward, last {smooth_steps} steps", f"correct rollouts, last {smooth_steps} steps",
                 "mean entropy", "groups of equal rewards (run mean)"])
    rows = []
    for method in summary["methods"].values():
        cells = [method["label"]]
        for b in benches:
            s = method["benchmarks"].get(b)
            cells.append(f"{_pct(s['mean'])} [{_pct(s['ci95_low'])}, {_pct(s['ci95_high'])}]" if s else "-")
        for b in benches:
            s = method["benchmarks"].get(b)
            cells.append(" / ".join(_pct(a) for a in s["seeds"]) + f" ({_pct(s['sd'])})" if s else "-")
        cells.append(" / ".join(f"{r:.3f}" for r in method["final_reward"]))
        cells.append(" / ".join(f"{r:.3f}" for r in method["final_correct"]))
        cells.append(" / ".join(f"{e:.3f}" for e in method["mean_entropy"]))
        equal = method["diagnostics"]["frac_reward_zero_std"]
        cells.append(" / ".join("-" if e is None else f"{e:.2f}" for e in equal))
        rows.append(cells)
    labels = {"base": "base, no training", "quantized_base": "quantized base, no training"}
    for variant, results in summary["untrained"].items():
        cells = [labels.get(variant, variant)]
        for b in benches:
            r = results.get(b)
            cells.append(f"{_pct(r['accuracy'])} [{_pct(r['ci95'][0])}, {_pct(r['ci95'][1])}]" if r else "-")
        rows.append(cells + ["-"] * (len(header) - len(cells)))
    n = {b: next((m["benchmarks"][b]["n_problems"] for m in summary["methods"].values() if b in m["benchmarks"]),
                 "?") for b in benches}
    partial = [f"{m['label']} {m['seeds_finished']} of {m['seeds_configured']}" for m in summary["methods"].values()
               if m["seeds_finished"] < m["seeds_configured"]]
    intro = (f"# {summary['name']}: greedy accuracy per method (base experiment {summary['base']})\n\n"
             + (f"**Partial: seeds finished {', '.join(partial)}.** " if partial else "")
             + "Mean over seeds; the 95% interval is Wilson's over the seeds' pooled problems (the uncertainty of the "
             "items, not of the seeds: the per-seed column shows that). Problems per seed: "
             + ", ".join(f"{b} {k}" for b, k in n.items()) + ". Reward, correct rollouts, entropy and groups of equal "
             "rewards are per seed.\n\n")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return intro + "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ the stage
def render(spec: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(spec)
    paths = {"curves": plot_curves(spec, out / "curves.png"), "table": out / "table1.md",
             "summary": out / "ablation.json",
             "diagnostics": plot_curves(spec, out / "diagnostics.png", DIAGNOSTICS, columns=4)}
    paths["table"].write_text(table_markdown(summary, spec["smooth_steps"]), encoding="utf-8")
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return paths


def _metrics(summary: dict) -> dict[str, float]:
    flat = {}
    for key, method in summary["methods"].items():
        for bench, s in method["benchmarks"].items():
            flat[f"{key}.{bench}.accuracy_mean"], flat[f"{key}.{bench}.accuracy_sd"] = s["mean"], s["sd"]
    return flat


def _spec_arg(args) -> dict:
    if args.spec_json:
        return json.loads(args.spec_json)
    if not args.config:
        raise QerlError("give --spec-json or --config")
    cfg = expand_ablations(load_config(args.config))
    if args.name not in cfg.ablations:
        raise QerlError(f"{args.config}: no ablation '{args.name}' (have: {', '.join(cfg.ablations) or 'none'})")
    return render_spec(cfg, args.name, args.results_dir)


def main(argv: list[str] | None = None) -> int:
    from qerl.tracking import stage_run

    parser = argparse.ArgumentParser(prog="python -m qerl.ablation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="curves.png, table1.md and ablation.json of one ablation's finished runs")
    r.add_argument("--name", required=True, help="the ablation (a key of the config's ablations)")
    r.add_argument("--spec-json", help="what the rule passes (qerl.ablation.render_spec)")
    r.add_argument("--config", help="a config file to build the spec from (by hand)")
    r.add_argument("--out-dir", help="default: <results-dir>/ablations/<name>")
    add_mlflow_args(r)
    args = parser.parse_args(argv)
    try:
        spec = _spec_arg(args)
        layout = Layout(args.results_dir)
        out_dir = Path(args.out_dir or layout.ablation(args.name))
        with stage_run(experiment=args.name, stage="ablation", params={"spec": spec},
                       run_file=out_dir / "runs" / "ablation.json", results_dir=args.results_dir,
                       mlflow_experiment=args.mlflow_experiment, uri=args.tracking_uri) as run:
            paths = render(spec, out_dir)
            run.log_metrics(_metrics(json.loads(paths["summary"].read_text())))
            for path in paths.values():
                run.log_artifact(path)
    except QerlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
