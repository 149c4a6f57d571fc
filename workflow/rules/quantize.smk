rule quantize:
    input:
        model=model_input,
    output:
        model=directory(quantized_dir("{experiment}")),
        run=run_file("quantize"),
    params:
        model=model_ref,
        cfg=stage_json("quantize"),
        data=calibration_data_json,
    log:
        "logs/{experiment}/quantize.log",
    benchmark:
        "logs/{experiment}/quantize.benchmark.tsv"
    resources:
        mem_mb=mem_mb_quantize,
        runtime=60,
        gpu=gpus,
    shell:
        "{PYTHON} -m qerl.quantize --experiment {wildcards.experiment} --model {params.model}"
        " --out {output.model} --config-json {params.cfg:q} --calibration-data-json {params.data:q}"
        " --run-file {output.run} --results-dir {RESULTS} > {log} 2>&1"
