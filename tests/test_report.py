"""qerl.report: the accuracies and training curves `snakemake --report` shows, from eval.json and metrics.csv."""
from __future__ import annotations

import csv

import pytest

from qerl.errors import QerlError
from qerl.evaluation import benchmark_entry, pass_at_1_stats, write_eval_json
from qerl.report import CURVES, accuracy_html, accuracy_rows, main, read_metrics, render


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


def test_render_writes_the_table_the_chart_and_a_figure_per_logged_curve(eval_json, metrics_csv, tmp_path):
    out = tmp_path / "report"
    written = {str(p) for p in render("demo", eval_json, metrics_csv, out)}
    assert {"accuracy.html", "accuracy.png", "curves/reward.png", "curves/entropy.png", "curves/loss.png",
            "curves/aqn_sigma.png"} == written  # kl, grad_norm, ... were not logged: no empty figures
    for name in written:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" if name.endswith(".png") else b"<table>" in data
    assert set(CURVES) >= {"reward", "entropy", "loss", "kl", "aqn_sigma"}
    assert read_metrics(metrics_csv)["step"] == [1.0, 2.0, 3.0]


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
