# Path and config helpers shared by the rules. The config is validated by qerl.config (one line naming the
# bad key) before any rule is defined; the JSON Schema check in the Snakefile is the same contract.
# Every path comes from qerl.paths, which the stage CLIs' defaults use too.
import json
import re
import shlex
import sys
import time
from pathlib import Path

from qerl.ablation import ablation_run_names, expand_ablations, quantize_sources, render_spec
from qerl.config import parse_config, section_json
from qerl.errors import QerlError
from qerl.memory import needs_gpu, train_job_mem_mb
from qerl import paths
from qerl.paths import Layout

try:
    # each ablation run becomes an ordinary experiment, so the stage rules below build it like any other
    CFG = expand_ablations(parse_config(config, where="config"))
except QerlError as err:
    sys.stderr.write(f"config error: {err}\n")
    sys.exit(1)

RESULTS = CFG.results_dir
LAYOUT = Layout(RESULTS)
PYTHON = CFG.python or sys.executable
STARTED = time.time()


def _mlflow_args():
    """The tracking options every stage (and `qerl.tracking init`) gets, already shell-quoted."""
    args = f"--results-dir {shlex.quote(RESULTS)} --mlflow-experiment {shlex.quote(CFG.mlflow.experiment_name)}"
    if CFG.mlflow.tracking_uri:
        args += f" --tracking-uri {shlex.quote(CFG.mlflow.tracking_uri)}"
    return args


MLFLOW = _mlflow_args()


wildcard_constraints:
    experiment="|".join(re.escape(name) for name in sorted(CFG.experiments)) or "NONE",


def exp(wildcards):
    return CFG.experiments[wildcards.experiment]


def quantized_dir(experiment):
    return str(LAYOUT.quantized(experiment))


# ablation runs that train on another run's quantized checkpoint (same model and quantize section)
QUANTIZED_FROM = quantize_sources(CFG)
ABLATION_RUNS = ablation_run_names(CFG)  # built by their ablation's target, not by all_experiments


def quantized_input(wildcards):
    """The quantized checkpoint an experiment trains on: its own, or the one it shares (QUANTIZED_FROM)."""
    return quantized_dir(QUANTIZED_FROM.get(wildcards.experiment, wildcards.experiment))


def quantize_run_input(wildcards):
    source = QUANTIZED_FROM.get(wildcards.experiment, wildcards.experiment)
    return str(LAYOUT.run_file(source, "quantize"))


def adapter_dir(experiment):
    return str(LAYOUT.adapter(experiment))


def merged_dir(experiment):
    return str(LAYOUT.merged(experiment))


def eval_json(experiment):
    return str(LAYOUT.eval_json(experiment))


def run_file(stage):
    return str(LAYOUT.run_file("{experiment}", stage))


def log_file(stage):
    return str(paths.log_file("{experiment}", stage))


def benchmark_file(stage):
    return str(paths.benchmark_file("{experiment}", stage))


def model_input(wildcards):
    """Local model directories are inputs (resources/ ones are built by a rule); hub names are not."""
    model = exp(wildcards).model
    return [model] if model.startswith("resources/") or Path(model).exists() else []


def model_ref(wildcards):
    return exp(wildcards).model


def revision_arg(wildcards):
    """`--revision REV` (already shell-quoted) for the stages that read the base model, or nothing."""
    rev = exp(wildcards).model_revision
    return f"--revision {shlex.quote(rev)}" if rev else ""


def stage_json(kind):
    def _json(wildcards):
        return section_json(exp(wildcards), kind)

    return _json


def data_inputs(wildcards):
    """Dataset files built by a rule (resources/...) must exist before train/evaluate run."""
    e = exp(wildcards)
    paths = [e.train.data.source] + [b.source for b in e.eval.benchmarks if b.source]
    return [p for p in paths if p.startswith("resources/")]


def stage_python(wildcards, engine):
    if engine == "vllm" and CFG.vllm_python:
        return CFG.vllm_python
    return PYTHON


