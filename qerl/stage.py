"""What every stage CLI shares: common arguments, loading its config section, one-line errors.

A rule passes the stage's config section as JSON (--config-json) and the config's results_dir and mlflow
settings (--results-dir, --mlflow-experiment, --tracking-uri); by hand, name the config file and the experiment
instead (--config config/config.yaml --experiment demo), and the defaults write where the rules would
(qerl.paths).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

from pydantic import BaseModel

from qerl.config import load_config, parse_section
from qerl.errors import QerlError, out_of_memory_names
from qerl.paths import Layout
from qerl.tracking import add_mlflow_args


def stage_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiment", required=True, help="experiment name (tags the MLflow run)")
    p.add_argument("--config-json", help="this stage's config section as JSON (what the rules pass)")
    p.add_argument("--config", help="a config file to read the section from (by hand)")
    p.add_argument("--run-file", help="where to write this stage's MLflow run id "
                                      "(default: <results-dir>/<experiment>/runs/<stage>.json)")
    p.add_argument("--upstream-run-file", help="run id file of the stage that produced the input")
    p.add_argument("--needs-gpu", metavar="MODEL_SIZE", help="the experiment is sized for a CUDA GPU (the rules "
                   f"pass its model_size): stop at once on a machine without one ({ALLOW_CPU}=1 runs it anyway)")
    add_mlflow_args(p)
    return p


ALLOW_CPU = "QERL_ALLOW_CPU"


def check_device(args: argparse.Namespace) -> None:
    """One line, before any work, when the stage was told its experiment needs a GPU and torch sees none."""
    size = getattr(args, "needs_gpu", None)
    if not size or os.environ.get(ALLOW_CPU) == "1":
        return
    import torch

    if not torch.cuda.is_available():
        raise QerlError(f"experiment '{args.experiment}' (model_size {size}) needs a CUDA GPU and torch sees none on "
                        f"this machine: run it on a GPU machine or through a cluster profile (snakemake --profile "
                        f"workflow/profiles/slurm ...); {ALLOW_CPU}=1 runs it on the CPU anyway (hours to days)")


def tracking_args(args: argparse.Namespace) -> dict:
    """The keyword arguments of qerl.tracking.stage_run that every stage takes from its command line."""
    return {"results_dir": args.results_dir, "mlflow_experiment": args.mlflow_experiment, "uri": args.tracking_uri,
            "upstream_run_file": getattr(args, "upstream_run_file", None)}


def load_section(args: argparse.Namespace, kind: str) -> BaseModel:
    check_device(args)  # every stage reads its section first: nothing is fetched or built before this
    if args.config_json:
        return parse_section(kind, args.config_json)
    if not args.config:
        raise QerlError("give --config-json or --config")
    cfg = load_config(args.config)
    if args.experiment not in cfg.experiments:
        raise QerlError(f"{args.config}: no experiment '{args.experiment}' (have: {', '.join(cfg.experiments)})")
    exp = cfg.experiments[args.experiment]
    return exp.eval if kind == "eval" else getattr(exp, kind)


def default_run_file(args: argparse.Namespace, stage: str) -> Path:
    if args.run_file:
        return Path(args.run_file)
    return Layout(args.results_dir).run_file(args.experiment, stage)


def require_dir(path: str | Path, what: str, must_contain: tuple[str, ...] = ("config.json",)) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise QerlError(f"{what}: directory not found: {path}")
    for name in must_contain:
        if not (path / name).exists():
            raise QerlError(f"{what}: {path} has no {name}")
    return path


def use_available_cpus() -> int:
    """torch threads = the CPUs this process may run on (its affinity mask: a SLURM job's allocation, all cores
    locally), or QERL_NUM_THREADS. Snakemake exports OMP_NUM_THREADS=<rule threads>, which is 1 under
    `snakemake --cores 1` and would halve the CPU demo's speed on a 2-core machine while the job runs alone."""
    import torch

    n = int(os.environ.get("QERL_NUM_THREADS") or len(os.sched_getaffinity(0)))
    torch.set_num_threads(n)
    return n


def run_main(fn: Callable[[list[str] | None], None], argv: list[str] | None = None) -> None:
    """Run a stage main; user mistakes end as one line on stderr and exit code 2."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # transformers warns on every save of a model llmcompressor dispatched, about a 50 GB shard buffer never used here
    warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
    use_available_cpus()
    try:
        from qerl.compile_cache import configure
        from qerl.quant.dispatch import check_kernel_environment

        check_kernel_environment()
        configure()  # before anything compiles: kernels compiled once serve later runs and the other ranks
        with out_of_memory_names("this stage"):  # where no phase (rollout, update) named it more closely
            fn(argv)
    except QerlError as err:
        sys.stderr.write(f"error: {err}\n")
        _exit(2)


def _exit(code: int) -> None:
    """sys.exit, or os._exit once the streams are flushed where torch.distributed's teardown could abort the
    process after the error line (its MLflow run has already ended with the with-block that opened it)."""
    distributed = sys.modules.get("qerl.distributed")
    if distributed is not None and distributed.exit_now_is_safer():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
