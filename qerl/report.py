"""What `snakemake --report` shows of one experiment: its accuracies with 95% intervals and its training curves.

    python -m qerl.report --experiment demo --eval results/demo/eval.json \
        --metrics results/demo/adapter/metrics.csv --out-dir results/demo/report

Writes accuracy.html (one row per benchmark, model and decoding: accuracy, 95% interval, problems x samples, change
from the base model), accuracy.png (the same as bars with their intervals), training_curves.png (one figure: reward
across the top, then the other curves of metrics.csv by importance, every step as the trainer logged it; a curve
whose metrics were not logged has no panel) and landing.html (the table and that figure in one HTML fragment, the
figure inlined, for the report's landing page: workflow/report/workflow.rst includes it). The workflow's
experiment_report rule runs it after evaluate and marks these files for the report (workflow/report/*.rst are their
captions). Plain files: they open without Snakemake too. The run descriptions MLflow shows come from here too
(`accuracy_markdown`, `training_markdown`).
"""
from __future__ import annotations

import argparse
import base64
import csv
import html
import math
import sys
from pathlib import Path

from qerl.errors import QerlError
from qerl.evaluation import load_eval_json
from qerl.io import atomic_dir

# curve -> (title, y label, metrics.csv columns drawn, smoothed), by importance: the order of the figure's panels,
# reward first, then the four of the trainer's own figure; only columns the run logged are drawn.
# Smoothed: the first column also gets its moving average over a tenth of the run (GRPO metrics are noisy per step).
CURVES = {
    "reward": ("reward (mean over the batch's completions)", "reward", ("reward", "rewards/*/mean"), True),
    "entropy": ("policy entropy per completion token", "nats", ("entropy",), True),
    "aqn_sigma": ("AQN noise sigma on the RMSNorm scales", "sigma", ("aqn/sigma",), False),
    "completion_length": ("completion length", "tokens", ("completions/mean_length", "completions/max_length"),
                          True),
    "kl": ("KL to the reference policy", "KL", ("kl",), True),
    "loss": ("GRPO loss", "loss", ("loss",), True),
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


_HEADER = ("<tr><th>benchmark</th><th>model</th><th>decoding</th><th>accuracy %</th><th>95% interval</th>"
           "<th>problems x samples</th><th>vs base (points)</th></tr>")
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
{header}
{rows}
</table>
<p class="note">{note}</p>
</body></html>
"""
# The landing page is a fragment inside Snakemake's report page: its styles apply to .qerl-landing alone.
_LANDING = """<section class="qerl-landing">
<style>
.qerl-landing table {{ border-collapse: collapse; margin: 0.5em 0; }}
.qerl-landing th, .qerl-landing td {{ padding: 0.2em 0.6em; border-bottom: 1px solid #ddd; white-space: nowrap; }}
.qerl-landing td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.qerl-landing p {{ color: #555; font-size: 0.85em; margin: 0.3em 0 1em; }}
.qerl-landing img {{ width: 100%; max-width: 52rem; margin: 0; }}
</style>
<h3>{experiment}</h3>
<table>
{header}
{rows}
</table>
<p>{note}</p>
<img src="data:image/png;base64,{curves}" alt="{experiment}: training curves, reward first">
</section>
"""


def _table_rows(doc: dict) -> list[str]:
    cells = []
    for r in accuracy_rows(doc):
        low, high = r["ci95"]
        delta = "" if r["vs_base"] is None else f"{100 * r['vs_base']:+.1f}"
        cells.append(f"<tr><td>{html.escape(r['benchmark'])}</td><td>{html.escape(r['variant'])}</td>"
                     f"<td>{html.escape(r['mode'])}</td><td class=\"num\"><b>{_pct(r['accuracy'])}</b></td>"
                     f"<td class=\"num\">[{_pct(low)}, {_pct(high)}]</td>"
                     f"<td class=\"num\">{r['n_problems']} x {r['k']}</td><td class=\"num\">{delta}</td></tr>")
    return cells


def _note(doc: dict) -> str:
    methods = sorted({r["ci_method"] for r in accuracy_rows(doc)})
    return ("Accuracy: pass@1 averaged over the samples of each problem. 95% interval over problems, "
            + "; ".join(html.escape(_CI_METHODS.get(m, m)) for m in methods)
            + f". Evaluated {html.escape(str(doc.get('created', '')))} with the {html.escape(doc['engine'])} engine; "
            "every completion, graded, in eval_records/ beside eval.json.")


def accuracy_html(doc: dict) -> str:
    """A self-contained HTML table of the accuracies (the report shows it as a page of its own)."""
    return _HTML.format(title=html.escape(f"{doc['experiment']}: accuracy"), header=_HEADER,
                        rows="\n".join(_table_rows(doc)), note=_note(doc))


def landing_html(doc: dict, curves_png: str | Path) -> str:
    """The report's landing page for one experiment: the accuracy table, then the training curves figure (inlined as
    a data URI: the report is one file)."""
    curves = base64.b64encode(Path(curves_png).read_bytes()).decode("ascii")
    return _LANDING.format(experiment=html.escape(doc["experiment"]), header=_HEADER,
                           rows="\n".join(_table_rows(doc)), note=_note(doc), curves=curves)


def accuracy_markdown(doc: dict) -> str:
    """The accuracies as a markdown table (the evaluate run's description in MLflow)."""
    lines = ["| benchmark | model | decoding | accuracy % | 95% interval | problems x samples | vs base |",
             "|---|---|---|---|---|---|---|"]
    for r in accuracy_rows(doc):
        low, high = r["ci95"]
        delta = "" if r["vs_base"] is None else f"{100 * r['vs_base']:+.1f}"
        lines.append(f"| {r['benchmark']} | {r['variant']} | {r['mode']} | **{_pct(r['accuracy'])}** | "
                     f"[{_pct(low)}, {_pct(high)}] | {r['n_problems']} x {r['k']} | {delta} |")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(doc: dict, out_png: str | Path) -> Path:
    """Horizontal bars of the accuracies with their 95% intervals, labelled with the numbers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(accuracy_rows(doc))))
    _draw_accuracy(ax, doc)
    return _save(fig, plt, out_png)


def _draw_accuracy(ax, doc: dict) -> None:
    rows = accuracy_rows(doc)[::-1]  # matplotlib draws the first bar at the bottom
    colors = {"base": "#9e9e9e", "quantized_base": "#6baed6", "trained": "#e6550d"}
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


def plot_summary(doc: dict, metrics: dict[str, list[float]], out_png: str | Path) -> Path:
    """The run in one image (README's): the accuracy bars beside the reward curve."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, max(3.2, 1.2 + 0.45 * len(accuracy_rows(doc)))),
                                      gridspec_kw={"width_ratios": [1.15, 1]})
    _draw_accuracy(left, doc)
    if not _draw_curve(right, metrics, "reward"):
        right.text(0.5, 0.5, "no reward was logged", ha="center", va="center")
        right.set_axis_off()
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


def metrics_from_history(history: list[dict]) -> dict[str, list[float]]:
    """The trainer's log history (one dict per step) as read_metrics gives metrics.csv."""
    rows = sorted(history, key=lambda row: row["step"])
    keys = sorted({k for row in rows for k in row}) if rows else ["step"]
    return {k: [float(row[k]) if isinstance(row.get(k), (int, float)) else math.nan for row in rows] for k in keys}


def _draw_curve(ax, metrics: dict[str, list[float]], name: str) -> bool:
    """CURVES[name] on ax; False (nothing drawn) when the run logged none of its columns."""
    title, ylabel, wanted, smooth = CURVES[name]
    columns = _columns(metrics, wanted)
    if not columns:
        return False
    steps = metrics["step"]
    for i, col in enumerate(columns):
        ax.plot(steps, metrics[col], label=col, lw=1.0 if i == 0 else 0.9, alpha=1.0 if i == 0 else 0.7,
                ls="-" if i == 0 else "--", drawstyle="default" if smooth else "steps-post")
    if smooth and len(steps) >= 10:
        window = max(2, len(steps) // 10)
        ax.plot(steps, _moving_average(metrics[columns[0]], window), color="black", lw=2,
                label=f"{columns[0]}, mean of {window} steps")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return True


def logged_curves(metrics: dict[str, list[float]]) -> list[str]:
    """The CURVES the run logged, in the figure's order."""
    return [name for name in CURVES if _columns(metrics, CURVES[name][2])]


def plot_training_curves(metrics: dict[str, list[float]], out_png: str | Path, experiment: str = "") -> Path:
    """One figure of every logged curve: reward across the top row, the others below it three to a row, in CURVES'
    order (a run that logged no curve gets a figure saying so, so the file is always there)."""
    plt = _pyplot()
    names = logged_curves(metrics)
    head, rest = names[:1], names[1:]
    rows = (len(rest) + 2) // 3
    fig = plt.figure(figsize=(12, 3.4 + 2.8 * rows))
    grid = fig.add_gridspec(1 + rows, 3, height_ratios=[1.25] + [1] * rows)
    for name in head:
        _draw_curve(fig.add_subplot(grid[0, :]), metrics, name)
    for i, name in enumerate(rest):
        _draw_curve(fig.add_subplot(grid[1 + i // 3, i % 3]), metrics, name)
    if not names:
        fig.text(0.5, 0.5, "no training curve was logged", ha="center", va="center")
    fig.suptitle(f"{experiment}: training curves, one point per step" if experiment else "training curves",
                 fontsize=12)
    return _save(fig, plt, out_png)


def training_markdown(metrics: dict[str, list[float]]) -> str:
    """The headline of a training run (its MLflow description): steps, then each headline curve at the start and the
    end of training, each the mean over a tenth of the steps (GRPO's per-step values are noisy)."""
    steps = [s for s in metrics.get("step", []) if math.isfinite(s)]
    if not steps:
        return "no step was logged"
    window = max(1, len(steps) // 10)
    lines = [f"{len(steps)} steps (to step {int(max(steps))}); start and end: means over the first and last "
             f"{window} step{'s' if window > 1 else ''}", "", "| metric | start | end |", "|---|---|---|"]
    for name in ("reward", "entropy", "aqn_sigma", "completion_length", "kl", "timing"):
        for col in _columns(metrics, CURVES[name][2])[:1]:
            values = [v for v in metrics[col] if math.isfinite(v)]
            first, last = values[:window], values[-window:]
            lines.append(f"| {col} | {sum(first) / len(first):.4g} | {sum(last) / len(last):.4g} |")
    return "\n".join(lines)


def _save(fig, plt, out_png: str | Path) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------------ entry points
def render(experiment: str, eval_json: str | Path, metrics_csv: str | Path, out_dir: str | Path) -> list[Path]:
    """Write accuracy.html, accuracy.png, training_curves.png, summary.png and landing.html under out_dir (replaced
    whole, atomically); returns the files, relative to out_dir."""
    doc = load_eval_json(eval_json)
    metrics = read_metrics(metrics_csv)
    with atomic_dir(out_dir) as tmp:
        (tmp / "accuracy.html").write_text(accuracy_html(doc), encoding="utf-8")
        plot_accuracy(doc, tmp / "accuracy.png")
        plot_training_curves(metrics, tmp / "training_curves.png", experiment)
        plot_summary(doc, metrics, tmp / "summary.png")
        (tmp / "landing.html").write_text(landing_html(doc, tmp / "training_curves.png"), encoding="utf-8")
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
