"""qerl.report: the accuracies and training curves `snakemake --report` shows, from eval.json and metrics.csv, and
the landing page of a real `snakemake --report` over the workflow's own report rule and captions."""
from __future__ import annotations

import base64
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qerl.errors import QerlError
from qerl.evaluation import benchmark_entry, load_eval_json, pass_at_1_stats, write_eval_json
from qerl.report import (CURVES, accuracy_html, accuracy_markdown, accuracy_rows, landing_html, logged_curves, main,
                         metrics_from_history, read_metrics, render, training_markdown)

REPO = Path(__file__).resolve().parents[1]


def _entry(correct: list[bool], variant: str, mode: str = "greedy") -> dict:
    summary = {**pass_at_1_stats([[c] for c in correct]), "mode": mode, "kind": "numeric",
               "template": "answer_line", "n_samples": len(correct), "mean_response_tokens": 3.0, "n_truncated": 0,
               "sampling": {"temperature": 0.0}}
    return benchmark_entry(summary, benchmark="demo", variant=variant, model_path="m", per_problem_path="p",
                           seconds=1.0)


@pytest.fixture
def eval_json(tmp_path):
    doc = {"experiment": "demo", "created": "2026-01-01T00:00:00+00:00", "model": {"path": "m"}, "engine": "torch",
           "mlflow_run_id": "r", "benchmarks": {
               "demo/trained/greedy": _entry([True, True, True, False], "trained"),
               "demo/base/greedy": _entry([True, False, False, False], "base")}}
    return write_eval_json(doc, tmp_path / "demo" / "eval.json")


@pytest.fixture
def metrics_csv(tmp_path):
    path = tmp_path / "metrics.csv"
    cols = ["step", "reward", "rewards/correctness/mean", "entropy", "loss", "aqn/sigma"]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for step in (3, 1, 2):  # rows in any order are drawn by step
            w.writerow({"step": step, "reward": 0.1 * step, "rewards/correctness/mean": 0.1 * step,
                        "entropy": 1.0 / step, "loss": 0.01, "aqn/sigma": 0.0 if step == 1 else 1e-2})
    return path


def test_rows_put_the_base_first_and_give_the_change_from_it(eval_json):
    from qerl.evaluation import load_eval_json

    rows = accuracy_rows(load_eval_json(eval_json))
    assert [r["variant"] for r in rows] == ["base", "trained"]
    assert rows[0]["vs_base"] is None and rows[1]["vs_base"] == pytest.approx(0.5)


def test_the_table_holds_each_accuracy_with_its_interval(eval_json):
    from qerl.evaluation import load_eval_json

    doc = load_eval_json(eval_json)
    page = accuracy_html(doc)
    for res in doc["benchmarks"].values():
        low, high = res["ci95"]
        assert f"<b>{100 * res['accuracy']:.1f}</b>" in page and f"[{100 * low:.1f}, {100 * high:.1f}]" in page
    assert "+50.0" in page and "Wilson score" in page


