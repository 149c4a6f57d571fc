"""MLflow tracking: the only module that imports mlflow.

One MLflow run per stage and experiment, named "<experiment>/<stage>", tagged qerl.experiment, qerl.stage,
qerl.git_commit, qerl.upstream_run_id (the run of the stage that produced this stage's input) and qerl.host,
qerl.pid, qerl.pid_start (the process, so a later run can tell a dead run from a live one), all in one
MLflow experiment so `mlflow.search_runs(filter_string="tags.`qerl.experiment` = 'demo'")` lists a pipeline.
Default store: sqlite:///<results>/mlflow.db with artifacts under <results>/mlartifacts; the config's
mlflow.tracking_uri (each stage's --tracking-uri) replaces it, and MLFLOW_TRACKING_URI (e.g. a shared
`mlflow server`) overrides both. The MLflow experiment is the config's mlflow.experiment_name (--mlflow-experiment),
tagged as a model-training experiment; `init` prints the link to its runs (`experiment_link`: the UI's view).
Each run's description (tag mlflow.note.content): its time and `StageRun.describe`'s headline, or its error line.
Each stage writes `<results>/<experiment>/runs/<stage>.json` ({run_id, tracking_uri, experiment_id}) next to
its output; the next stage reads it to link the runs.

A sqlite store is created and migrated by one process at a time (an flock on `.<db>.lock` beside it), in a
temporary file renamed into place, so parallel stages or a Ctrl-C never leave a half-migrated store; the
Snakefile creates it before any job with `python -m qerl.tracking init --results-dir results`.
When a stage run starts, earlier runs of the same experiment and stage still RUNNING are marked KILLED if their
process is dead: a dead pid of this host, or any process of another host (Snakemake runs one job per output, so
a second run of the same stage elsewhere is a dead one; if it was alive after all, its end sets its true status).
Credentials in the tracking URI never reach a message or a run file (`http://user:***@host`).
"""
from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urlsplit, urlunsplit

from qerl.errors import QerlError
from qerl.io import atomic_file, atomic_write_text, owner_tag, process_alive
from qerl.paths import Layout
from qerl.progress import duration

EXPERIMENT_NAME = "qerl"
# The experiment's kind for MLflow clients and UIs that read it; 3.17's UI reads the URL's workflowType instead.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` listens by default
NOTE_TAG = "mlflow.note.content"  # the run's Description in the MLflow UI (markdown)


def default_uri(results_dir: str | Path = "results") -> str:
    return f"sqlite:///{Layout(results_dir).mlflow_db().resolve()}"


def tracking_uri(results_dir: str | Path = "results", configured: str | None = None) -> str:
    """MLFLOW_TRACKING_URI, else the config's mlflow.tracking_uri, else the sqlite store under results_dir."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or default_uri(results_dir)


def _use_uri(mlflow, uri: str) -> None:
    """mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI (for subprocesses); that would turn our default
    store into a user override for every later stage_run/find_stage_runs and child process, so keep the
    environment as the user set it."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def redact_uri(uri: str) -> str:
    """The URI with its password (and password/token query values) replaced by ***; the rest as written."""
    parts = urlsplit(uri)
    if parts.password is not None:
        uri = uri.replace(parts.netloc, f"{parts.username}:***@{parts.netloc.rsplit('@', 1)[1]}", 1)
    head, sep, query = uri.partition("?")
    return head + sep + re.sub(r"(?i)\b((?:password|passwd|token|secret)=)[^&]*", r"\1***", query)


def redact(text: str, uri: str) -> str:
    """`text` with every form of the URI's secrets (raw and percent-decoded) masked."""
    password = urlsplit(uri).password
    text = text.replace(uri, redact_uri(uri))
    for secret in {password, unquote(password or "")} - {None, ""}:
        text = text.replace(secret, "***")
    return text


@contextmanager
def _secrets_masked(uri: str) -> Iterator[None]:
    """MLflow's own errors quote the tracking URI: re-raise one whose text holds a secret as one redacted line."""
    try:
        yield
    except QerlError:
        raise
    except Exception as err:
        text = f"{type(err).__name__}: {err}"
        if redact(text, uri) == text:
            raise
        line = " ".join(redact(text, uri).split())[:500]
        raise QerlError(f"MLflow at {redact_uri(uri)} failed: {line}") from None


def _health_request(uri: str) -> urllib.request.Request:
    """GET <uri>/health with the credentials MLflow itself would send: the URI's user:password, else
    MLFLOW_TRACKING_USERNAME/PASSWORD (or ~/.mlflow/credentials), else MLFLOW_TRACKING_TOKEN."""
    parts = urlsplit(uri)
    url = urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path.rstrip("/") + "/health", "", ""))
    req = urllib.request.Request(url)
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    if not (user and password):
        from mlflow.utils.credentials import read_mlflow_creds

        creds = read_mlflow_creds()
        user, password = creds.username or "", creds.password or ""
    if user and password:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
        req.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    return req


