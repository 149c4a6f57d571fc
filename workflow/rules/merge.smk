rule merge:
    input:
        base=quantized_input,
        adapter=adapter_dir("{experiment}"),
        upstream=run_file("train"),
    output:
        model=directory(merged_dir("{experiment}")),
        run=run_file("merge"),
    params:
        cfg=stage_json("merge"),
    log:
        log_file("merge"),
    benchmark:
        benchmark_file("merge")
    resources:
        mem_mb=mem_mb_quantize,
        runtime=30,
        gpu=0,
    shell:
        "{PYTHON:q} -m qerl.merge --experiment {wildcards.experiment:q} --base {input.base:q}"
        " --adapter {input.adapter:q} --out {output.model:q} --config-json {params.cfg:q}"
        " --run-file {output.run:q} --upstream-run-file {input.upstream:q} {MLFLOW} 2>&1 | tee {log:q}"
        # the console gets the progress lines and a failure's one error line; the log gets everything
        " | {{ grep --line-buffered -E '^(qerl progress|error:)' || true; }}"
