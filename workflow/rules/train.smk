def train_launch(wildcards):
    """`python -m qerl.train`, torchrun over train.num_gpus ranks of one node (the interpreter's own torchrun:
    `python -m torch.distributed.run`), or qerl.launch: a torchrun per node of train.num_nodes (srun under SLURM);
    already shell-quoted."""
    python = shlex.quote(train_python(wildcards))
    t = exp(wildcards).train
    if t.num_nodes > 1:
        return f"{python} -m qerl.launch --nodes {t.num_nodes} --nproc-per-node {t.num_gpus} --"
    if t.num_gpus == 1:
        return f"{python} -m qerl.train"
    return f"{python} -m torch.distributed.run --standalone --nproc-per-node {t.num_gpus} -m qerl.train"


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
        # several nodes: the SLURM executor's multi-node job (see common.smk); unset for one node
        nodes=multi_node("nodes"),
        tasks=multi_node("tasks"),
        tasks_per_gpu=multi_node("tasks_per_gpu"),
        gres=multi_node("gres"),
        mpi=multi_node("mpi"),
    shell:
        "{params.launch} --experiment {wildcards.experiment:q} --model {input.model:q}"
        " --out {output.adapter:q} --checkpoint-dir {params.checkpoints:q} --resume"
        " --config-json {params.cfg:q} --run-file {output.run:q} --upstream-run-file {input.upstream:q}"
        " {params.gpu} {MLFLOW} 2>&1 | tee {log:q}"
        # the console gets the progress lines and a failure's one error line; the log gets everything
        " | {{ grep --line-buffered -E '^(qerl progress|error:)' || true; }}"
