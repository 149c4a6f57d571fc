def train_launch(wildcards):
    """`python -m qerl.train`, or torchrun over train.num_gpus ranks of one node (the interpreter's own torchrun:
    `python -m torch.distributed.run`); already shell-quoted."""
    python = shlex.quote(train_python(wildcards))
    n = exp(wildcards).train.num_gpus
    if n == 1:
        return f"{python} -m qerl.train"
    return f"{python} -m torch.distributed.run --standalone --nproc-per-node {n} -m qerl.train"


rule train:
    input:
        model=quantized_input,
        upstream=quantize_run_input,
        data=data_inputs,
    output:
        adapter=directory(adapter_dir("{experiment}")),
        run=run_file("train"),
    params:
        cfg=stage_json("train"),
        launch=train_launch,
        checkpoints=checkpoint_dir,
        gpu=needs_gpu_arg,
    log:
        log_file("train"),
    benchmark:
        benchmark_file("train")
    resources:
        mem_mb=mem_mb_train_job,
        runtime=runtime_train,
        gpu=train_gpus,
    shell:
        "{params.launch} --experiment {wildcards.experiment:q} --model {input.model:q}"
        " --out {output.adapter:q} --checkpoint-dir {params.checkpoints:q} --resume"
        " --config-json {params.cfg:q} --run-file {output.run:q} --upstream-run-file {input.upstream:q}"
        " {params.gpu} {MLFLOW} 2>&1 | tee {log:q}"
        # the console gets the progress lines and a failure's one error line; the log gets everything
        " | {{ grep --line-buffered -E '^(qerl progress|error:)' || true; }}"
