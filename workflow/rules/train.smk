rule train:
    input:
        model=quantized_dir("{experiment}"),
        upstream=run_file("quantize"),
        data=data_inputs,
    output:
        adapter=directory(adapter_dir("{experiment}")),
        run=run_file("train"),
    params:
        cfg=stage_json("train"),
        python=train_python,
        checkpoints=checkpoint_dir,
    log:
        log_file("train"),
    benchmark:
        benchmark_file("train")
    resources:
        mem_mb=mem_mb_train,
        runtime=runtime_train,
        gpu=gpus,
    shell:
        "{params.python:q} -m qerl.train --experiment {wildcards.experiment:q} --model {input.model:q}"
        " --out {output.adapter:q} --checkpoint-dir {params.checkpoints:q} --resume"
        " --config-json {params.cfg:q} --run-file {output.run:q} --upstream-run-file {input.upstream:q}"
        " {MLFLOW} > {log:q} 2>&1"
