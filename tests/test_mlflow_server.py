"""Stages logging to one shared `mlflow server` (the multi-node setup of docs/cluster.md) via MLFLOW_TRACKING_URI.

A real server on a free 127.0.0.1 port with a SQLite backend and a proxied artifact destination, as a cluster
would run it; a stage in this process and one in a child process (as a SLURM job would be) log to it.
"""
from __future__ import annotations

import base64
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest

from qerl.errors import QerlError
from qerl.tracking import check_tracking_server, find_stage_runs, redact_uri, stage_run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 150.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"mlflow server not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


def stop_group(proc: subprocess.Popen) -> None:
    """The server forks uvicorn workers: stop the whole process group this test started."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=root, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        wait_healthy(url, proc, log)
        yield {"url": url, "root": root}
    finally:
        stop_group(proc)


def test_stage_runs_land_on_the_server(server, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server["url"])
    results = tmp_path / "results"
    note = tmp_path / "note.txt"
    note.write_text("hello from a stage\n")
    with stage_run(experiment="cluster", stage="quantize", params={"scheme": "nvfp4", "lora": {"r": 4}},
                   run_file=results / "cluster" / "runs" / "quantize.json", results_dir=results) as run:
        run.log_metrics({"loss": 0.25}, step=1)
        run.log_artifact(note)

    link = json.loads((results / "cluster" / "runs" / "quantize.json").read_text())
    assert link["tracking_uri"] == server["url"]
    client = mlflow.MlflowClient(tracking_uri=server["url"])
    got = client.get_run(link["run_id"])
    assert got.info.status == "FINISHED"
    assert got.data.params["scheme"] == "nvfp4" and got.data.params["lora.r"] == "4"
    assert got.data.metrics["loss"] == 0.25 and "stage_seconds" in got.data.metrics
    assert got.data.tags["qerl.stage"] == "quantize"
    assert "note.txt" in {a.path for a in client.list_artifacts(link["run_id"])}
    # Artifacts went through the server to its destination, not into the job's results directory.
    stored = list((server["root"] / "artifacts").rglob("note.txt"))
    assert len(stored) == 1 and stored[0].read_text() == "hello from a stage\n"
    assert not (results / "mlflow.db").exists() and not (results / "mlartifacts").exists()


CHILD_STAGE = """
import sys
from qerl.tracking import stage_run
results, upstream = sys.argv[1], sys.argv[2]
with stage_run(experiment="cluster2", stage="train", params={"step": 1}, run_file=results + "/train.json",
               results_dir=results, upstream_run_file=upstream) as run:
    run.log_metrics({"reward": 0.5}, step=1)
"""


def test_a_job_process_logs_through_the_environment_and_links_upstream(server, tmp_path, monkeypatch):
    """Like a SLURM job: a separate process that only inherits MLFLOW_TRACKING_URI from its environment."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server["url"])
    results = tmp_path / "results"
    with stage_run(experiment="cluster2", stage="quantize", params={"a": 1},
                   run_file=results / "quantize.json", results_dir=results):
        pass
    proc = subprocess.run([sys.executable, "-c", CHILD_STAGE, str(results), str(results / "quantize.json")],
                          capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]

    runs = {r["stage"]: r for r in find_stage_runs("cluster2", results)}
    assert set(runs) == {"quantize", "train"}
    assert runs["train"]["metrics"]["reward"] == 0.5
    import mlflow

    tags = mlflow.MlflowClient(tracking_uri=server["url"]).get_run(runs["train"]["run_id"]).data.tags
    assert tags["qerl.upstream_run_id"] == runs["quantize"]["run_id"]


