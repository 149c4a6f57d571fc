# An ablation (config: ablations) is methods x seeds of one base experiment; common.smk made each run an
# experiment, so quantize -> train -> merge -> evaluate build them. This rule renders the curves and the table.
ABLATIONS = str(LAYOUT.results / "ablations")


wildcard_constraints:
    ablation="|".join(re.escape(name) for name in sorted(CFG.ablations)) or "NONE",


def ablation_evals(wildcards):
    from qerl.ablation import ablation_runs, run_name

    runs = ablation_runs(CFG, wildcards.ablation)
    return [eval_json(run_name(wildcards.ablation, m, seed)) for m, seeds in runs.items() for seed in seeds]


def ablation_spec_json(wildcards):
    return json.dumps(render_spec(CFG, wildcards.ablation, RESULTS), sort_keys=True)


rule ablation:
    input:
        ablation_evals,
    output:
        curves=report(f"{ABLATIONS}/{{ablation}}/curves.png", category="Ablation", subcategory="{ablation}"),
        table=report(f"{ABLATIONS}/{{ablation}}/table1.md", category="Ablation", subcategory="{ablation}"),
        summary=f"{ABLATIONS}/{{ablation}}/ablation.json",
        run=f"{ABLATIONS}/{{ablation}}/runs/ablation.json",
    params:
        spec=ablation_spec_json,
    log:
        str(paths.LOGS / "ablations" / "{ablation}.log"),
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "{PYTHON:q} -m qerl.ablation render --name {wildcards.ablation:q} --spec-json {params.spec:q}"
        " --out-dir {ABLATIONS:q}/{wildcards.ablation:q} {MLFLOW} > {log:q} 2>&1"


# `snakemake <ablation name>`: a target per ablation
for _ablation in CFG.ablations:

    rule:
        name:
            _ablation
        input:
            f"{ABLATIONS}/{_ablation}/table1.md",
            f"{ABLATIONS}/{_ablation}/curves.png",
