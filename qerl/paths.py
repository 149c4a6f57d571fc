"""Where everything lives: the one definition of the results and logs layout.

    results/<experiment>/quantized/          stage 1 output (quantize.json inside)
    results/<experiment>/adapter/            stage 2 output (trainer_state.json, metrics.csv, training_curves.png)
    results/<experiment>/checkpoints/        training checkpoints, <fingerprint>/step-NNNNNN (qerl.checkpoint)
    results/<experiment>/merged/             stage 3 output (merge.json inside)
    results/<experiment>/eval.json           stage 4 output; eval_records/ beside it holds per-problem JSONL
    results/<experiment>/runs/<stage>.json   the MLflow run id of each stage (the link the next stage reads)
    results/<experiment>/report/             accuracies and training curves for `snakemake --report` (qerl.report)
    results/tables/                          the paper's tables and training curves (runs/tables.json)
    results/ablations/<name>/                an ablation's curves.png, table1.md, ablation.json (runs/ablation.json)
    results/bench/<experiment>.json          optional Table 3 inputs (speed, size)
    results/mlflow.db, results/mlartifacts/  the default MLflow store
    logs/<experiment>/<stage>.log            each job's output (and <stage>.benchmark.tsv: its time and memory)

The Snakemake rules (workflow/rules/common.smk), the stage CLIs' defaults and qerl.tables all ask this module,
so a stage run by hand writes where its rule would.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from qerl.errors import QerlError

STAGES = ("quantize", "train", "merge", "evaluate")
# Folders of results/ that are not experiments: an experiment of that name would share them.
RESERVED_NAMES = frozenset({"tables", "bench", "mlartifacts", "ablations"})
EVAL_RECORDS = "eval_records"
LOGS = Path("logs")


# results_dir may not be inside these: a run (or a stray `rm -r` of its results) must never touch the system
SYSTEM_DIRS = frozenset({"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "sys",
                         "usr"})


def results_dir_problem(results_dir: str, cwd: Path | None = None) -> str | None:
    """Why a config's results_dir cannot hold outputs, or None. Allowed: a folder below the working directory
    (relative, no '..') or an absolute folder at least two deep outside the system trees; never the working
    directory or a folder above it (the outputs would mix with the repository's files)."""
    if not results_dir.strip() or "\0" in results_dir:
        return "is empty or holds a NUL byte"
    if results_dir.startswith("~"):
        return "starts with '~', which nothing expands (a folder named '~' would be made): write the path out"
    if ".." in PurePosixPath(results_dir).parts:
        return "has a '..' segment: name a folder below the working directory, or an absolute path"
    norm = os.path.normpath(results_dir)
    segments = [s for s in norm.split("/") if s]
    if norm.startswith("/") and len(segments) < 2:
        return ("is the filesystem root or a folder directly under it: name a folder of its own (e.g. "
                "/scratch/<you>/qerl-results)")
    if norm.startswith("/") and segments[0] in SYSTEM_DIRS:
        return f"is inside the system folder /{segments[0]}: name a folder of its own (e.g. /scratch/<you>/results)"
    cwd = (cwd or Path.cwd()).resolve()
    if Path(results_dir).resolve() in (cwd, *cwd.parents):
        return "is the working directory or a folder above it: name a folder of its own (e.g. results)"
    return None


def _component(name: str, what: str) -> str:
    """A name that becomes one folder of the layout: never a separator, '..' or '.', so no path leaves results/."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise QerlError(f"{what} {name!r} cannot be a folder name of the results layout (no '/', '\\', '..')")
    return name


def eval_records_dir(eval_json: str | Path) -> Path:
    """Per-problem records live beside their eval.json, wherever --out puts it."""
    return Path(eval_json).parent / EVAL_RECORDS


def log_file(experiment: str, stage: str) -> Path:
    return LOGS / experiment / f"{stage}.log"


def benchmark_file(experiment: str, stage: str) -> Path:
    return LOGS / experiment / f"{stage}.benchmark.tsv"


@dataclass(frozen=True)
class Layout:
    """The results layout under one results directory (the config's results_dir)."""

    results: Path = Path("results")

    def __post_init__(self):
        object.__setattr__(self, "results", Path(self.results))

    def experiment(self, experiment: str) -> Path:
        return self.results / _component(experiment, "experiment")

    def quantized(self, experiment: str) -> Path:
        return self.experiment(experiment) / "quantized"

    def adapter(self, experiment: str) -> Path:
        return self.experiment(experiment) / "adapter"

    def checkpoints(self, experiment: str) -> Path:
        return self.experiment(experiment) / "checkpoints"

    def merged(self, experiment: str) -> Path:
        return self.experiment(experiment) / "merged"

    def eval_json(self, experiment: str) -> Path:
        return self.experiment(experiment) / "eval.json"

    def eval_records(self, experiment: str) -> Path:
        return eval_records_dir(self.eval_json(experiment))

    def metrics_csv(self, experiment: str) -> Path:
        return self.adapter(experiment) / "metrics.csv"

    def report(self, experiment: str) -> Path:
        return self.experiment(experiment) / "report"

    def run_file(self, experiment: str, stage: str) -> Path:
        return self.experiment(experiment) / "runs" / f"{stage}.json"

    def tables(self) -> Path:
        return self.results / "tables"

    def tables_run_file(self) -> Path:
        return self.tables() / "runs" / "tables.json"

    def ablation(self, name: str) -> Path:
        return self.results / "ablations" / _component(name, "ablation")

    def bench_json(self, experiment: str) -> Path:
        return self.results / "bench" / f"{_component(experiment, 'experiment')}.json"

    def mlflow_db(self) -> Path:
        return self.results / "mlflow.db"

    def mlartifacts(self) -> Path:
        return self.results / "mlartifacts"
