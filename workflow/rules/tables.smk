# The paper's tables and training plots from every experiment that has finished (missing ones stay missing).
TABLES = str(LAYOUT.tables())  # beside the experiments, wherever the config's results_dir puts them


def finished_evals(wildcards):
    return [eval_json(name) for name in CFG.experiments if Path(eval_json(name)).exists()]


rule tables:
    input:
        finished_evals,
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
