# The paper's tables and training plots from every experiment that has finished (missing ones stay missing).


def finished_evals(wildcards):
    return [eval_json(name) for name in CFG.experiments if Path(eval_json(name)).exists()]


rule tables:
    input:
        finished_evals,
    output:
        table1=report("results/tables/table1.md", category="Tables"),
        table2=report("results/tables/table2.md", category="Tables"),
        table3=report("results/tables/table3.md", category="Tables"),
    params:
        experiments=experiments_json,
    log:
        "logs/tables.log",
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "{PYTHON} -m qerl.tables --config-json {params.experiments:q} --results-dir {RESULTS}"
        " --out-dir results/tables > {log} 2>&1"
