"""MLflow tracking against a real sqlite store in a temporary directory."""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qerl import tracking
from qerl.errors import QerlError
from qerl.io import owner_tag


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


def _note(run_id: str) -> str:
    import mlflow

    return mlflow.MlflowClient().get_run(run_id).data.tags[tracking.NOTE_TAG]


def test_every_run_is_described_with_its_headline_under_its_time(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = tmp_path / "x" / "runs"
    with tracking.stage_run(experiment="x", stage="quantize", params={}, run_file=runs / "quantize.json",
                            results_dir=tmp_path) as run:
        pass
    assert re.fullmatch(r"\*\*x/quantize\*\* finished in 0m0\ds", _note(run.run_id))  # a stage with nothing to add
    with tracking.stage_run(experiment="x", stage="evaluate", params={}, run_file=runs / "evaluate.json",
                            results_dir=tmp_path) as run:
        run.describe("| benchmark | accuracy % |\n|---|---|\n| demo | **52.7** |")
    head, body = _note(run.run_id).split("\n\n", 1)
    assert re.fullmatch(r"\*\*x/evaluate\*\* finished in 0m0\ds", head)
    assert body == "| benchmark | accuracy % |\n|---|---|\n| demo | **52.7** |"


@pytest.mark.parametrize("error, said", [
    (RuntimeError("boom\nTraceback detail"), "RuntimeError: boom"),
    (QerlError("eval file results/x/eval.json does not exist"), "eval file results/x/eval.json does not exist"),
    (KeyboardInterrupt(), "KeyboardInterrupt"),
])
def test_a_failed_run_is_described_by_its_error_line(tmp_path, monkeypatch, error, said):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(type(error)):
        with tracking.stage_run(experiment="x", stage="train", params={}, run_file=tmp_path / "r.json",
                                results_dir=tmp_path) as run:
            raise error
    assert re.fullmatch(r"\*\*x/train\*\* failed after 0m0\ds: " + re.escape(said), _note(run.run_id))


def test_a_failed_runs_description_masks_the_stores_password():
    uri = "http://bob:s3cret@mlflow.example:5000"
    assert tracking._error_line(ValueError(f"cannot reach {uri}"), uri) == \
        "ValueError: cannot reach http://bob:***@mlflow.example:5000"


def test_a_train_run_has_its_per_step_curves_a_headline_and_no_single_point_final_metrics(
        tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """What the MLflow UI shows of a train stage: each curve with every logged step, no `final/*` copy of their
    last points (a section of one-bar charts each, listed before the curves), and the headline in the description."""
    import mlflow

    from qerl.train import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = {"mode": "lora", "dtype": "float32", "max_steps": 3, "logging_steps": 1, "save_steps": 10,
           "num_generations": 2, "batch_size": 2, "micro_batch_size": 2, "max_prompt_length": 128,
           "max_completion_length": 4, "lora": {"lora_r": 4, "lora_alpha": 8},
           "data": {"source": str(data_dir / "gsm8k" / "train.jsonl"), "limit": 8}}
    main(["--experiment", "t", "--model", str(tiny_model_dir), "--out", str(tmp_path / "adapter"),
          "--config-json", json.dumps(cfg), "--results-dir", str(tmp_path)])
    (run,) = tracking.find_stage_runs("t", tmp_path)
    assert not [k for k in run["metrics"] if k.startswith("final/")]
    client = mlflow.MlflowClient()
    for key in ("reward", "entropy", "aqn/sigma"):
        assert [m.step for m in client.get_metric_history(run["run_id"], key)] == [1, 2, 3], key
    head, headline = _note(run["run_id"]).split("\n\n", 1)
    assert head.startswith("**t/train** finished in ")
    assert headline.startswith("3 steps (to step 3); start and end: means over the first and last 1 step")
    assert re.search(r"^\| reward \| [-\d.e]+ \| [-\d.e]+ \|$", headline, re.MULTILINE), headline
    assert headline.endswith(f"adapter: `{tmp_path / 'adapter'}`")


def test_unreachable_server_fails_fast(monkeypatch):
    import time

    t0 = time.time()
    with pytest.raises(QerlError, match="unreachable"):
        tracking.check_tracking_server("http://127.0.0.1:9", timeout=2)
    assert time.time() - t0 < 15  # a refused port answers at once; mlflow's own retries would take minutes


def test_env_uri_overrides_default(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example:5000")
    assert tracking.tracking_uri(tmp_path) == "http://example:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking.tracking_uri(tmp_path).startswith("sqlite:///")


def test_the_configured_store_is_used_and_the_env_var_wins(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri(tmp_path, "http://configured:5000") == "http://configured:5000"
    assert tracking.tracking_uri(tmp_path, None) == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert tracking.tracking_uri(tmp_path, "http://configured:5000") == "http://env:5000"


def test_stage_runs_go_to_the_configured_store_and_experiment(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    other = f"sqlite:///{tmp_path / 'elsewhere' / 'store.db'}"
    run_file = tmp_path / "res" / "x" / "runs" / "quantize.json"
    with tracking.stage_run(experiment="x", stage="quantize", params={}, run_file=run_file,
                            results_dir=tmp_path / "res", mlflow_experiment="my-exp", uri=other):
        pass
    assert not (tmp_path / "res" / "mlflow.db").exists()
    assert json.loads(run_file.read_text())["tracking_uri"] == other
    runs = tracking.find_stage_runs("x", tmp_path / "res", mlflow_experiment="my-exp", uri=other)
    assert [r["stage"] for r in runs] == ["quantize"]
    assert mlflow.MlflowClient(tracking_uri=other).get_experiment_by_name("qerl") is None
    assert (tmp_path / "elsewhere" / "mlartifacts").is_dir()  # beside that store, not under results/


def test_init_prints_a_link_that_opens_the_runs_and_tags_the_kind(tmp_path, monkeypatch):
    """MLflow 3.17's UI opens an experiment in its GenAI view unless the link says workflowType=machine_learning
    (the mlflow.experimentKind tag, still set for clients that read it, no longer decides): init prints that link
    with the store's own experiment id."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    proc = subprocess.run([sys.executable, "-m", "qerl.tracking", "init", "--results-dir", str(tmp_path),
                           "--mlflow-experiment", "kinds"], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri(tmp_path))
    exp = client.get_experiment_by_name("kinds")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    link = f"mlflow ui --backend-store-uri {tracking.tracking_uri(tmp_path)}, then http://127.0.0.1:5000/" \
           f"#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
    assert link in proc.stdout, proc.stdout
    old = client.create_experiment("untagged")  # a store made before the tag gets it on the next run
    client.create_experiment("chosen", tags={"mlflow.experimentKind": "finetuning"})
    for name in ("untagged", "chosen"):
        tracking.ensure_store(tmp_path, name)
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment_by_name("chosen").tags["mlflow.experimentKind"] == "finetuning"


def test_a_server_link_is_its_own_page_without_the_password():
    link = tracking.experiment_link("https://bob:s3cret@mlflow.example:5000/", "7")
    assert link == "https://bob:***@mlflow.example:5000/#/experiments/7/runs?workflowType=machine_learning"


def test_the_installed_mlflow_ui_still_reads_the_workflow_type_from_the_link():
    """The printed link relies on the UI's `workflowType` URL parameter: fail here, not in a user's browser, when an
    MLflow upgrade renames it (then see whether the UI reads mlflow.experimentKind again)."""
    import mlflow

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    if not bundle.is_dir():
        pytest.skip("this MLflow has no UI bundle (mlflow-skinny)")
    text = "".join(p.read_text(errors="ignore") for p in bundle.glob("main.*.js"))
    assert 'get("workflowType")' in text and '"machine_learning"' in text


def test_default_store_does_not_leak_into_the_environment(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with tracking.stage_run(experiment="x", stage="quantize", params={}, run_file=tmp_path / "a" / "r.json",
                            results_dir=tmp_path / "a"):
        pass
    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert tracking.find_stage_runs("x", tmp_path / "b") == []
    assert len(tracking.find_stage_runs("x", tmp_path / "a")) == 1


# --- a sqlite store shared by parallel stages -------------------------------------------------------------------

_barrier = None


def _init_worker(barrier) -> None:
    global _barrier
    _barrier = barrier
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    import mlflow  # noqa: F401  (imported before the barrier, so the processes really meet at the store)


def _start_stage_run(args: tuple[str, int]) -> str:
    results, i = args
    _barrier.wait(timeout=120)
    try:
        with tracking.stage_run(experiment=f"e{i}", stage="quantize", params={"i": i},
                                run_file=f"{results}/e{i}/runs/quantize.json", results_dir=results):
            pass
        return "ok"
    except Exception as err:  # reported to the parent, which shows it
        return f"{type(err).__name__}: {err}"[:300]


def test_parallel_stages_on_an_empty_results_dir_share_one_store(tmp_path, monkeypatch):
    """Snakemake --cores N starting N stages at once: each creates the sqlite store if it is missing."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    n, repeats = 3, 5
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(n, initializer=_init_worker, initargs=(ctx.Barrier(n),)) as pool:
        for rep in range(repeats):
            results = tmp_path / f"r{rep}"
            outcomes = pool.map(_start_stage_run, [(str(results), i) for i in range(n)], chunksize=1)
            assert outcomes == ["ok"] * n, f"repeat {rep}: {outcomes}"
            for i in range(n):
                assert [r["status"] for r in tracking.find_stage_runs(f"e{i}", results)] == ["FINISHED"]


def test_a_store_interrupted_while_migrating_leaves_no_broken_db(tmp_path, monkeypatch):
    import mlflow.store.db.utils as db_utils

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def interrupted(engine):  # Ctrl-C after the first tables, before the migrations
        db_utils.InitialBase.metadata.create_all(engine)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(db_utils, "_initialize_tables", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tracking.ensure_store(tmp_path)
    assert not (tmp_path / "mlflow.db").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    with tracking.stage_run(experiment="x", stage="quantize", params={}, run_file=tmp_path / "r.json",
                            results_dir=tmp_path):
        pass
    assert tracking.find_stage_runs("x", tmp_path)[0]["status"] == "FINISHED"


def test_init_cli_creates_the_store_and_names_a_broken_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.run([sys.executable, "-m", "qerl.tracking", "init", "--results-dir", str(tmp_path / "ok")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'ok' / 'mlflow.db'}")
    assert client.get_experiment_by_name(tracking.EXPERIMENT_NAME) is not None

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "mlflow.db").write_bytes(b"not a database" * 100)
    with pytest.raises(SystemExit) as exit_:
        tracking.main(["init", "--results-dir", str(bad)])
    assert exit_.value.code == 2


def test_a_broken_store_is_one_line_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "mlflow.db").write_bytes(b"not a database" * 100)
    with pytest.raises(QerlError, match="mlflow.db: not a usable MLflow store") as err:
        tracking.ensure_store(tmp_path)
    assert "\n" not in str(err.value)


# --- runs of killed stages ------------------------------------------------------------------------------------

KILLED_STAGE = """
import os, signal, sys
from qerl.tracking import stage_run
with stage_run(experiment="k", stage="train", params={}, run_file=sys.argv[1] + "/r.json", results_dir=sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _fake_running_run(client, exp_id: str, stage: str, **owner: str) -> str:
    tags = {"qerl.experiment": "k", "qerl.stage": stage, **{f"qerl.{k}": v for k, v in owner.items()}}
    return client.create_run(exp_id, tags=tags).info.run_id


def test_a_new_stage_run_marks_dead_runs_of_the_same_stage_killed(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.run([sys.executable, "-c", KILLED_STAGE, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (killed,) = tracking.find_stage_runs("k", tmp_path)
    assert killed["status"] == "RUNNING"

    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri(tmp_path))
    exp_id = client.get_experiment_by_name(tracking.EXPERIMENT_NAME).experiment_id
    host, pid, start = owner_tag().rsplit(".", 2)
    live = _fake_running_run(client, exp_id, "train", host=host, pid=pid, pid_start=start)  # by hand, alive
    reused = _fake_running_run(client, exp_id, "train", host=host, pid=pid, pid_start=str(int(start) + 1))
    elsewhere = _fake_running_run(client, exp_id, "train", host="another-node", pid="12")
    other_stage = _fake_running_run(client, exp_id, "merge", host="another-node", pid="12")

    with tracking.stage_run(experiment="k", stage="train", params={}, run_file=tmp_path / "r.json",
                            results_dir=tmp_path) as run:
        pass
    status = {r["run_id"]: r["status"] for r in tracking.find_stage_runs("k", tmp_path)}
    assert status[killed["run_id"]] == "KILLED" and status[reused] == "KILLED" and status[elsewhere] == "KILLED"
    assert status[live] == "RUNNING" and status[other_stage] == "RUNNING" and status[run.run_id] == "FINISHED"
    tags = client.get_run(run.run_id).data.tags
    assert tags["qerl.host"] == host and tags["qerl.pid"] == pid and tags["qerl.pid_start"] == start
    assert client.get_run(killed["run_id"]).data.tags["qerl.killed_by_run"] == run.run_id
    assert client.get_run(killed["run_id"]).info.end_time is not None


def test_a_live_run_marked_killed_from_another_host_ends_with_its_true_status(tmp_path, monkeypatch):
    """The one unverifiable guess (another host's run is dead) corrects itself when that run ends."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking.ensure_store(tmp_path)
    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri(tmp_path))
    exp_id = client.get_experiment_by_name(tracking.EXPERIMENT_NAME).experiment_id
    first = _fake_running_run(client, exp_id, "train", host="another-node", pid=str(os.getpid()))
    with tracking.stage_run(experiment="k", stage="train", params={}, run_file=tmp_path / "b.json",
                            results_dir=tmp_path):
        pass
    assert client.get_run(first).info.status == "KILLED"
    client.log_metric(first, "reward", 1.0, step=1)  # it was alive after all: it goes on logging ...
    client.set_terminated(first, status="FINISHED")  # ... and ends as mlflow.end_run ends every run
    got = client.get_run(first)
    assert got.info.status == "FINISHED" and got.data.metrics["reward"] == 1.0
