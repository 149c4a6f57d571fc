"""The whole Snakemake pipeline on CPU: a tiny random Qwen2 (real tokenizer) through all four stages."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STAGES = ("quantize", "train", "merge", "evaluate")
MLFLOW_EXPERIMENT = "qerl-e2e"  # not the default: the config's mlflow section must reach every stage


def tiny_config(tokenizer_dir: Path, data_dir: Path) -> dict:
    return {
        "default_target": "tiny",
        "tokenizer_dir": str(tokenizer_dir),
        "data_dir": str(data_dir),
        "mlflow": {"experiment_name": MLFLOW_EXPERIMENT},
        "experiments": {"tiny": {
            "model": "resources/tiny-qwen2",
            "model_size": "0.1B",
            "row": "demo",
            "quantize": {"scheme": "nvfp4"},
            "train": {
                "mode": "qlora_fp4",
                "data": {"source": "resources/demo_task/train.jsonl", "answer_kind": "numeric",
                         "template": "answer_line", "limit": 16},
                "rewards": ["correctness", "answer_line_format"], "reward_weights": [1.0, 0.1],
                "num_generations": 2, "batch_size": 2, "micro_batch_size": 2, "max_steps": 3,
                "learning_rate": 1e-3, "max_prompt_length": 128, "max_completion_length": 6,
                "lora": {"lora_r": 4, "lora_alpha": 8},
                "aqn": {"sigma_start": 1e-2, "sigma_end": 1e-3, "num_stages": 3},
                "rollout": {"temperature": 1.0}, "dtype": "float32", "save_steps": 2,
                "rollout_correction": "tis",
            },
            "eval": {
                "benchmarks": [{"name": "demo", "source": "resources/demo_task/test.jsonl"},
                               {"name": "gsm8k", "k": 2}],
                "variants": ["trained", "base", "quantized_base"],
                "greedy": True, "sampled": True, "max_new_tokens": 4, "limit": 4, "batch_size": 4,
                "dtype": "float32",
            },
        }},
    }


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--cores", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tokenizer_dir, data_dir):
    work = tmp_path_factory.mktemp("e2e")
    (work / "config").mkdir()
    (work / "config" / "config.yaml").write_text(yaml.safe_dump(tiny_config(tokenizer_dir, data_dir)))
    proc = snakemake(work)
    if proc.returncode != 0:
        logs = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"snakemake failed:\n{proc.stderr[-4000:]}\n{logs}")
    (work / "stdout.txt").write_text(proc.stdout)  # Snakemake's own log is on stderr
    return work


def test_the_run_ends_with_the_accuracies_and_where_the_logs_are(pipeline):
    from qerl.evaluation import load_eval_json

    console = (pipeline / "stdout.txt").read_text()
    doc = load_eval_json(pipeline / "results" / "tiny" / "eval.json")
    for key, res in doc["benchmarks"].items():
        line = next((line for line in console.splitlines()  # the summary table, not the progress lines
                     if f" {key} " in line and not line.startswith("qerl progress")), None)
        assert line and f"{100 * res['accuracy']:.1f} [" in line, console[-3000:]
    assert "logs/<experiment>/<stage>.log" in console
    assert (pipeline / "logs" / "tiny" / "train.log").read_text().count("step 3/3: reward") == 1
    # the console (Snakemake's stdout) gets each long stage's progress lines, not the rest of its log
    assert "qerl progress train tiny: step 1/3 reward" in console and "qerl progress train tiny: step 3/3" in console
    assert "step 3/3: reward" not in console and "qerl progress evaluate tiny: step 1/" in console


def test_outputs_follow_the_layout(pipeline):
    from qerl.paths import Layout

    lay = Layout(pipeline / "results")
    assert list(lay.checkpoints("tiny").glob("*/step-000002")), "checkpoints are not where qerl.paths puts them"
    assert lay.eval_records("tiny").is_dir()


def test_every_stage_output_exists(pipeline):
    res = pipeline / "results" / "tiny"
    assert (res / "quantized" / "quantize.json").is_file()
    qcfg = json.loads((res / "quantized" / "config.json").read_text())
    assert "quantization_config" in qcfg
    assert (res / "adapter" / "adapter_config.json").is_file()
    assert (res / "adapter" / "training_curves.png").stat().st_size > 0
    state = json.loads((res / "adapter" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"]] == [1, 2, 3]
    merged = json.loads((res / "merged" / "config.json").read_text())
    assert "quantization_config" not in merged
    for stage in STAGES:
        assert json.loads((res / "runs" / f"{stage}.json").read_text())["run_id"]


def test_eval_json_has_every_variant_and_mode(pipeline):
    from qerl.evaluation import load_eval_json

    doc = load_eval_json(pipeline / "results" / "tiny" / "eval.json")
    keys = set(doc["benchmarks"])
    for bench in ("demo", "gsm8k"):
        for variant in ("trained", "base", "quantized_base"):
            for mode in ("greedy", "sampled"):
                assert f"{bench}/{variant}/{mode}" in keys
    assert doc["benchmarks"]["gsm8k/trained/sampled"]["k"] == 2
    assert doc["benchmarks"]["demo/trained/greedy"]["n_problems"] == 4


def test_one_mlflow_run_per_stage_with_params_metrics_artifacts(pipeline, monkeypatch):
    import mlflow

    from qerl.tracking import find_stage_runs

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = find_stage_runs("tiny", pipeline / "results", mlflow_experiment=MLFLOW_EXPERIMENT)
    assert sorted(r["stage"] for r in runs) == sorted(STAGES)
    by_stage = {r["stage"]: r for r in runs}
    for stage, run in by_stage.items():
        assert run["status"] == "FINISHED"
        assert run["params"], stage
        assert "stage_seconds" in run["metrics"], stage
        assert mlflow.artifacts.list_artifacts(run_id=run["run_id"]), stage
    assert "reward" in by_stage["train"]["metrics"]
    assert "aqn/sigma" in by_stage["train"]["metrics"]
    train_files = {a.path for a in mlflow.artifacts.list_artifacts(run_id=by_stage["train"]["run_id"])}
    assert {"training_curves.png", "adapter"} <= train_files
    links = {r["stage"]: r for r in runs}
    upstream = json.loads((pipeline / "results" / "tiny" / "runs" / "train.json").read_text())["run_id"]
    client = mlflow.MlflowClient()
    assert client.get_run(links["merge"]["run_id"]).data.tags["qerl.upstream_run_id"] == upstream
    assert client.get_experiment_by_name("qerl") is None  # nothing went to the default experiment


def report_results(html: str) -> dict:
    """The results a Snakemake report embeds (path -> name, mime type, caption, labels, data URI)."""
    import re

    return json.loads(re.search(r"var results = (\{.*\});\n", html).group(1))


def test_the_report_opens_on_the_accuracies_and_the_training_curves(pipeline):
    import base64
    import re

    from qerl.evaluation import load_eval_json

    proc = snakemake(pipeline, "--report", "report.html")
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (pipeline / "report.html").read_text()
    landing = json.loads(re.search(r"var workflow_desc = (.*);\n", html).group(1))
    results = report_results(html)
    by_name = {r["name"]: r for r in results.values()}
    assert sorted(by_name) == ["accuracy.html", "accuracy.png", "training_curves.png"]  # one figure of the curves
    table = by_name["accuracy.html"]
    assert table["mime_type"] == "text/html" and table["labels"] == {"experiment": "tiny", "figure": "table"}
    page = base64.b64decode(table["data_uri"].split(",", 1)[1]).decode()
    for res in load_eval_json(pipeline / "results" / "tiny" / "eval.json")["benchmarks"].values():
        low, high = res["ci95"]
        for shown in (page, landing):
            assert f"<b>{100 * res['accuracy']:.1f}</b>" in shown and f"[{100 * low:.1f}, {100 * high:.1f}]" in shown
    assert by_name["accuracy.png"]["mime_type"] == "image/png"
    curves = by_name["training_curves.png"]
    assert curves["labels"] == {"experiment": "tiny", "figure": "curves"} and ";base64,iVBOR" in curves["data_uri"]
    figure = (pipeline / "results" / "tiny" / "report" / "training_curves.png").read_bytes()
    assert f"data:image/png;base64,{base64.b64encode(figure).decode()}" in landing  # the landing page shows it


def test_rerun_is_a_noop(pipeline):
    proc = snakemake(pipeline, "-n")
    assert proc.returncode == 0
    assert "Nothing to be done" in proc.stdout + proc.stderr


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c["experiments"]["tiny"]["train"].update(bogus=1), "experiments.tiny.train.bogus"),
    (lambda c: c["experiments"]["tiny"]["train"].update(num_generations="eight"),
     "experiments.tiny.train.num_generations"),
    (lambda c: c["experiments"]["tiny"].pop("model"), "experiments.tiny.model"),
])
def test_malformed_config_stops_before_any_job(tmp_path, tokenizer_dir, data_dir, mutate, key):
    cfg = tiny_config(tokenizer_dir, data_dir)
    mutate(cfg)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(tmp_path, "-n")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and key in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "results").exists()
