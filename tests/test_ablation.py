"""Ablations: methods x seeds expanded into experiments, the render (curves, table, numbers), and the Snakemake
target end to end on a tiny random model."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qerl import ablation
from qerl.config import parse_config
from qerl.errors import QerlError

REPO = Path(__file__).resolve().parents[1]


def base_experiment(model: str = "resources/tiny-qwen2") -> dict:
    return {
        "model": model, "model_size": "0.1B", "row": "demo", "quantize": {"scheme": "nvfp4"},
        "train": {"mode": "qlora_fp4",
                  "data": {"source": "resources/demo_task/train.jsonl", "answer_kind": "numeric",
                           "template": "answer_line", "limit": 8},
                  "rewards": ["correctness", "answer_line_format"], "reward_weights": [1.0, 0.1],
                  "num_generations": 2, "batch_size": 2, "micro_batch_size": 4, "max_steps": 2,
                  "learning_rate": 1e-3, "max_prompt_length": 128, "max_completion_length": 4,
                  "lora": {"lora_r": 2, "lora_alpha": 4},
                  "aqn": {"sigma_start": 1e-2, "sigma_end": 1e-3, "num_stages": 2},
                  "rollout": {"temperature": 1.0, "stop": ["\n"]}, "dtype": "float32", "save_steps": 2},
        "eval": {"benchmarks": [{"name": "demo", "source": "resources/demo_task/test.jsonl"},
                                {"name": "demo_large", "source": "resources/demo_task/heldout.jsonl"}],
                 "variants": ["trained", "base"], "greedy": True, "sampled": False, "max_new_tokens": 4,
                 "limit": 3, "batch_size": 8, "dtype": "float32"},
    }


METHODS = {"bf16_lora": {"label": "BF16 LoRA", "quantize": {"scheme": "bf16"}, "train": {"mode": "lora", "aqn": None}},
           "nvfp4_lora": {"label": "NVFP4 LoRA", "train": {"aqn": None}},
           "nvfp4_lora_aqn": {"label": "NVFP4 LoRA + AQN"}}


def config(methods=METHODS, seeds=(0, 1), **extra) -> dict:
    return {"default_target": "tiny", "experiments": {"tiny": base_experiment()},
            "ablations": {"abl": {"base": "tiny", "seeds": list(seeds), "methods": methods,
                                  "train": {"max_steps": 2}, "smooth_steps": 2, **extra}}}


# ------------------------------------------------------------------------------------------ expansion
def test_each_method_and_seed_is_an_experiment_off_the_base():
    cfg = ablation.expand_ablations(parse_config(config()))
    names = [n for n in cfg.experiments if n != "tiny"]
    assert names == [f"abl-{m}-s{s}" for m in METHODS for s in (0, 1)]
    assert ablation.ablation_run_names(cfg) == set(names)  # what all_experiments leaves out
    bf16, aqn = cfg.experiments["abl-bf16_lora-s1"], cfg.experiments["abl-nvfp4_lora_aqn-s0"]
    assert (bf16.train.mode, bf16.quantize.scheme, bf16.train.aqn, bf16.train.seed) == ("lora", "bf16", None, 1)
    assert aqn.train.aqn.sigma_start == 1e-2 and aqn.train.lora.lora_r == 2  # the rest is the base's
    assert all(e.row is None for n, e in cfg.experiments.items() if n != "tiny")  # never a paper-table row
    # one untrained evaluation per base: bf16 at the first bf16 run, NVFP4 at the first NVFP4 run
    variants = {n: e.eval.variants for n, e in cfg.experiments.items() if n != "tiny"}
    assert variants["abl-bf16_lora-s0"] == ["trained", "base"]
    assert variants["abl-nvfp4_lora-s0"] == ["trained", "quantized_base"]
    assert variants["abl-nvfp4_lora_aqn-s0"] == variants["abl-bf16_lora-s1"] == ["trained"]


def test_runs_share_a_quantized_checkpoint_when_model_and_scheme_agree():
    sources = ablation.quantize_sources(parse_config(config()))
    assert sources == {"abl-bf16_lora-s1": "abl-bf16_lora-s0", "abl-nvfp4_lora-s1": "abl-nvfp4_lora-s0",
                       "abl-nvfp4_lora_aqn-s0": "abl-nvfp4_lora-s0", "abl-nvfp4_lora_aqn-s1": "abl-nvfp4_lora-s0"}


def test_bad_ablations_fail_in_one_line_naming_them():
    bad = {"m": {"label": "M", "train": {"mode": "qlora_fp4"}, "quantize": {"scheme": "bf16"}}}
    with pytest.raises(QerlError, match=r"^ablations\.abl\.methods\.m: .*qlora_fp4 needs quantize.scheme"):
        ablation.expand_ablations(parse_config(config(methods=bad)))
    with pytest.raises(QerlError, match=r"ablations\.abl\.methods\.m: train\.learning_rat: .*[Ee]xtra"):
        ablation.expand_ablations(parse_config(config(methods={"m": {"label": "M",
                                                                      "train": {"learning_rat": 1}}})))
    with pytest.raises(QerlError, match="base 'nope' an experiment"):
        parse_config({**config(), "ablations": {"abl": {"base": "nope", "methods": METHODS}}})
    taken = config()
    taken["experiments"]["abl-bf16_lora-s0"] = base_experiment()
    with pytest.raises(QerlError, match="run 'abl-bf16_lora-s0' is also an experiment"):
        ablation.expand_ablations(parse_config(taken))


# ------------------------------------------------------------------------------------------ render
def _eval_doc(name: str, accs: dict[tuple[str, str], tuple[float, int]]) -> dict:
    from qerl.evaluation import benchmark_entry, validate_eval, wilson_interval

    entries = {}
    for (bench, variant), (acc, n) in accs.items():
        low, high = wilson_interval(acc * n, n)
        summary = {"mode": "greedy", "accuracy": acc, "stderr": 0.01, "ci95_low": low, "ci95_high": high,
                   "ci_method": "wilson", "n_problems": n, "k": 1, "n_samples": n, "mean_response_tokens": 3.0,
                   "n_truncated": 0, "kind": "numeric", "template": "answer_line", "sampling": {}}
        entries[f"{bench}/{variant}/greedy"] = benchmark_entry(summary, benchmark=bench, variant=variant,
                                                               model_path="m", per_problem_path="p", seconds=1.0)
    return validate_eval({"experiment": name, "created": "2026-01-01T00:00:00+00:00",
                          "model": {"path": "m", "base": "", "quantized": ""}, "engine": "torch",
                          "mlflow_run_id": "r", "benchmarks": entries})


def _fake_run(root: Path, name: str, reward: float, acc: float, with_base: bool = False) -> dict:
    run = root / name
    run.mkdir(parents=True)
    with (run / "metrics.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step", "reward", "rewards/correctness/mean", "entropy", "aqn/sigma"])
        w.writerows([[s, reward + 0.01 * s, reward, 0.5 - 0.01 * s, 0] for s in range(1, 11)])
    accs = {("demo", "trained"): (acc, 150), ("demo_large", "trained"): (acc / 2, 100)}
    if with_base:
        accs |= {("demo", "base"): (0.26, 150), ("demo_large", "base"): (0.08, 100)}
    (run / "eval.json").write_text(json.dumps(_eval_doc(name, accs)))
    return {"metrics": str(run / "metrics.csv"), "eval": str(run / "eval.json")}


def test_render_writes_bands_and_a_table_with_intervals_and_seed_spread(tmp_path):
    spec = {"name": "abl", "base": "demo", "smooth_steps": 3, "methods": {
        "lora": {"label": "BF16 LoRA", "runs": {"0": _fake_run(tmp_path, "l0", 0.2, 0.40, with_base=True),
                                                "1": _fake_run(tmp_path, "l1", 0.3, 0.50)}},
        "fp4": {"label": "NVFP4 LoRA", "runs": {"0": _fake_run(tmp_path, "f0", 0.3, 0.60),
                                                "1": _fake_run(tmp_path, "f1", 0.4, 0.62)}}}}
    paths = ablation.render(spec, tmp_path / "out")
    assert paths["curves"].stat().st_size > 10_000
    summary = json.loads(paths["summary"].read_text())
    lora = summary["methods"]["lora"]["benchmarks"]["demo"]
    assert lora["mean"] == pytest.approx(0.45) and lora["seeds"] == [0.4, 0.5]
    assert lora["sd"] == pytest.approx(0.0707, abs=1e-4)
    assert lora["ci95_low"] < 0.45 < lora["ci95_high"] and lora["ci95_high"] - lora["ci95_low"] < 0.12  # 300 items
    assert summary["methods"]["fp4"]["final_reward"][0] == pytest.approx(0.3 + 0.01 * 9)  # last 3 steps' mean
    assert summary["methods"]["fp4"]["final_correct"] == [pytest.approx(0.3), pytest.approx(0.4)]
    table = paths["table"].read_text()
    assert "| BF16 LoRA | 45.0 [" in table and "40.0 / 50.0 (7.1)" in table
    assert "| base, no training | 26.0 [" in table and "demo_large" in table


def _diagnostics_run(root: Path, name: str, zero_std: float, kl: float | None) -> dict:
    """A run whose metrics.csv has the trainer's diagnostics; quant/kl every 2nd step, or never (a dense method)."""
    run = _fake_run(root, name, 0.2, 0.4)
    head = ["step", "reward", "rewards/correctness/mean", "rewards/answer_line_format_if_correct/mean", "entropy",
            "frac_reward_zero_std", "frac_groups_none_correct", "rollout/entropy", "adapter/update_norm", "quant/kl"]
    with open(run["metrics"], "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(head)
        w.writerows([[s, 0.2, 0.1, 0.5, 0.4, zero_std, 0.25, 0.9, 0.01 * s, "" if kl is None or s % 2 else kl * s]
                     for s in range(1, 5)])
    return run


def test_render_plots_the_diagnostics_per_method(tmp_path):
    spec = {"name": "abl", "base": "demo", "smooth_steps": 2, "methods": {
        "lora": {"label": "BF16 LoRA", "runs": {"0": _diagnostics_run(tmp_path, "l0", 0.5, None)}},
        "fp4": {"label": "NVFP4 LoRA", "runs": {"0": _diagnostics_run(tmp_path, "f0", 0.75, 0.1),
                                                "1": _diagnostics_run(tmp_path, "f1", 0.25, 0.2)}}}}
    paths = ablation.render(spec, tmp_path / "out")
    assert paths["diagnostics"].name == "diagnostics.png" and paths["diagnostics"].stat().st_size > 10_000
    fp4 = json.loads(paths["summary"].read_text())["methods"]["fp4"]["diagnostics"]
    assert fp4["frac_reward_zero_std"] == [0.75, 0.25] and fp4["rewards/format"] == [0.5, 0.5]
    assert fp4["adapter/update_norm"] == [pytest.approx(0.025), pytest.approx(0.025)]  # (1 + 2 + 3 + 4) / 4 / 100
    assert fp4["quant/kl"] == [pytest.approx(0.3), pytest.approx(0.6)]  # steps 2 and 4 only: (2 + 4) / 2 x kl
    lora = json.loads(paths["summary"].read_text())["methods"]["lora"]["diagnostics"]
    assert lora["quant/kl"] == [None] and lora["rollout/entropy"] == [0.9]
    assert "| NVFP4 LoRA |" in paths["table"].read_text() and "| 0.75 / 0.25 |" in paths["table"].read_text()
    assert ablation.band([[1.0, math.nan], [3.0, math.nan]]) == ([2.0, pytest.approx(math.nan, nan_ok=True)],
                                                                 [1.0, pytest.approx(math.nan, nan_ok=True)],
                                                                 [3.0, pytest.approx(math.nan, nan_ok=True)])


def test_moving_average_and_band():
    assert ablation.moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert ablation.band([[1, 2, 3], [3, 4]]) == ([2, 3], [1, 2], [3, 4])
    assert ablation.band([[1, math.nan], [3, 5]]) == ([2, 5], [1, 5], [3, 5])  # a seed without a value: left out


# ------------------------------------------------------------------------------------------ the target
def test_the_snakemake_target_trains_every_run_and_renders_it(tmp_path, tokenizer_dir, data_dir, monkeypatch):
    """`snakemake abl` on the tiny model, one method x two seeds (one quantized checkpoint for both): the curves,
    the table with the untrained quantized base, and an MLflow run with both as artifacts."""
    cfg = config(methods={"nvfp4_lora_aqn": METHODS["nvfp4_lora_aqn"]}, train={"max_steps": 1},
                 eval={"benchmarks": [{"name": "demo", "source": "resources/demo_task/test.jsonl"}], "limit": 2})
    cfg |= {"tokenizer_dir": str(tokenizer_dir), "data_dir": str(data_dir), "mlflow": {"experiment_name": "abl-t"}}
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
           "--cores", "2", "abl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted((tmp_path / "logs").rglob("*.log")))
        pytest.fail(f"snakemake failed:\n{proc.stderr[-3000:]}\n{logs}")
    out = tmp_path / "results" / "ablations" / "abl"
    table = (out / "table1.md").read_text()
    assert "| NVFP4 LoRA + AQN | " in table and "| quantized base, no training | " in table
    assert json.loads((out / "ablation.json").read_text())["methods"]["nvfp4_lora_aqn"]["seeds_finished"] == 2
    assert (out / "curves.png").stat().st_size > 10_000
    assert [p.parent.name for p in (tmp_path / "results").glob("abl-*/quantized")] == ["abl-nvfp4_lora_aqn-s0"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    import mlflow

    from qerl.tracking import find_stage_runs

    (run,) = find_stage_runs("abl", tmp_path / "results", mlflow_experiment="abl-t")
    assert run["stage"] == "ablation" and "nvfp4_lora_aqn.demo.accuracy_mean" in run["metrics"]
    assert {"curves.png", "table1.md"} <= {a.path for a in mlflow.artifacts.list_artifacts(run_id=run["run_id"])}