def _tls_context() -> ssl.SSLContext | None:
    """MLflow's own TLS settings, so the check accepts what the stage's MLflow client will accept."""
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("true", "1"):
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        return ctx
    cafile = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
    return ssl.create_default_context(cafile=cafile) if cafile else None


def check_tracking_server(uri: str, timeout: float = 5.0) -> None:
    """Fail in seconds, before expensive work, when an http(s) tracking server does not answer or refuses us."""
    if not uri.startswith(("http://", "https://")):
        return
    shown = redact_uri(uri)
    try:
        with urllib.request.urlopen(_health_request(uri), timeout=timeout, context=_tls_context()) as resp:
            if resp.status != 200:
                raise QerlError(f"MLflow server {shown} answered /health with HTTP {resp.status}")
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise QerlError(f"MLflow server {shown} refused the credentials (HTTP {err.code} on /health); check "
                            "the user:password in MLFLOW_TRACKING_URI or MLFLOW_TRACKING_USERNAME/PASSWORD") from None
        raise QerlError(f"MLflow server {shown} answered /health with HTTP {err.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = redact(str(getattr(err, "reason", err)), uri)
        raise QerlError(f"MLflow tracking server {shown} is unreachable ({reason}); start it or unset "
                        "MLFLOW_TRACKING_URI") from None


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return flat


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:/// URI (None for any other store, or an in-memory one)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///"):].split("?", 1)[0])
    return Path(path) if path and path != ":memory:" else None


@contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive flock beside a sqlite store (released by the kernel even if this process dies);
    servers and database servers serialise their own clients, so other URIs take no lock."""
    db = _sqlite_path(uri)
    if db is None:
        yield
        return
    lock = db.parent / f".{db.name}.lock"
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock, "a")
    except OSError as err:
        if db.is_file() and db.stat().st_size:  # a read-only copy of a finished store: nothing to create
            yield
            return
        raise QerlError(f"{lock}: cannot create the MLflow store's lock ({err.strerror})") from None
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _create_sqlite_store(db: Path, artifact_root: str) -> None:
    """Create and migrate a fresh store in a temporary file, then rename it into place: a store killed while
    migrating (which takes seconds) is a stale temporary, never a half-migrated mlflow.db."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    with atomic_file(db) as tmp:
        tmp_uri = f"sqlite:///{tmp}"
        store = SqlAlchemyStore(tmp_uri, artifact_root)
        store.engine.dispose()
        getattr(SqlAlchemyStore, "_engine_map", {}).pop(tmp_uri, None)  # the engine cache would keep it open


def _artifact_root(results_dir: Path, uri: str) -> str | None:
    """mlartifacts beside a sqlite store (results/mlartifacts for the default one; without it MLflow would use
    ./mlruns of whatever directory the job ran in); a server, another database or MLFLOW_ARTIFACT_ROOT decides."""
    db = _sqlite_path(uri)
    if db is None or os.environ.get("MLFLOW_ARTIFACT_ROOT"):
        return None
    if uri == default_uri(results_dir):
        return Layout(results_dir).mlartifacts().resolve().as_uri()
    return (db.parent.resolve() / "mlartifacts").as_uri()


def _open_store(mlflow, uri: str, results_dir: Path) -> None:
    """Point mlflow at the store, creating a missing (or empty) sqlite file first; call under _store_lock."""
    db = _sqlite_path(uri)
    if db is not None and (not db.exists() or db.stat().st_size == 0):
        _create_sqlite_store(db, _artifact_root(results_dir, uri) or (db.parent.resolve() / "mlartifacts").as_uri())
    _use_uri(mlflow, uri)
    if db is None:
        return
    try:  # the first contact: builds the engine and checks (or, on an empty file, migrates) the schema
        mlflow.MlflowClient().search_experiments(max_results=1)
    except Exception as err:
        raise QerlError(f"{db}: not a usable MLflow store ({' '.join(str(err).split())[:300]}); repair it or "
                        "move it away to start a new one") from None


def _experiment_id(mlflow, results_dir: Path, uri: str, name: str) -> str:
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        for key, value in EXPERIMENT_KIND.items():  # a store made before the tag; a kind the user chose stays
            if key not in exp.tags:
                mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id
    try:
        return mlflow.create_experiment(name, artifact_location=_artifact_root(results_dir, uri),
                                        tags=EXPERIMENT_KIND)
    except Exception:  # another client of a shared server created it concurrently
        return mlflow.get_experiment_by_name(name).experiment_id


def ensure_store(results_dir: str | Path = "results", mlflow_experiment: str = EXPERIMENT_NAME,
                 uri: str | None = None) -> tuple[str, str]:
    """Create (and migrate) the tracking store and its MLflow experiment once; return the redacted URI and the
    experiment's id. uri: the config's mlflow.tracking_uri (MLFLOW_TRACKING_URI still wins)."""
    import mlflow

    results_dir = Path(results_dir)
    uri = tracking_uri(results_dir, uri)
    check_tracking_server(uri)
    with _secrets_masked(uri), _store_lock(uri):
        _open_store(mlflow, uri, results_dir)
        exp_id = _experiment_id(mlflow, results_dir, uri, mlflow_experiment)
    return redact_uri(uri), exp_id


def experiment_link(uri: str, experiment_id: str) -> str:
    """How to browse the experiment's runs: the server's page for an http(s) store, else `mlflow ui` on the store
    and its default address. The link names the view: MLflow 3.17's UI ignores the experiment's kind and opens the
    view the browser last picked, GenAI at first (where training runs show "No data")."""
    page = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if uri.startswith(("http://", "https://")):
        return f"{redact_uri(uri).rstrip('/')}/{page}"
    return f"mlflow ui --backend-store-uri {redact_uri(uri)}, then {UI_ADDRESS}/{page}"


def _owner_tags() -> dict[str, str]:
    host, pid, start = owner_tag().rsplit(".", 2)
    return {"qerl.host": host, "qerl.pid": pid, "qerl.pid_start": start}


def _run_is_dead(tags: dict[str, str]) -> bool:
    """A run of this host is dead when its process is; one of another host (or untagged, from before these
    tags) cannot be checked from here and counts as dead: Snakemake's lock allows one job per output."""
    if tags.get("qerl.host") != socket.gethostname() or not tags.get("qerl.pid", "").isdigit():
        return True
    start = tags.get("qerl.pid_start")
    return not process_alive(int(tags["qerl.pid"]), None if start in (None, "0") else start)


def end_dead_runs(mlflow, exp_id: str, experiment: str, stage: str, current_run_id: str) -> list[str]:
    """Mark KILLED the earlier RUNNING runs of (experiment, stage) whose process is dead; return their ids."""
    client = mlflow.MlflowClient()
    running = client.search_runs(
        [exp_id], filter_string=f"tags.`qerl.experiment` = '{experiment}' and tags.`qerl.stage` = '{stage}' "
                                "and attributes.status = 'RUNNING'")
    ended = []
    for run in running:
        if run.info.run_id != current_run_id and _run_is_dead(run.data.tags):
            client.set_tag(run.info.run_id, "qerl.killed_by_run", current_run_id)
            client.set_terminated(run.info.run_id, status="KILLED")
            ended.append(run.info.run_id)
    return ended


class StageRun:
    """Handle given to a stage: log metrics/artifacts without touching mlflow directly."""

    def __init__(self, mlflow, run_id: str):
        self._mlflow, self.run_id, self.headline = mlflow, run_id, ""

    def describe(self, headline: str) -> None:
        """The stage's result, a line or a small markdown table: the run's description, under its time."""
        self.headline = headline

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {k.replace("@", "_at_"): float(v) for k, v in metrics.items() if v is not None}
        self._mlflow.log_metrics(clean, step=step)

    def log_report(self, report: dict[str, Any], prefix: str = "") -> None:
        """The numeric top-level fields of a stage report (quantize.json, merge.json, ...) as metrics."""
        self.log_metrics({f"{prefix}{k}": v for k, v in report.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def log_params(self, params: dict[str, Any]) -> None:
        flat = _flatten(params)
        for i in range(0, len(flat), 90):  # MLflow accepts at most 100 params per batch
            self._mlflow.log_params(dict(list(flat.items())[i:i + 90]))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._mlflow.log_artifacts(str(path), artifact_path=artifact_path or path.name)
        else:
            self._mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def log_dict(self, data: dict[str, Any], name: str) -> None:
        self._mlflow.log_dict(data, name)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._mlflow.set_tags(tags)


def _error_line(err: BaseException, uri: str) -> str:  # for a failed run's description: secrets masked
    line = (str(err).strip().splitlines() or [""])[0]
    return redact(line if isinstance(err, QerlError) else f"{type(err).__name__}: {line}".rstrip(": "), uri)[:300]


def read_run_file(path: str | Path | None) -> str | None:
    if path is None or not Path(path).is_file():
        return None
    return json.loads(Path(path).read_text()).get("run_id")


@contextmanager
def stage_run(*, experiment: str, stage: str, params: dict[str, Any], run_file: str | Path,
              results_dir: str | Path = "results", upstream_run_file: str | Path | None = None,
              mlflow_experiment: str = EXPERIMENT_NAME, uri: str | None = None) -> Iterator[StageRun]:
    """Open the MLflow run of one stage; on success write run_file (the link the next stage reads).
    uri: the config's mlflow.tracking_uri (MLFLOW_TRACKING_URI still wins)."""
    import mlflow

    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri(results_dir, uri)
    check_tracking_server(uri)
    with _secrets_masked(uri):
        with _store_lock(uri):
            _open_store(mlflow, uri, results_dir)
            exp_id = _experiment_id(mlflow, results_dir, uri, mlflow_experiment)
        tags = {"qerl.experiment": experiment, "qerl.stage": stage, "qerl.git_commit": git_commit(),
                **_owner_tags()}
        if upstream := read_run_file(upstream_run_file):
            tags["qerl.upstream_run_id"] = upstream
        t0 = time.time()
        with mlflow.start_run(experiment_id=exp_id, run_name=f"{experiment}/{stage}", tags=tags) as run:
            end_dead_runs(mlflow, exp_id, experiment, stage, run.info.run_id)
            handle = StageRun(mlflow, run.info.run_id)
            handle.log_params(params)
            handle.log_dict(params, f"{stage}_config.json")
            try:
                yield handle
            except BaseException as err:
                failed = f"**{experiment}/{stage}** failed after {duration(time.time() - t0)}: {_error_line(err, uri)}"
                with suppress(Exception):  # a store that cannot take the tag must not hide the error itself
                    mlflow.set_tag(NOTE_TAG, failed)
                raise
            seconds = time.time() - t0
            handle.log_metrics({"stage_seconds": seconds})
            done = f"**{experiment}/{stage}** finished in {duration(seconds)}"
            mlflow.set_tag(NOTE_TAG, f"{done}\n\n{handle.headline}" if handle.headline else done)
    atomic_write_text(run_file, json.dumps({"run_id": run.info.run_id, "tracking_uri": redact_uri(uri),
                                            "experiment_id": exp_id, "stage": stage}, indent=2))


def find_stage_runs(experiment: str, results_dir: str | Path = "results",
                    mlflow_experiment: str = EXPERIMENT_NAME, uri: str | None = None) -> list[dict[str, Any]]:
    """Runs of one qerl experiment, as dicts (used by tests and tables); a missing sqlite store has none."""
    import mlflow

    uri = tracking_uri(results_dir, uri)
    db = _sqlite_path(uri)
    if db is not None and not db.exists():
        return []
    with _secrets_masked(uri):
        with _store_lock(uri):
            _open_store(mlflow, uri, Path(results_dir))
            exp = mlflow.get_experiment_by_name(mlflow_experiment)
        if exp is None:
            return []
        runs = mlflow.search_runs([exp.experiment_id], filter_string=f"tags.`qerl.experiment` = '{experiment}'",
                                  output_format="list")
    return [{"run_id": r.info.run_id, "stage": r.data.tags.get("qerl.stage"), "status": r.info.status,
             "params": r.data.params, "metrics": r.data.metrics, "artifact_uri": r.info.artifact_uri}
            for r in runs]


def add_mlflow_args(p: argparse.ArgumentParser) -> None:
    """The tracking options every stage takes; the rules set them from the config's results_dir and mlflow."""
    p.add_argument("--results-dir", default="results", help="holds the default MLflow store (and results/<exp>/)")
    p.add_argument("--mlflow-experiment", default=EXPERIMENT_NAME, help="MLflow experiment the runs go to")
    p.add_argument("--tracking-uri", help="MLflow store (default: sqlite:///<results-dir>/mlflow.db); the "
                                          "environment's MLFLOW_TRACKING_URI wins over it")


def main(argv: list[str] | None = None) -> None:
    """`python -m qerl.tracking init --results-dir results`: create the store before any job starts."""
    p = argparse.ArgumentParser(prog="python -m qerl.tracking", description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="create and migrate the tracking store and the MLflow experiment")
    add_mlflow_args(init)
    args = p.parse_args(argv)
    try:
        uri, exp_id = ensure_store(args.results_dir, args.mlflow_experiment, args.tracking_uri)
        print(f"MLflow store ready: {uri}\n  runs of experiment {args.mlflow_experiment!r}: "
              f"{experiment_link(uri, exp_id)}")
    except QerlError as err:
        sys.stderr.write(f"error: {err}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