def train_python(wildcards):
    return stage_python(wildcards, exp(wildcards).train.rollout.engine)


def eval_python(wildcards):
    return stage_python(wildcards, exp(wildcards).eval.engine)


# Resources scale with the model: a 32B model needs one 80 GB GPU and more host memory than a 7B.
_SIZE_GB = {"0.1B": 1, "0.5B": 2, "1.5B": 4, "3B": 8, "7B": 16, "14B": 32, "32B": 72}


def _size_gb(wildcards):
    return _SIZE_GB.get(exp(wildcards).model_size or "0.1B", 16)


def gpus(wildcards):
    return 1 if needs_gpu(exp(wildcards).model_size) else 0


def needs_gpu_arg(wildcards):
    """--needs-gpu <model_size> for the stages of an experiment sized for a GPU: on a machine without one they stop
    in one line before any work (no 15 GB download for a CPU box); QERL_ALLOW_CPU=1 lets them run anyway."""
    return f"--needs-gpu {shlex.quote(str(exp(wildcards).model_size))}" if gpus(wildcards) else ""


def train_gpus(wildcards):
    """One GPU per data-parallel rank of a one-node train job (train.num_gpus; --gpus counts the job's GPUs); none
    for CPU-sized experiments; unset for several nodes, whose GPUs are asked per node (multi_node's gres)."""
    t = exp(wildcards).train
    return 0 if gpus(wildcards) == 0 else t.num_gpus if t.num_nodes == 1 else None


def multi_node(key):
    """A train job over train.num_nodes nodes as the SLURM executor plugin runs a multi-node (its `mpi`) job: one
    task per node, the rule's command run once on the first node, where qerl.launch starts srun (the plugin wraps
    no srun of its own around it), --gres gpu:<num_gpus> on each node (--gpus would count the job's GPUs,
    however spread); tasks_per_gpu 0 stops the plugin from turning tasks into --ntasks-per-gpu. None (unset) for
    one node, so one-node jobs are submitted as before."""

    def value(wildcards):
        t = exp(wildcards).train
        if t.num_nodes == 1:
            return None
        return {"nodes": t.num_nodes, "tasks": t.num_nodes, "tasks_per_gpu": 0, "mpi": "srun",
                "gres": f"gpu:{t.num_gpus}" if gpus(wildcards) else None}[key]

    return value


def mem_mb_quantize(wildcards):
    return max(4000, 3 * 1024 * _size_gb(wildcards))


def mem_mb_train(wildcards):
    return max(6000, 2 * 1024 * _size_gb(wildcards))


def mem_mb_train_job(wildcards):
    # SLURM's --mem is per node, and which ranks hold a whole model on the host depends on the mode
    e = exp(wildcards)
    return train_job_mem_mb(e.train, e.model_size, mem_mb_train(wildcards))


def runtime_train(wildcards):
    # the CPU demo trains in ~10 min alone on 2 cores and took 41 min on a loaded one
    return 90 if gpus(wildcards) == 0 else 24 * 60


def runtime_eval(wildcards):
    return 20 if gpus(wildcards) == 0 else 6 * 60


def calibration_data_json(wildcards):
    """nvfp4-awq calibrates on the training prompts."""
    return exp(wildcards).train.data.model_dump_json()


def checkpoint_dir(wildcards):
    return str(LAYOUT.checkpoints(wildcards.experiment))


def table_rows_json(wildcards):
    """What the tables need of each experiment: its row and size (other edits must not rerun them)."""
    rows = {name: {"row": e.row, "model_size": e.model_size} for name, e in CFG.experiments.items() if e.row}
    return json.dumps({"experiments": rows}, sort_keys=True)


def print_new_results():
    """The accuracies of every eval.json this run wrote, so a run ends with its results on the console."""
    from qerl.tables import summary

    fresh = [p for p in map(LAYOUT.eval_json, CFG.experiments) if p.is_file() and p.stat().st_mtime >= STARTED]
    if fresh:
        print("\n" + summary(fresh) + "\nlogs of each stage: logs/<experiment>/<stage>.log", flush=True)
