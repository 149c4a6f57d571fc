rule quantize:
    input:
        model=model_input,
    output:
        model=directory(quantized_dir("{experiment}")),
        run=run_file("quantize"),
    params:
        model=model_ref,
        revision=revision_arg,
        cfg=stage_json("quantize"),
        data=calibration_data_json,
        gpu=needs_gpu_arg,
    log:
        log_file("quantize"),
    benchmark:
        benchmark_file("quantize")
    resources:
        mem_mb=mem_mb_quantize,
        runtime=60,
        gpu=gpus,
    shell:
        "{PYTHON:q} -m qerl.quantize --experiment {wildcards.experiment:q} --model {params.model:q} {params.revision}"
        " --out {output.model:q} --config-json {params.cfg:q} --calibration-data-json {params.data:q}"
        " --run-file {output.run:q} {params.gpu} {MLFLOW} 2>&1 | tee {log:q}"
        # the console gets the progress lines and a failure's one error line; the log gets everything
        " | {{ grep --line-buffered -E '^(qerl progress|error:)' || true; }}"
