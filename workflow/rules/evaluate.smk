rule evaluate:
    input:
        merged=merged_dir("{experiment}"),
        quantized=quantized_input,
        base=model_input,
        upstream=run_file("merge"),
        data=data_inputs,
    output:
        eval=eval_json("{experiment}"),
        run=run_file("evaluate"),
    params:
        cfg=stage_json("eval"),
        python=eval_python,
        base=model_ref,
        revision=revision_arg,
        data_dir=CFG.data_dir,
        gpu=needs_gpu_arg,
    log:
        log_file("evaluate"),
    benchmark:
        benchmark_file("evaluate")
    resources:
        mem_mb=mem_mb_train,
        runtime=runtime_eval,
        gpu=gpus,
    shell:
        "{params.python:q} -m qerl.evaluate --experiment {wildcards.experiment:q} --trained {input.merged:q}"
        " --quantized {input.quantized:q} --base {params.base:q} {params.revision} --data-dir {params.data_dir:q}"
        " --out {output.eval:q} --config-json {params.cfg:q} --run-file {output.run:q}"
        " --upstream-run-file {input.upstream:q} {params.gpu} {MLFLOW} 2>&1 | tee {log:q}"
        # the console gets the progress lines and a failure's one error line; the log gets everything
        " | {{ grep --line-buffered -E '^(qerl progress|error:)' || true; }}"
