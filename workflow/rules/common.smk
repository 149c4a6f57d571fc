# Path and config helpers shared by the rules. The config is validated by qerl.config (one line naming the
# bad key) before any rule is defined; the JSON Schema check in the Snakefile is the same contract.
import re
import shlex
import sys
from pathlib import Path

from qerl.config import parse_config, section_json
from qerl.errors import QerlError

try:
    CFG = parse_config(config, where="config")
except QerlError as err:
    sys.stderr.write(f"config error: {err}\n")
    sys.exit(1)

RESULTS = CFG.results_dir
PYTHON = CFG.python or sys.executable


wildcard_constraints:
    experiment="|".join(re.escape(name) for name in sorted(CFG.experiments)) or "NONE",


def exp(wildcards):
    return CFG.experiments[wildcards.experiment]


def out(experiment, *parts):
    return str(Path(RESULTS, experiment, *parts))


def quantized_dir(experiment):
    return out(experiment, "quantized")


def adapter_dir(experiment):
    return out(experiment, "adapter")


def merged_dir(experiment):
    return out(experiment, "merged")


def eval_json(experiment):
    return out(experiment, "eval.json")


def run_file(stage):
    return str(Path(RESULTS, "{experiment}", "runs", f"{stage}.json"))


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
    return 0 if exp(wildcards).model_size in (None, "0.1B") else 1


def mem_mb_quantize(wildcards):
    return max(4000, 3 * 1024 * _size_gb(wildcards))


def mem_mb_train(wildcards):
    return max(6000, 2 * 1024 * _size_gb(wildcards))


def runtime_train(wildcards):
    return 30 if gpus(wildcards) == 0 else 24 * 60


def runtime_eval(wildcards):
    return 20 if gpus(wildcards) == 0 else 6 * 60


def calibration_data_json(wildcards):
    """nvfp4-awq calibrates on the training prompts."""
    return exp(wildcards).train.data.model_dump_json()


def checkpoint_dir(wildcards):
    return out(wildcards.experiment, "checkpoints")


def experiments_json(wildcards):
    return CFG.model_dump_json(include={"experiments"})
