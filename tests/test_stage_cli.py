"""Stage CLIs: user mistakes end as one line naming the culprit (exit 2), before any model is loaded."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from qerl.stage import run_main
from stage_errors import stage_error_line as _fails

EVAL_CFG = {"benchmarks": [{"name": "gsm8k"}], "variants": ["trained"], "max_new_tokens": 4, "limit": 2}


def test_evaluate_unknown_benchmark(capsys, tmp_path, data_dir):
    from qerl.evaluate import main

    cfg = dict(EVAL_CFG, benchmarks=[{"name": "gsm9k"}])
    line = _fails(capsys, main, ["--experiment", "x", "--trained", str(tmp_path), "--data-dir", str(data_dir),
                                 "--out", str(tmp_path / "e.json"), "--config-json", json.dumps(cfg)])
    assert "gsm9k" in line and "gsm8k" in line


def test_evaluate_dataset_without_answer_field(capsys, tmp_path):
    from qerl.evaluate import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    cfg = dict(EVAL_CFG, benchmarks=[{"name": "gsm8k", "source": str(bad)}])
    line = _fails(capsys, main, ["--experiment", "x", "--trained", str(tmp_path), "--out",
                                 str(tmp_path / "e.json"), "--config-json", json.dumps(cfg)])
    assert "answer" in line and "bad.jsonl" in line


def test_evaluate_model_dir_without_weights(capsys, tmp_path, data_dir, monkeypatch):
    from qerl.evaluate import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    line = _fails(capsys, main, ["--experiment", "x", "--trained", str(model), "--data-dir", str(data_dir),
                                 "--out", str(tmp_path / "e.json"), "--config-json", json.dumps(EVAL_CFG),
                                 "--results-dir", str(tmp_path / "res")])
    assert "has no weights" in line and str(model) in line


def test_train_bad_config_key(capsys, tmp_path):
    from qerl.train import main

    line = _fails(capsys, main, ["--experiment", "x", "--model", str(tmp_path), "--out", str(tmp_path / "a"),
                                 "--config-json", json.dumps({"data": {"source": "x"}, "lora_rank": 4})])
    assert "lora_rank: unknown key" in line


def test_quantize_missing_model_dir(capsys, tmp_path):
    from qerl.quantize import main

    line = _fails(capsys, main, ["--experiment", "x", "--model", str(tmp_path / "nope"), "--out",
                                 str(tmp_path / "q"), "--config-json", "{}"])
    assert "nope" in line


def test_merge_of_full_fine_tuning_output_is_the_model_in_bf16(tiny_model_dir, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from qerl.merge import main

    from qerl.tracking import find_stage_runs

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"  # the config's mlflow section, as the rule passes it
    run_main(main, ["--experiment", "x", "--base", str(tiny_model_dir), "--adapter", str(tiny_model_dir),
                    "--out", str(tmp_path / "merged"), "--config-json", "{}", "--results-dir", str(tmp_path),
                    "--mlflow-experiment", "probe-exp", "--tracking-uri", store])
    assert [r["stage"] for r in find_stage_runs("x", tmp_path, mlflow_experiment="probe-exp", uri=store)] == ["merge"]
    assert not (tmp_path / "mlflow.db").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert merged.dtype == torch.bfloat16
    for (name, a), b in zip(merged.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "merged" / "merge.json").read_text())["mode"] == "full"


def test_evaluate_logs_the_sampling_settings_only_of_a_sampled_evaluation():
    from qerl.config import parse_section
    from qerl.evaluate import logged_params

    greedy = logged_params(parse_section("eval", dict(EVAL_CFG, greedy=True, sampled=False)))
    assert "temperature" not in greedy and "top_p" not in greedy and greedy["greedy"] is True
    sampled = logged_params(parse_section("eval", dict(EVAL_CFG, sampled=True, temperature=0.7, top_p=0.9)))
    assert (sampled["temperature"], sampled["top_p"]) == (0.7, 0.9)


def test_logging_steps_sends_the_mean_of_each_window_and_the_last_partial_one(caplog):
    from qerl.train import LoggingWindow

    logged = []
    window = LoggingWindow(lambda m, s: logged.append((s, m)), every=3, total_steps=7)
    with caplog.at_level(logging.INFO, logger="qerl.train"):
        for step in range(1, 8):
            window({"reward": float(step), "aqn/sigma": None if step == 1 else 0.5}, step)
    assert [(s, m["reward"]) for s, m in logged] == [(3, 2.0), (6, 5.0), (7, 7.0)]
    assert logged[0][1]["aqn/sigma"] == 0.5  # a metric missing at a step averages over the steps that have it
    assert "step 3/7: reward 2" in caplog.text


@pytest.mark.parametrize("name", ["QERL_FP4_CUDA", "QERL_FP4_HUMMING", "QERL_PDL"])
def test_a_bad_kernel_switch_is_one_line_before_the_stage_starts(capsys, monkeypatch, name):
    ran = []
    monkeypatch.setenv(name, "yes")
    line = _fails(capsys, lambda argv: ran.append(argv), [])
    assert name in line and "auto, 0 or 1" in line and not ran


def test_a_gpu_sized_experiment_stops_in_one_line_on_a_machine_without_a_gpu(capsys, monkeypatch, tmp_path):
    """The rules pass --needs-gpu <model_size> for GPU-sized experiments: without CUDA the stage stops before it
    fetches or builds anything (a hub name that does not exist shows nothing was resolved); QERL_ALLOW_CPU=1 goes on."""
    import torch

    from qerl import quantize

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("QERL_ALLOW_CPU", raising=False)
    config = Path(__file__).resolve().parents[1] / "config" / "config.yaml"
    argv = ["--experiment", "qwen7b", "--config", str(config), "--model", "nobody/not-a-model", "--out",
            str(tmp_path / "q"), "--results-dir", str(tmp_path / "res"), "--needs-gpu", "7B"]
    line = _fails(capsys, quantize.main, argv)
    assert "'qwen7b' (model_size 7B) needs a CUDA GPU" in line and "QERL_ALLOW_CPU=1" in line
    monkeypatch.setenv("QERL_ALLOW_CPU", "1")
    line = _fails(capsys, quantize.main, argv)
    assert "needs a CUDA GPU" not in line and "nobody/not-a-model" in line  # past the check: the model is looked up
