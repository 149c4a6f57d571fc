rule merge:
    input:
        base=quantized_dir("{experiment}"),
        adapter=adapter_dir("{experiment}"),
        upstream=run_file("train"),
    output:
        model=directory(merged_dir("{experiment}")),
        run=run_file("merge"),
    params:
        cfg=stage_json("merge"),
    log:
        "logs/{experiment}/merge.log",
    benchmark:
        "logs/{experiment}/merge.benchmark.tsv"
    resources:
        mem_mb=mem_mb_quantize,
        runtime=30,
        gpu=0,
    shell:
        "{PYTHON} -m qerl.merge --experiment {wildcards.experiment} --base {input.base}"
        " --adapter {input.adapter} --out {output.model} --config-json {params.cfg:q}"
        " --run-file {output.run} --upstream-run-file {input.upstream} --results-dir {RESULTS} > {log} 2>&1"