def test_unreachable_server_fails_in_seconds_before_the_stage_body(tmp_path, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    entered = []
    t0 = time.time()
    with pytest.raises(QerlError) as err:
        with stage_run(experiment="x", stage="train", params={}, run_file=tmp_path / "run.json",
                       results_dir=tmp_path / "results"):
            entered.append(True)
    assert time.time() - t0 < 10
    assert dead in str(err.value) and "\n" not in str(err.value)
    assert not entered and not (tmp_path / "run.json").exists()


# --- credentials in MLFLOW_TRACKING_URI -----------------------------------------------------------------------

USER, PASSWORD = "qerl", "p@ss:w/rd s3cret"  # characters that must be percent-encoded in a URI
USERINFO = f"{USER}:{quote(PASSWORD, safe='')}"


class BasicAuthHealth(http.server.BaseHTTPRequestHandler):
    """A reverse proxy's basic auth in front of /health; any other path drops the connection, as a broken
    server would (MLflow's error then quotes the full request URL)."""

    def do_GET(self):
        expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
            self.end_headers()
        elif self.path == "/health":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")
        else:
            self.close_connection = True

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def auth_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BasicAuthHealth)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def no_mlflow_creds(monkeypatch, tmp_path):
    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.mlflow/credentials


def test_health_check_authenticates_with_the_uris_userinfo(auth_server, no_mlflow_creds):
    check_tracking_server(f"http://{USERINFO}@{auth_server}")


def test_health_check_authenticates_with_mlflows_environment_credentials(auth_server, no_mlflow_creds, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    check_tracking_server(f"http://{auth_server}/")


@pytest.mark.parametrize("userinfo", ["qerl:wrong-s3cret", None])
def test_refused_credentials_are_one_redacted_line(auth_server, no_mlflow_creds, userinfo):
    uri = f"http://{userinfo}@{auth_server}" if userinfo else f"http://{auth_server}"
    with pytest.raises(QerlError, match="refused the credentials") as err:
        check_tracking_server(uri)
    assert "s3cret" not in str(err.value) and "\n" not in str(err.value)
    assert redact_uri(uri) in str(err.value)


def test_an_unreachable_server_is_named_without_its_password(no_mlflow_creds):
    uri = f"http://{USERINFO}@127.0.0.1:{free_port()}"
    with pytest.raises(QerlError, match="unreachable") as err:
        check_tracking_server(uri, timeout=2)
    assert "s3cret" not in str(err.value) and f"http://{USER}:***@127.0.0.1:" in str(err.value)


def test_mlflows_own_errors_lose_the_password(auth_server, no_mlflow_creds, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://{USERINFO}@{auth_server}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(QerlError) as err:
        with stage_run(experiment="x", stage="train", params={}, run_file=tmp_path / "run.json",
                       results_dir=tmp_path / "results"):
            pass
    assert f"http://{USER}:***@{auth_server}" in str(err.value) and "\n" not in str(err.value)
    out, errs = capfd.readouterr()
    for text in (str(err.value), out, errs):
        assert "s3cret" not in text and quote(PASSWORD, safe="") not in text


def test_the_run_file_records_the_server_without_the_password(server, tmp_path, monkeypatch):
    """The real server ignores the credentials; the run still lands there, and the link file hides them."""
    host = server["url"].removeprefix("http://")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://{USERINFO}@{host}")
    run_file = tmp_path / "runs" / "quantize.json"
    with stage_run(experiment="creds", stage="quantize", params={}, run_file=run_file,
                   results_dir=tmp_path / "results"):
        pass
    link = json.loads(run_file.read_text())
    assert link["tracking_uri"] == f"http://{USER}:***@{host}" and "s3cret" not in run_file.read_text()
    assert find_stage_runs("creds", tmp_path / "results")[0]["status"] == "FINISHED"


@pytest.mark.parametrize("uri, shown", [
    ("http://u:pw@host:5000/path", "http://u:***@host:5000/path"),
    ("postgresql://mlflow:pw@db.internal/mlflow", "postgresql://mlflow:***@db.internal/mlflow"),
    ("postgresql://db/mlflow?user=u&password=pw", "postgresql://db/mlflow?user=u&password=***"),
    ("https://host?token=abc&x=1", "https://host?token=***&x=1"),
    ("http://host:5000", "http://host:5000"),
    ("sqlite:////abs/results/mlflow.db", "sqlite:////abs/results/mlflow.db"),
])
def test_redact_uri(uri, shown):
    assert redact_uri(uri) == shown
