"""Tables 1-3 from fake eval.json / bench json files: our values with intervals, the paper's beside, missing kept."""
from __future__ import annotations

import csv
import datetime
import json
import math

import pytest

from qerl import paper, tables
from qerl.errors import QerlError
from qerl.evaluation import Z95, pass_at_1_stats, result_key, write_eval_json


def _entry(benchmark, variant, n, n_correct, k=1, mode="sampled"):
    stats = pass_at_1_stats([[i < n_correct] * k for i in range(n)])
    return {"benchmark": benchmark, "variant": variant, "mode": mode, "accuracy": stats["accuracy"],
            "stderr": stats["stderr"], "ci95": [stats["ci95_low"], stats["ci95_high"]], "n_problems": n, "k": k,
            "mean_response_tokens": 100.0, "n_truncated": 0}


def _write_eval(path, experiment, entries):
    doc = {"experiment": experiment, "model": {"path": f"results/{experiment}/merged"},
           "created": datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc).isoformat(),
           "benchmarks": {result_key(e["benchmark"], e["variant"], e["mode"]): e for e in entries}}
    return write_eval_json(doc, path)


def _read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_only_demo_finished(tmp_path):
    demo_eval = _write_eval(tmp_path / "demo/eval.json", "demo",
                            [_entry("demo", "base", 150, 30, mode="greedy"),
                             _entry("demo", "trained", 150, 120, mode="greedy")])
    experiments = {"demo": {"row_key": "demo", "model_size": "tiny", "eval_path": str(demo_eval)},
                   "qwen7b-nvfp4-lora-aqn": {"row_key": "nvfp4_lora_aqn", "model_size": "7B",
                                             "eval_path": str(tmp_path / "not-yet/eval.json")}}
    written = tables.render_tables(experiments, tmp_path / "tables")
    md = written["table1.md"].read_text()
    assert md.count(f"| {tables.MISSING} |") == len(paper.TABLE1_ROWS) * len(paper.TABLE1_SIZES)
    assert "| 90.8 |" in md and "| 61.2 |" in md  # the paper's values are always shown
    assert "demo (base) |  |  | 20.0 [" in md and "demo (trained) |  |  | 80.0 [" in md
    rows = _read_csv(written["table1.csv"])
    demo = [r for r in rows if r["benchmark"] == "demo"]
    assert [float(r["ours_pct"]) for r in demo] == [20.0, 80.0] and all(r["paper_pct"] == "" for r in demo)
    assert all(r["status"] == "missing" and r["ours_pct"] == "" for r in rows if r["benchmark"] == "gsm8k")
    assert written["training_curves.png"].stat().st_size > 0
    t2 = written["table2.md"].read_text()
    assert "| 45.6 |" in t2 and tables.MISSING in t2


