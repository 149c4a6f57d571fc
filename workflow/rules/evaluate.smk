rule evaluate:
    input:
        merged=merged_dir("{experiment}"),
        quantized=quantized_dir("{experiment}"),
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
        data_dir=CFG.data_dir,
    log:
        "logs/{experiment}/evaluate.log",
    benchmark:
        "logs/{experiment}/evaluate.benchmark.tsv"
    resources:
        mem_mb=mem_mb_train,
        runtime=runtime_eval,
        gpu=gpus,
    shell:
        "{params.python} -m qerl.evaluate --experiment {wildcards.experiment} --trained {input.merged}"
        " --quantized {input.quantized} --base {params.base} --data-dir {params.data_dir}"
        " --out {output.eval} --config-json {params.cfg:q} --run-file {output.run}"
        " --upstream-run-file {input.upstream} --results-dir {RESULTS} > {log} 2>&1"
