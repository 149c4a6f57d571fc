# The paper's tables and training plots from every experiment that has finished (missing ones stay missing).
TABLES = str(LAYOUT.tables())  # beside the experiments, wherever the config's results_dir puts them


def finished_evals(wildcards):
    return [eval_json(name) for name in CFG.experiments if Path(eval_json(name)).exists()]


def finished_benches(wildcards):
    """Table 3's measurements already made (results/bench/<experiment>.json): a new one re-renders the tables."""
    return [str(LAYOUT.bench_json(name)) for name in CFG.experiments if LAYOUT.bench_json(name).is_file()]


# Table 3's rows: train.mode -> bench.table3's method (BF16 LoRA, NF4 QLoRA, NVFP4 LoRA)
_TABLE3_METHODS = {"lora": "lora", "qlora_nf4": "qlora", "qlora_fp4": "qerl"}


def table3_method(wildcards):
    e = exp(wildcards)
    method = _TABLE3_METHODS.get(e.train.mode)
    if method is None or e.quantize.scheme == "mxfp4" or not e.model_size:
        raise ValueError(f"experiment {wildcards.experiment}: not a Table 3 row (train.mode {e.train.mode}, "
                         f"quantize.scheme {e.quantize.scheme}, model_size {e.model_size})")
    return method


def table3_size(wildcards):
    return exp(wildcards).model_size


def table3_lora_r(wildcards):
    return exp(wildcards).train.lora.lora_r


def table3_checkpoint(wildcards):
    return quantized_dir(wildcards.experiment)


# One GPU job per experiment: its model size, rollout tokens/s and GRPO step time for Table 3. The quantize stage's
# checkpoint (or a local/cached base model) is measured when present, else random weights of the real shapes; it
# is not an input, so the measurement never waits for (or reruns) the pipeline.
rule bench_table3:
    output:
        str(LAYOUT.bench_json("{experiment}")),
    params:
        size=table3_size,
        method=table3_method,
        lora_r=table3_lora_r,
        checkpoint=table3_checkpoint,
        model=model_ref,
    log:
        log_file("bench_table3"),
    resources:
        gpu=1,
        mem_mb=mem_mb_train,
        runtime=30,
    shell:
        "{PYTHON:q} -m bench.table3 --size {params.size:q} --method {params.method} --name {wildcards.experiment:q}"
        " --checkpoint {params.checkpoint:q} --model {params.model:q} --lora-r {params.lora_r}"
        " --tokenizer {CFG.tokenizer_dir:q} --out {output:q} > {log:q} 2>&1"


rule tables:
    input:
        finished_evals,
        finished_benches,
    output:
        report(
            multiext(f"{TABLES}/table1", ".md", ".csv"),
            category="Tables",
            subcategory="Table 1 (GSM8K)",
        ),
        report(
            multiext(f"{TABLES}/table2", ".md", ".csv"),
            category="Tables",
            subcategory="Table 2 (MATH-500, AIME, AMC)",
        ),
        report(
            multiext(f"{TABLES}/table3", ".md", ".csv"),
            category="Tables",
            subcategory="Table 3 (speed, size)",
        ),
        report(f"{TABLES}/training_curves.png", category="Plots"),
    params:
        experiments=table_rows_json,
    log:
        str(paths.LOGS / "tables.log"),
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "{PYTHON:q} -m qerl.tables --config-json {params.experiments:q} {MLFLOW} --out-dir {TABLES:q} > {log:q} 2>&1"