def test_trained_experiment_fills_its_row_and_no_training_rows(tmp_path):
    path = _write_eval(tmp_path / "e/eval.json", "qwen7b-nvfp4-lora-aqn", [
        _entry("gsm8k", "trained", 1319, 1200), _entry("gsm8k", "quantized_base", 1319, 970),
        _entry("gsm8k", "base", 1319, 1000), _entry("gsm8k", "trained", 1319, 1, mode="greedy"),
        _entry("math500", "trained", 500, 390, k=4), _entry("aime24", "trained", 30, 5, k=16),
        _entry("aime25", "trained", 30, 3, k=16), _entry("amc23", "trained", 40, 17, k=16)])
    experiments = {"qwen7b-nvfp4-lora-aqn": {"row_key": "nvfp4_lora_aqn", "model_size": "7b",
                                             "eval_path": str(path)}}
    loaded = tables.load_experiments(experiments)
    res, src = tables.lookup(loaded, "7B", "nvfp4_lora_aqn", "gsm8k")
    assert src == "qwen7b-nvfp4-lora-aqn" and res["mode"] == "sampled" and res["accuracy"] == 1200 / 1319
    assert tables.lookup(loaded, "7B", "nvfp4", "gsm8k")[0]["variant"] == "quantized_base"
    assert tables.lookup(loaded, "7B", "bf16", "gsm8k")[0]["variant"] == "base"
    assert tables.lookup(loaded, "7B", "nf4", "gsm8k") == (None, None)  # never borrowed from another format
    assert tables.lookup(loaded, "3B", "nvfp4_lora_aqn", "gsm8k") == (None, None)

    written = tables.render_tables(experiments, tmp_path / "tables", plots=False)
    rows = {(r["model_size"], r["row_key"]): r for r in _read_csv(written["table1.csv"])}
    row = rows[("7B", "nvfp4_lora_aqn")]
    assert float(row["ours_pct"]) == pytest.approx(100 * 1200 / 1319, abs=1e-4)
    assert float(row["paper_pct"]) == 90.8 and row["k"] == "1" and row["n_problems"] == "1319"
    assert float(row["ci95_low_pct"]) < float(row["ours_pct"]) < float(row["ci95_high_pct"])
    assert f"| {100 * 1200 / 1319:.1f} [" in written["table1.md"].read_text()

    t2 = {(r["model_size"], r["row_key"], r["benchmark"]): r for r in _read_csv(written["table2.csv"])}
    accs = [390 / 500, 5 / 30, 3 / 30, 17 / 40]
    avg = t2[("7B", "nvfp4_lora_aqn", "average")]
    assert float(avg["ours_pct"]) == pytest.approx(100 * sum(accs) / 4, abs=1e-4)
    ses = [pass_at_1_stats([[i < c] * k for i in range(n)])["stderr"]
           for n, c, k in [(500, 390, 4), (30, 5, 16), (30, 3, 16), (40, 17, 16)]]
    se = math.sqrt(sum(s * s for s in ses)) / 4
    assert float(avg["ci95_low_pct"]) == pytest.approx(100 * (sum(accs) / 4 - Z95 * se), abs=1e-3)
    assert float(avg["paper_pct"]) == 36.4
    aime = t2[("7B", "nvfp4_lora_aqn", "aime24")]
    assert float(aime["ci95_high_pct"]) - float(aime["ci95_low_pct"]) > 20  # 30 problems: a wide interval
    assert t2[("14B", "bf16_lora", "average")]["status"] == "missing"


def test_table3_from_bench_json(tmp_path):
    bench = {"lora": {"model_size_gb": 15.3, "rollout_tokens_per_s": {"2": 110.0, "8": 1600.0},
                      "e2e_step_seconds": {"2": 30.0, "4": 40.0, "8": 60.0}},
             "qerl": {"model_size_gb": 5.8, "rollout_tokens_per_s": {"2": 150.0},
                      "e2e_step_seconds": {"2": 20.0, "8": 50.0}}}
    experiments = {}
    for method, row in (("lora", "bf16_lora"), ("qerl", "nvfp4_lora_aqn")):
        (tmp_path / f"{method}.json").write_text(json.dumps(bench[method]))
        experiments[f"qwen7b-{method}"] = {"row_key": row, "model_size": "7B",
                                           "eval_path": str(tmp_path / "none.json"),
                                           "bench_path": str(tmp_path / f"{method}.json")}
    written = tables.render_tables(experiments, tmp_path / "t", plots=False)
    rows = {(r["model_size"], r["method"], r["metric"], r["batch_size"]): r for r in _read_csv(written["table3.csv"])}
    assert float(rows[("7B", "qerl", "e2e_speedup", "2")]["ours"]) == pytest.approx(1.5)
    assert float(rows[("7B", "qerl", "e2e_speedup", "2")]["paper"]) == 1.5
    assert rows[("7B", "qerl", "e2e_speedup", "4")]["status"] == "missing"  # no qerl bs4 measurement
    assert float(rows[("7B", "qerl", "rollout_tokens_per_s", "2")]["ours"]) == 150.0
    assert rows[("7B", "qerl", "rollout_tokens_per_s", "8")]["status"] == "missing"
    assert float(rows[("7B", "lora", "model_size_gb", "")]["ours"]) == 15.3
    assert rows[("7B", "qlora", "model_size_gb", "")]["status"] == "missing"
    assert rows[("3B", "qlora", "model_size_gb", "")]["paper"] == ""  # the paper does not report it
    assert "| 5.8 | 5.9 |" in written["table3.md"].read_text()


