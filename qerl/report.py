"""What `snakemake --report` shows of one experiment: its accuracies with 95% intervals and its training curves.

    python -m qerl.report --experiment demo --eval results/demo/eval.json \
        --metrics results/demo/adapter/metrics.csv --out-dir results/demo/report

Writes accuracy.html (one row per benchmark, model and decoding: accuracy, 95% interval, problems x samples, change
from the base model), accuracy.png (the same as bars with their intervals) and curves/<curve>.png, one figure per
training curve of metrics.csv (every step, as the trainer logged it; a curve whose metrics were not logged has no
file). The workflow's experiment_report rule runs it after evaluate and marks these files for the report
(workflow/report/*.rst are their captions). Plain files: they open without Snakemake too.
"""
from __future__ import annotations

import argparse
import csv
import html
import math
import sys
from pathlib import Path

from qerl.errors import QerlError
from qerl.evaluation import load_eval_json
from qerl.io import atomic_dir

# curve file name -> (title, y label, metrics.csv columns drawn, smoothed); only columns the run logged are drawn.
# Smoothed: the first column also gets its moving average over a tenth of the run (GRPO metrics are noisy per step).
CURVES = {
    "reward": ("reward (mean over the batch's completions)", "reward", ("reward", "rewards/*/mean"), True),
    "entropy": ("policy entropy per completion token", "nats", ("entropy",), True),
    "loss": ("GRPO loss", "loss", ("loss",), True),
    "kl": ("KL to the reference policy", "KL", ("kl",), True),
    "aqn_sigma": ("AQN noise sigma on the RMSNorm scales", "sigma", ("aqn/sigma",), False),
    "completion_length": ("completion length", "tokens", ("completions/mean_length", "completions/max_length"),
                          True),
    "truncated": ("completions cut at max_completion_length", "fraction", ("completions/clipped_ratio",), True),
    "clip_ratio": ("tokens whose ratio was clipped", "fraction", ("clip_ratio/region_mean", "clip_ratio/low_mean",
                                                                 "clip_ratio/high_mean"), False),
    "grad_norm": ("gradient norm before clipping", "norm", ("grad_norm",), True),
    "timing": ("seconds per step", "s", ("timing/step", "timing/rollout", "timing/update"), False),
}
_VARIANT_ORDER = {"base": 0, "quantized_base": 1, "trained": 2}
_CI_METHODS = {"wilson": "wilson: Wilson score interval (one sample per problem)",
               "student_t": "student_t: Student t over the per-problem means (several samples per problem)",
               "wilson_problems": "wilson_problems: Wilson score over problems (several samples, all problems "
                                  "scoring the same 0 or 1)"}


# ------------------------------------------------------------------------------------------ accuracy
def accuracy_rows(doc: dict) -> list[dict]:
    """eval.json's results sorted by benchmark, decoding and model (base first), each with its change from the base
    model's result of the same benchmark and decoding (None for the base itself or when it was not evaluated)."""
    results = doc["benchmarks"]
    base = {(r["benchmark"], r["mode"]): r["accuracy"] for r in results.values() if r["variant"] == "base"}
    rows = []
    for key, r in results.items():
        ref = base.get((r["benchmark"], r["mode"]))
        rows.append({"key": key, "benchmark": r["benchmark"], "variant": r["variant"], "mode": r["mode"],
                     "accuracy": r["accuracy"], "ci95": tuple(r["ci95"]), "ci_method": r["ci_method"],
                     "n_problems": r["n_problems"], "k": r["k"],
                     "vs_base": None if ref is None or r["variant"] == "base" else r["accuracy"] - ref})
    return sorted(rows, key=lambda r: (r["benchmark"], r["mode"], _VARIANT_ORDER.get(r["variant"], 9), r["key"]))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; }}
