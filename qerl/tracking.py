"""MLflow tracking: the only module that imports mlflow.

One MLflow run per stage and experiment, named "<experiment>/<stage>", tagged qerl.experiment, qerl.stage,
qerl.git_commit and qerl.upstream_run_id (the run of the stage that produced this stage's input), all in one
MLflow experiment so `mlflow.search_runs(filter_string="tags.`qerl.experiment` = 'demo'")` lists a pipeline.
Default store: sqlite:///<results>/mlflow.db with artifacts under <results>/mlartifacts; MLFLOW_TRACKING_URI
(e.g. a shared `mlflow server`) overrides it. Each stage writes `<results>/<experiment>/runs/<stage>.json`
({run_id, tracking_uri, experiment_id}) next to its output; the next stage reads it to link the runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from qerl.errors import QerlError
from qerl.io import atomic_write_text

EXPERIMENT_NAME = "qerl"


def tracking_uri(results_dir: str | Path = "results") -> str:
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{Path(results_dir).resolve() / 'mlflow.db'}"


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


def check_tracking_server(uri: str, timeout: float = 5.0) -> None:
    """Fail in seconds, before expensive work, when an http(s) tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as resp:
            if resp.status != 200:
                raise QerlError(f"MLflow server {uri} answered /health with HTTP {resp.status}")
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise QerlError(f"MLflow tracking server {uri} is unreachable ({reason}); start it or unset "
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
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return flat


def _experiment_id(mlflow, results_dir: Path, name: str) -> str:
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if not os.environ.get("MLFLOW_TRACKING_URI") and not os.environ.get("MLFLOW_ARTIFACT_ROOT"):
        location = (results_dir.resolve() / "mlartifacts").as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # another stage created it concurrently
        return mlflow.get_experiment_by_name(name).experiment_id


class StageRun:
    """Handle given to a stage: log metrics/artifacts without touching mlflow directly."""

    def __init__(self, mlflow, run_id: str):
        self._mlflow, self.run_id = mlflow, run_id

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


def read_run_file(path: str | Path | None) -> str | None:
    if path is None or not Path(path).is_file():
        return None
    return json.loads(Path(path).read_text()).get("run_id")


@contextmanager
def stage_run(*, experiment: str, stage: str, params: dict[str, Any], run_file: str | Path,
              results_dir: str | Path = "results", upstream_run_file: str | Path | None = None,
              mlflow_experiment: str = EXPERIMENT_NAME) -> Iterator[StageRun]:
    """Open the MLflow run of one stage; on success write run_file (the link the next stage reads)."""
    import mlflow

    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri(results_dir)
    check_tracking_server(uri)
    _use_uri(mlflow, uri)
    exp_id = _experiment_id(mlflow, results_dir, mlflow_experiment)
    tags = {"qerl.experiment": experiment, "qerl.stage": stage, "qerl.git_commit": git_commit()}
    upstream = read_run_file(upstream_run_file)
    if upstream:
        tags["qerl.upstream_run_id"] = upstream
    t0 = time.time()
    with mlflow.start_run(experiment_id=exp_id, run_name=f"{experiment}/{stage}", tags=tags) as run:
        handle = StageRun(mlflow, run.info.run_id)
        handle.log_params(params)
        handle.log_dict(params, f"{stage}_config.json")
        yield handle
        handle.log_metrics({"stage_seconds": time.time() - t0})
    atomic_write_text(run_file, json.dumps({"run_id": run.info.run_id, "tracking_uri": uri,
                                            "experiment_id": exp_id, "stage": stage}, indent=2))


def find_stage_runs(experiment: str, results_dir: str | Path = "results",
                    mlflow_experiment: str = EXPERIMENT_NAME) -> list[dict[str, Any]]:
    """Finished runs of one qerl experiment, as dicts (used by tests and tables)."""
    import mlflow

    _use_uri(mlflow, tracking_uri(results_dir))
    exp = mlflow.get_experiment_by_name(mlflow_experiment)
    if exp is None:
        return []
    df = mlflow.search_runs([exp.experiment_id], filter_string=f"tags.`qerl.experiment` = '{experiment}'",
                            output_format="list")
    return [{"run_id": r.info.run_id, "stage": r.data.tags.get("qerl.stage"), "status": r.info.status,
             "params": r.data.params, "metrics": r.data.metrics, "artifact_uri": r.info.artifact_uri}
            for r in df]
