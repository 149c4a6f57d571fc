# What `snakemake --report` shows of an experiment: its accuracies and training curves, rendered by qerl.report
# from eval.json and the train stage's metrics.csv. `rule all` asks for them, so the demo's report holds them; the
# landing page (workflow.rst) shows each experiment's landing.html: the accuracy table and the curves figure.
report: "../report/workflow.rst"


def report_dir(experiment):
    return str(LAYOUT.report(experiment))


def report_files(experiment):
    d = report_dir(experiment)
    return [f"{d}/accuracy.html", f"{d}/accuracy.png", f"{d}/training_curves.png", f"{d}/landing.html",
            f"{d}/summary.png"]


rule experiment_report:
    input:
        eval=eval_json("{experiment}"),
        adapter=adapter_dir("{experiment}"),
    output:
        table=report(f"{report_dir('{experiment}')}/accuracy.html", caption="../report/accuracy.rst",
                     category="Accuracy", labels={"experiment": "{experiment}", "figure": "table"}),
        chart=report(f"{report_dir('{experiment}')}/accuracy.png", caption="../report/accuracy.rst",
                     category="Accuracy", labels={"experiment": "{experiment}", "figure": "bars"}),
        curves=report(f"{report_dir('{experiment}')}/training_curves.png", caption="../report/curve.rst",
                      category="Training curves", labels={"experiment": "{experiment}", "figure": "curves"}),
        landing=f"{report_dir('{experiment}')}/landing.html",
        summary=f"{report_dir('{experiment}')}/summary.png",  # accuracy beside reward: the README's image
    params:
        metrics=str(LAYOUT.metrics_csv("{experiment}")),
        out=report_dir("{experiment}"),
    log:
        log_file("report"),
    resources:
        mem_mb=2000,
        runtime=5,
    shell:
        "{PYTHON:q} -m qerl.report --experiment {wildcards.experiment:q} --eval {input.eval:q}"
        " --metrics {params.metrics:q} --out-dir {params.out:q} > {log:q} 2>&1"
