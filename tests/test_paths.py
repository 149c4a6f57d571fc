"""qerl.paths is the one results layout: the rules, the stage CLIs' defaults and the tables all use it."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from qerl.errors import QerlError
from qerl.paths import RESERVED_NAMES, STAGES, Layout, benchmark_file, eval_records_dir, log_file


def test_the_layout_under_any_results_dir():
    lay = Layout("/data/res")
    assert lay.results == Path("/data/res") and Layout().results == Path("results")
    exp = Path("/data/res/e1")
    assert (lay.quantized("e1"), lay.adapter("e1"), lay.merged("e1")) == (exp / "quantized", exp / "adapter",
                                                                            exp / "merged")
    assert lay.checkpoints("e1") == exp / "checkpoints"
    assert lay.eval_json("e1") == exp / "eval.json" and lay.eval_records("e1") == exp / "eval_records"
    assert [lay.run_file("e1", s) for s in STAGES] == [exp / "runs" / f"{s}.json" for s in STAGES]
    assert lay.metrics_csv("e1") == exp / "adapter" / "metrics.csv"
    assert lay.report("e1") == exp / "report"
    assert lay.tables() == Path("/data/res/tables") and lay.tables_run_file() == lay.tables() / "runs" / "tables.json"
    assert lay.bench_json("e1") == Path("/data/res/bench/e1.json")
    assert (lay.mlflow_db(), lay.mlartifacts()) == (Path("/data/res/mlflow.db"), Path("/data/res/mlartifacts"))
    assert log_file("e1", "train") == Path("logs/e1/train.log")
    assert benchmark_file("e1", "train") == Path("logs/e1/train.benchmark.tsv")
    assert eval_records_dir("/x/y/eval.json") == Path("/x/y/eval_records")


def test_a_hand_run_trains_into_the_rules_checkpoint_folder():
    from qerl.train import checkpoint_dir

    args = argparse.Namespace(checkpoint_dir=None, results_dir="res", experiment="e1", out="somewhere/adapter")
    assert checkpoint_dir(args) == Layout("res").checkpoints("e1")
    assert checkpoint_dir(argparse.Namespace(**{**vars(args), "checkpoint_dir": "ck"})) == Path("ck")


def test_stage_run_files_and_tables_inputs_follow_the_layout():
    from qerl.stage import default_run_file
    from qerl.tables import experiments_from_config

    args = argparse.Namespace(run_file=None, results_dir="res", experiment="e1")
    assert default_run_file(args, "merge") == Layout("res").run_file("e1", "merge")
    entry = experiments_from_config({"experiments": {"e1": {"row": "demo", "model_size": "0.1B"}}}, "res")["e1"]
    lay = Layout("res")
    assert entry["eval_path"] == str(lay.eval_json("e1")) and entry["bench_path"] == str(lay.bench_json("e1"))
    assert entry["metrics_path"] == str(lay.metrics_csv("e1"))


@pytest.mark.parametrize("name", sorted(RESERVED_NAMES))
def test_an_experiment_cannot_take_a_shared_folders_name(name):
    from qerl.config import parse_config

    exp = {"model": "org/m", "train": {"data": {"source": "x"}}, "eval": {"benchmarks": [{"name": "gsm8k"}]}}
    with pytest.raises(QerlError, match=f"experiments: .*'{name}' is taken by results/{name}/"):
        parse_config({"default_target": name, "experiments": {name: exp}})