def test_bad_inputs_are_one_line_errors(tmp_path):
    bad = tmp_path / "eval.json"
    bad.write_text(json.dumps({"experiment": "x", "model": {"path": "p"}, "created": "now", "benchmarks": {
        "a": {"benchmark": "gsm8k"}}}))
    with pytest.raises(QerlError, match="benchmarks/a"):
        tables.render_tables({"x": {"row_key": "bf16_lora", "model_size": "3B", "eval_path": str(bad)}}, tmp_path)
    with pytest.raises(QerlError, match="row_key 'int8' is not one of"):
        tables.render_tables({"x": {"row_key": "int8", "model_size": "3B", "eval_path": str(bad)}}, tmp_path)
    with pytest.raises(QerlError, match="needs 'row_key' and 'model_size'"):
        tables.render_tables({"x": {"eval_path": str(bad)}}, tmp_path)


def test_plot_training_curves_from_csv_and_points(tmp_path):
    csv_path = tmp_path / "run_a" / "metrics.csv"
    csv_path.parent.mkdir()
    csv_path.write_text("step,reward,entropy,aqn/sigma\n1,0.1,0.5,0\n2,0.3,0.4,0.01\n3,0.5,0.35,0.005\n")
    out = tables.plot_training_curves([csv_path], tmp_path / "a.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tables.plot_training_curves({"b": [(1, 0.2, 0.6, 0.0), (2, 0.4, 0.5, 0.01)]}, tmp_path / "b.png")
    assert out.stat().st_size > 1000
    assert tables._read_metrics_csv(csv_path)[1] == (2.0, 0.3, 0.4, 0.01)


def test_cli(tmp_path, capsys):
    exp = tmp_path / "experiments.json"
    exp.write_text(json.dumps({"demo": {"row_key": "demo", "model_size": "tiny",
                                        "eval_path": str(tmp_path / "missing.json")}}))
    res = ["--results-dir", str(tmp_path / "res")]
    assert tables.main(["--experiments-json", str(exp), "--out-dir", str(tmp_path / "out"), "--no-plots", *res]) == 0
    assert (tmp_path / "out" / "table2.csv").exists()
    assert tables.main(["--experiments-json", str(tmp_path / "nope.json"), "--out-dir", str(tmp_path), *res]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_from_workflow_config(tmp_path):
    results = tmp_path / "results"
    _write_eval(results / "demo" / "eval.json", "demo", [_entry("demo", "trained", 150, 90, mode="greedy")])
    (results / "demo" / "adapter").mkdir(parents=True)
    (results / "demo" / "adapter" / "metrics.csv").write_text("step,reward,entropy,aqn/sigma\n1,0.2,0.5,0\n")
    config = {"experiments": {"demo": {"row": "demo", "model_size": "0.1B", "model": "m"},
                              "qwen3b-bf16-lora": {"row": "bf16_lora", "model_size": "3B", "model": "m"},
                              "scratch": {"row": None, "model": "m"}}}
    exps = tables.experiments_from_config(config, results)
    assert set(exps) == {"demo", "qwen3b-bf16-lora"}
    assert exps["demo"]["eval_path"] == str(results / "demo" / "eval.json")
    out = tmp_path / "tables"
    assert tables.main(["--config-json", json.dumps(config), "--results-dir", str(results),
                        "--out-dir", str(out)]) == 0
    assert "demo (trained) |  |  | 60.0 [" in (out / "table1.md").read_text()
    assert (out / "training_curves.png").stat().st_size > 1000


def test_speedup_cell_rounds_once():
    from qerl.tables import _speedup

    base = {"device": "d", "e2e_step_seconds": {"8": 24.855}}
    ours = {"device": "d", "e2e_step_seconds": {"8": 41.771}}
    value, cell = _speedup(base, ours, 8)
    assert cell == "x0.60 (41.8 s)" and value == 0.595
    assert _speedup(base, {**ours, "device": "other"}, 8) == (None, "- (41.8 s)")
