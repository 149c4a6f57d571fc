"""MLflow tracking against a real sqlite store in a temporary directory."""
from __future__ import annotations

import json

import pytest

from qerl import tracking
from qerl.errors import QerlError


def test_stage_run_logs_params_metrics_artifacts_and_links(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    res = tmp_path / "results"
    up_file, run_file = res / "x" / "runs" / "quantize.json", res / "x" / "runs" / "train.json"
    with tracking.stage_run(experiment="x", stage="quantize", params={"a": {"b": 1}}, run_file=up_file,
                            results_dir=res):
        pass
    art = tmp_path / "note.txt"
    art.write_text("hi")
    with tracking.stage_run(experiment="x", stage="train", params={"lr": 0.1, "mods": ["q", "k"]},
                            run_file=run_file, results_dir=res, upstream_run_file=up_file) as run:
        run.log_metrics({"reward": 0.5, "pass@1": 0.25}, step=1)
        run.log_artifact(art)
    assert (res / "mlflow.db").is_file()
    runs = {r["stage"]: r for r in tracking.find_stage_runs("x", res)}
    assert set(runs) == {"quantize", "train"}
    train = runs["train"]
    assert train["params"]["lr"] == "0.1" and json.loads(train["params"]["mods"]) == ["q", "k"]
    assert runs["quantize"]["params"]["a.b"] == "1"
    assert train["metrics"]["reward"] == 0.5 and train["metrics"]["pass_at_1"] == 0.25
    tags = mlflow.MlflowClient().get_run(train["run_id"]).data.tags
    assert tags["qerl.upstream_run_id"] == json.loads(up_file.read_text())["run_id"]
    assert tags["qerl.stage"] == "train" and tags["qerl.experiment"] == "x"
    names = {a.path for a in mlflow.artifacts.list_artifacts(run_id=train["run_id"])}
    assert {"note.txt", "train_config.json"} <= names


def test_failed_stage_writes_no_run_file(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_file = tmp_path / "r.json"
    with pytest.raises(RuntimeError):
        with tracking.stage_run(experiment="x", stage="train", params={}, run_file=run_file,
                                results_dir=tmp_path):
            raise RuntimeError("boom")
    assert not run_file.exists()
    assert tracking.find_stage_runs("x", tmp_path)[0]["status"] == "FAILED"


def test_unreachable_server_fails_fast(monkeypatch):
    import time

    t0 = time.time()
    with pytest.raises(QerlError, match="unreachable"):
        tracking.check_tracking_server("http://127.0.0.1:9", timeout=2)
    assert time.time() - t0 < 5


def test_env_uri_overrides_default(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example:5000")
    assert tracking.tracking_uri(tmp_path) == "http://example:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking.tracking_uri(tmp_path).startswith("sqlite:///")


def test_default_store_does_not_leak_into_the_environment(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with tracking.stage_run(experiment="x", stage="quantize", params={}, run_file=tmp_path / "a" / "r.json",
                            results_dir=tmp_path / "a"):
        pass
    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert tracking.find_stage_runs("x", tmp_path / "b") == []
    assert len(tracking.find_stage_runs("x", tmp_path / "a")) == 1