def test_render_writes_the_table_the_chart_one_curves_figure_and_the_landing_page(eval_json, metrics_csv, tmp_path):
    out = tmp_path / "report"
    written = {str(p) for p in render("demo", eval_json, metrics_csv, out)}
    assert written == {"accuracy.html", "accuracy.png", "training_curves.png", "landing.html", "summary.png"}
    for name in ("accuracy.png", "training_curves.png", "summary.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<table>" in (out / "accuracy.html").read_bytes()
    assert read_metrics(metrics_csv)["step"] == [1.0, 2.0, 3.0]


def test_the_curves_go_by_importance_reward_first_and_only_those_logged(metrics_csv):
    assert list(CURVES)[:4] == ["reward", "entropy", "aqn_sigma", "completion_length"]  # the trainer's own four
    assert list(CURVES).index("kl") < list(CURVES).index("timing")
    assert logged_curves(read_metrics(metrics_csv)) == ["reward", "entropy", "aqn_sigma", "loss"]  # no kl, ...


def test_the_landing_page_is_the_table_then_the_curves_figure(eval_json, metrics_csv, tmp_path):
    out = tmp_path / "report"
    render("demo", eval_json, metrics_csv, out)
    page = landing_html(load_eval_json(eval_json), out / "training_curves.png")
    assert page == (out / "landing.html").read_text()
    assert "<html" not in page and "<body" not in page  # a fragment, placed inside the report's page
    table, figure = page.index("<table>"), page.index("<img ")
    assert table < figure
    for res in load_eval_json(eval_json)["benchmarks"].values():
        low, high = res["ci95"]
        assert f"<b>{100 * res['accuracy']:.1f}</b>" in page and f"[{100 * low:.1f}, {100 * high:.1f}]" in page
    inlined = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(inlined) == (out / "training_curves.png").read_bytes()


def test_the_markdown_headlines(eval_json):
    table = accuracy_markdown(load_eval_json(eval_json))
    assert table.splitlines()[0].startswith("| benchmark | model |")
    assert "| demo | base | greedy | **25.0** |" in table and "| demo | trained | greedy | **75.0** |" in table
    assert "+50.0 |" in table
    history = [{"step": s, "reward": 0.1 * s, "entropy": 1.0, "loss": 0.0} for s in range(20, 0, -1)]
    head = training_markdown(metrics_from_history(history))
    assert head.startswith("20 steps (to step 20); start and end: means over the first and last 2 steps")
    assert "| reward | 0.15 | 1.95 |" in head and "| entropy | 1 | 1 |" in head
    assert "loss" not in head  # the headline curves only
    assert training_markdown({"step": []}) == "no step was logged"


def _toy_workflow(tmp_path: Path, eval_json: Path, metrics_csv: Path) -> Path:
    """A workflow of the repository's report rule alone (the names it takes from common.smk defined here), over an
    eval.json and a metrics.csv in place of the pipeline's."""
    work = tmp_path / "work"
    (work / "results" / "demo" / "adapter").mkdir(parents=True)
    (work / "results" / "demo" / "eval.json").write_bytes(eval_json.read_bytes())
    (work / "results" / "demo" / "adapter" / "metrics.csv").write_bytes(metrics_csv.read_bytes())
    (work / "Snakefile").write_text(f"""import sys
from qerl import paths
from qerl.paths import Layout
LAYOUT = Layout("results")
PYTHON = sys.executable
def eval_json(experiment):
    return str(LAYOUT.eval_json(experiment))
def adapter_dir(experiment):
    return str(LAYOUT.adapter(experiment))
def log_file(stage):
    return str(paths.log_file("{{experiment}}", stage))
include: {str(REPO / "workflow" / "rules" / "report.smk")!r}
rule all:
    input: report_files("demo")
""")
    return work


def test_the_report_opens_on_the_accuracy_table_and_the_curves_figure(eval_json, metrics_csv, tmp_path):
    work = _toy_workflow(tmp_path, eval_json, metrics_csv)
    for args in (["--cores", "1"], ["--report", "report.html"]):
        proc = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(work / "Snakefile"), *args],
                              cwd=work, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    page = (work / "report.html").read_text()
    landing = json.loads(re.search(r"var workflow_desc = (.*);\n", page).group(1))
    figure = (work / "results" / "demo" / "report" / "training_curves.png").read_bytes()
    for res in load_eval_json(eval_json)["benchmarks"].values():
        low, high = res["ci95"]
        assert f"<b>{100 * res['accuracy']:.1f}</b>" in landing and f"[{100 * low:.1f}, {100 * high:.1f}]" in landing
    assert f"data:image/png;base64,{base64.b64encode(figure).decode()}" in landing
    assert landing.index("<table>") < landing.index("<img ") < landing.index("qerl: reinforcement learning")
    results = json.loads(re.search(r"var results = (\{.*\});\n", page).group(1))
    assert sorted(r["name"] for r in results.values()) == ["accuracy.html", "accuracy.png", "training_curves.png"]
    curves = next(r for r in results.values() if r["name"] == "training_curves.png")
    assert curves["labels"] == {"experiment": "demo", "figure": "curves"}
    assert "most telling first" in curves["caption"]


def test_a_missing_input_is_one_line(eval_json, tmp_path, capsys):
    argv = ["--experiment", "demo", "--eval", str(eval_json), "--metrics", str(tmp_path / "nope.csv"),
            "--out-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: metrics file") and "nope.csv" in err and "\n" not in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(QerlError, match="no 'step' column"):
        (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
        read_metrics(tmp_path / "bad.csv")


def test_the_summary_is_the_accuracy_bars_beside_the_reward_curve(eval_json, metrics_csv, tmp_path, monkeypatch):
    import qerl.report as report
    from qerl.evaluation import load_eval_json

    figures = []
    real_save = report._save
    monkeypatch.setattr(report, "_save", lambda fig, plt, out: figures.append(fig) or real_save(fig, plt, out))
    doc, metrics = load_eval_json(eval_json), read_metrics(metrics_csv)
    report.plot_summary(doc, metrics, tmp_path / "summary.png")
    left, right = figures[0].axes
    bars = sorted(p.get_width() for p in left.patches)
    assert bars == sorted(100 * r["accuracy"] for r in accuracy_rows(doc))
    reward = report._columns(metrics, CURVES["reward"][2])[0]
    assert right.get_title() == CURVES["reward"][0] and list(right.lines[0].get_ydata()) == metrics[reward]