th, td {{ padding: 0.35em 0.9em; border-bottom: 1px solid #ddd; text-align: left; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
th {{ background: #f3f3f3; }}
p.note {{ color: #555; font-size: 0.9em; max-width: 50em; }}
</style></head><body>
<h2>{title}</h2>
<table>
<tr><th>benchmark</th><th>model</th><th>decoding</th><th>accuracy %</th><th>95% interval</th>
<th>problems x samples</th><th>vs base (points)</th></tr>
{rows}
</table>
<p class="note">{note}</p>
</body></html>
"""


def accuracy_html(doc: dict) -> str:
    """A self-contained HTML table of the accuracies (the report shows it as a page of its own)."""
    cells = []
    for r in accuracy_rows(doc):
        low, high = r["ci95"]
        delta = "" if r["vs_base"] is None else f"{100 * r['vs_base']:+.1f}"
        cells.append(f"<tr><td>{html.escape(r['benchmark'])}</td><td>{html.escape(r['variant'])}</td>"
                     f"<td>{html.escape(r['mode'])}</td><td class=\"num\"><b>{_pct(r['accuracy'])}</b></td>"
                     f"<td class=\"num\">[{_pct(low)}, {_pct(high)}]</td>"
                     f"<td class=\"num\">{r['n_problems']} x {r['k']}</td><td class=\"num\">{delta}</td></tr>")
    methods = sorted({r["ci_method"] for r in accuracy_rows(doc)})
    note = ("Accuracy: pass@1 averaged over the samples of each problem. 95% interval over problems, "
            + "; ".join(html.escape(_CI_METHODS.get(m, m)) for m in methods)
            + f". Evaluated {html.escape(str(doc.get('created', '')))} with the {html.escape(doc['engine'])} engine; "
            "every completion, graded, in eval_records/ beside eval.json.")
    return _HTML.format(title=html.escape(f"{doc['experiment']}: accuracy"), rows="\n".join(cells), note=note)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(doc: dict, out_png: str | Path) -> Path:
    """Horizontal bars of the accuracies with their 95% intervals, labelled with the numbers."""
    plt = _pyplot()
    rows = accuracy_rows(doc)[::-1]  # matplotlib draws the first bar at the bottom
    colors = {"base": "#9e9e9e", "quantized_base": "#6baed6", "trained": "#e6550d"}
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(rows)))
    ys = range(len(rows))
    acc = [100 * r["accuracy"] for r in rows]
    err = [[100 * (r["accuracy"] - r["ci95"][0]) for r in rows], [100 * (r["ci95"][1] - r["accuracy"]) for r in rows]]
    ax.barh(ys, acc, xerr=err, capsize=4, color=[colors.get(r["variant"], "#756bb1") for r in rows])
    for y, r in zip(ys, rows):
        low, high = r["ci95"]
        ax.text(100 * high + 1, y, f"{_pct(r['accuracy'])}% [{_pct(low)}, {_pct(high)}]", va="center", fontsize=8)
    ax.set_yticks(list(ys), [f"{r['benchmark']} {r['variant']} ({r['mode']})" for r in rows], fontsize=8)
    ax.set_xlim(0, 130)
    ax.set_xticks(range(0, 101, 20))
    ax.set_xlabel("accuracy % (bars: 95% interval)")
    ax.set_title(f"{doc['experiment']}: accuracy", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, plt, out_png)


# ------------------------------------------------------------------------------------------ training curves
def read_metrics(path: str | Path) -> dict[str, list[float]]:
    """metrics.csv as {column: values per step} (NaN where a step did not log a column); sorted by step."""
    path = Path(path)
    if not path.is_file():
        raise QerlError(f"metrics file {path} does not exist (the train stage writes it beside the adapter)")
    with path.open(encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    if rows and "step" not in rows[0]:
        raise QerlError(f"{path}: no 'step' column (not a qerl metrics.csv)")

    def number(text):
        try:
            return float(text)
        except (TypeError, ValueError):
            return math.nan

    rows.sort(key=lambda r: number(r["step"]))
    return {col: [number(r.get(col)) for r in rows] for col in (rows[0] if rows else {"step": None})}


def _columns(metrics: dict[str, list[float]], wanted: tuple[str, ...]) -> list[str]:
    """The wanted columns the run logged with a finite value; `a/*/b` matches every column of that shape."""
    found = []
    for want in wanted:
        if "*" in want:
            head, tail = want.split("*")
            found += sorted(c for c in metrics if c.startswith(head) and c.endswith(tail) and c != want)
        elif want in metrics:
            found.append(want)
    return [c for c in found if any(math.isfinite(v) for v in metrics[c])]


def _moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1):i + 1] if math.isfinite(v)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def plot_curve(metrics: dict[str, list[float]], name: str, out_png: str | Path, experiment: str = "") -> Path | None:
    """One figure of CURVES[name]; None when the run logged none of its columns."""
    title, ylabel, wanted, smooth = CURVES[name]
    columns = _columns(metrics, wanted)
    if not columns:
        return None
    plt = _pyplot()
    steps = metrics["step"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, col in enumerate(columns):
        ax.plot(steps, metrics[col], label=col, lw=1.0 if i == 0 else 0.9, alpha=1.0 if i == 0 else 0.7,
                ls="-" if i == 0 else "--", drawstyle="default" if smooth else "steps-post")
    if smooth and len(steps) >= 10:
        window = max(2, len(steps) // 10)
        ax.plot(steps, _moving_average(metrics[columns[0]], window), color="black", lw=2,
                label=f"{columns[0]}, mean of {window} steps")
    ax.set_title(f"{experiment}: {title}" if experiment else title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, plt, out_png)


def _save(fig, plt, out_png: str | Path) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------------ entry points
def render(experiment: str, eval_json: str | Path, metrics_csv: str | Path, out_dir: str | Path) -> list[Path]:
    """Write accuracy.html, accuracy.png and curves/*.png under out_dir (replaced whole, atomically); returns the
    files, relative to out_dir."""
    doc = load_eval_json(eval_json)
    metrics = read_metrics(metrics_csv)
    with atomic_dir(out_dir) as tmp:
        (tmp / "accuracy.html").write_text(accuracy_html(doc), encoding="utf-8")
        plot_accuracy(doc, tmp / "accuracy.png")
        (tmp / "curves").mkdir()
        for name in CURVES:
            plot_curve(metrics, name, tmp / "curves" / f"{name}.png", experiment)
        written = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qerl.report", description=__doc__.splitlines()[0])
    p.add_argument("--experiment", required=True)
    p.add_argument("--eval", required=True, help="the experiment's eval.json")
    p.add_argument("--metrics", required=True, help="the train stage's metrics.csv (one row per step)")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    try:
        written = render(args.experiment, args.eval, args.metrics, args.out_dir)
    except QerlError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(str(Path(args.out_dir) / f) for f in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
