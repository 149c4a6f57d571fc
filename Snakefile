# qerl: quantize -> train (GRPO + AQN on NVFP4) -> merge -> evaluate, one {experiment} per config entry.
#   snakemake --cores 1                               # the CPU demo (config: default_target)
#   snakemake --cores 1 results/qwen7b/eval.json      # one experiment
#   snakemake --cores 1 demo_ablation                 # an ablation (config: ablations): runs, curves, table
#   snakemake --profile workflow/profiles/slurm all_experiments
import os
import sys

from snakemake.utils import min_version, validate

from qerl.config_input import check_yaml_files
from qerl.errors import QerlError

min_version("9.0")
shell.executable("bash")  # strict mode (set -euo pipefail): a stage piped through `tee <log>` fails its job
# jobs write to log files: no progress bars redrawn with carriage returns in them (the stages' own progress lines,
# qerl.progress, stay); every job inherits these (SLURM jobs through --export=ALL)
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

try:  # qerl's reader first: Snakemake's would keep the last of duplicate keys and hand a YAML alias bomb on
    check_yaml_files(["config/config.yaml", *workflow.overwrite_configfiles])
except QerlError as err:
    sys.stderr.write(f"config error: {err}\n")
    sys.exit(1)


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"


# the parsed config, so YAML 1.1 quirks (1e-3 read as a string) get the same verdict as `qerl.config check`
validate(CFG.model_dump(mode="json"), "workflow/schemas/config.schema.yaml", set_default=False)


onstart:
    # the MLflow store is created once, before parallel jobs could race to create and migrate it
    shell("{PYTHON:q} -m qerl.tracking init {MLFLOW}")


onsuccess:
    # a run ends with the accuracies it wrote; each job's output is in logs/<experiment>/<stage>.log
    print_new_results()


include: "workflow/rules/resources.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/merge.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/ablation.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        eval_json(CFG.default_target),
        report_files(CFG.default_target),
    default_target: True


rule all_experiments:
    input:
        [eval_json(name) for name in CFG.experiments if name not in ABLATION_RUNS],
        [f for name in CFG.experiments if name not in ABLATION_RUNS for f in report_files(name)],
