"""The workflow's static contracts: the config parses, the schema is current, the paper experiment plans."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qerl.config import json_schema, load_config, parse_config, parse_section
from qerl.errors import QerlError
from qerl.paths import STAGES, Layout, log_file

REPO = Path(__file__).resolve().parents[1]


def test_repo_config_is_valid_and_has_the_paper_settings():
    cfg = load_config(REPO / "config" / "config.yaml")
    assert cfg.default_target == "demo"
    t = cfg.experiments["qwen7b"].train
    assert cfg.experiments["qwen7b"].model == "Qwen/Qwen2.5-7B-Instruct"
    assert (t.lora.lora_r, t.learning_rate, t.num_generations, t.batch_size) == (32, 1e-5, 8, 128)
    assert (t.max_completion_length, t.epsilon, t.epsilon_high, t.beta) == (4096, 0.2, 0.28, 0.0)
    assert (t.aqn.sigma_start, t.aqn.sigma_end, t.aqn.num_stages) == (1e-2, 1e-4, 10)  # the released scripts


def test_schema_file_is_generated_from_the_models():
    on_disk = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert on_disk == json_schema(), "run: python -m qerl.config schema > workflow/schemas/config.schema.yaml"


def test_schema_and_models_agree_on_the_repo_config():
    import jsonschema

    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    jsonschema.validate(raw, json_schema())
    bad = dict(raw, bogus=1)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json_schema())
    with pytest.raises(QerlError, match="bogus: unknown key"):
        parse_config(bad)


@pytest.mark.parametrize("section, data, key", [
    ("train", {"data": {"source": "x"}, "epsilon": 0.3, "epsilon_high": 0.2}, "epsilon_high"),
    ("train", {"data": {"source": "x"}, "num_generations": 1}, "num_generations"),
    ("train", {"data": {}}, "data.source"),
    ("eval", {"benchmarks": [{"name": "gsm8k", "k": 0}]}, "benchmarks.0.k"),
    ("quantize", {"scheme": "int3"}, "scheme"),
])
def test_section_errors_name_the_key(section, data, key):
    with pytest.raises(QerlError) as err:
        parse_section(section, data)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_qerl_mode_needs_an_fp4_scheme():
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw["experiments"]["qwen7b"]["quantize"] = {"scheme": "bf16"}
    with pytest.raises(QerlError, match="qlora_fp4 needs quantize.scheme"):
        parse_config(raw)


@pytest.fixture(scope="module")
def plan() -> dict[tuple[str, str], str]:
    """The dry run of the paper's qwen7b and the CPU demo: each planned job's text by (rule, experiment)."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1", "results/qwen7b/eval.json",
                           "results/demo/eval.json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = {}
    for block in proc.stdout.split("\nrule ")[1:]:
        wildcard = re.search(r"wildcards: experiment=(\S+)", block)
        jobs[(block.split(":")[0], wildcard.group(1) if wildcard else "")] = block
    return jobs


def test_paper_experiment_plans_all_four_stages_without_weights(plan):
    assert sorted(rule for rule, exp in plan if exp == "qwen7b") == ["evaluate", "merge", "quantize", "train"]


def test_cpu_training_asks_for_the_time_a_loaded_machine_needs(plan):
    runtime = int(re.search(r"runtime=(\d+)", plan[("train", "demo")]).group(1))
    assert runtime >= 60  # 41 min measured for the demo's 40 steps on a loaded 2-core machine


def test_gpu_sized_stages_refuse_a_machine_without_a_gpu_and_the_cpu_demo_does_not(plan):
    for stage in ("quantize", "train", "evaluate"):
        assert "--needs-gpu 7B" in plan[(stage, "qwen7b")].split("Shell command:")[1]
        assert "--needs-gpu" not in plan[(stage, "demo")]


def test_every_stage_gets_the_configs_mlflow_settings_and_the_layouts_paths(plan):
    lay = Layout("results")
    for stage in STAGES:
        cmd = plan[(stage, "qwen7b")].split("Shell command:")[1].split("\n")[0]
        words = shlex.split(cmd.split(">")[0])
        assert words[words.index("--results-dir") + 1] == "results"
        assert words[words.index("--mlflow-experiment") + 1] == "qerl"
        assert words[words.index("--run-file") + 1] == str(lay.run_file("qwen7b", stage))
        assert f"log: {log_file('qwen7b', stage)}" in plan[(stage, "qwen7b")]
    train = shlex.split(plan[("train", "qwen7b")].split("Shell command:")[1].split(">")[0])
    assert train[train.index("--checkpoint-dir") + 1] == str(lay.checkpoints("qwen7b"))
    assert train[train.index("--out") + 1] == str(lay.adapter("qwen7b"))


def test_the_run_ends_with_the_accuracies_on_the_console(tmp_path):
    from qerl.evaluation import benchmark_entry, pass_at_1_stats, write_eval_json
    from qerl.tables import main as tables_main

    summary = {**pass_at_1_stats([[True], [False], [True], [True]]), "mode": "greedy", "kind": "numeric",
               "template": "answer_line", "n_samples": 4, "mean_response_tokens": 3.0, "n_truncated": 0,
               "sampling": {"temperature": 0.0}}
    doc = {"experiment": "demo", "created": "2026-01-01T00:00:00+00:00", "model": {"path": "m"}, "engine": "torch",
           "mlflow_run_id": "r", "benchmarks": {"demo/trained/greedy": benchmark_entry(
               summary, benchmark="demo", variant="trained", model_path="m", per_problem_path="p", seconds=1.0)}}
    path = write_eval_json(doc, tmp_path / "demo" / "eval.json")
    proc = subprocess.run([sys.executable, "-m", "qerl.tables", "--summary", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if "demo/trained/greedy" in line)
    assert "75.0 [" in line and "4 x 1" in line
    assert str(path) in proc.stdout
    assert "print_new_results()" in (REPO / "Snakefile").read_text()  # called by the Snakefile's onsuccess
    assert tables_main(["--summary", str(tmp_path / "nope.json")]) == 2


def test_multi_gpu_training_runs_torchrun_and_asks_for_its_gpus(plan, tmp_path):
    """qwen7b with train.num_gpus 2: torchrun over 2 ranks of one node and 2 GPUs for the job; the CPU demo keeps
    the plain `python -m qerl.train` and no GPU. Host memory: two 7B bases for LoRA, one model's checkpoint state
    on rank 0 for mode full (qerl.memory.train_job_mem_mb)."""
    raw = _repo_raw()
    raw["experiments"]["qwen7b"]["train"] = {**raw["experiments"]["qwen7b"]["train"], "num_gpus": 2}
    raw["tokenizer_dir"] = str(REPO.parent / "shared" / "tokenizers" / "qwen2.5")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1", "--snakefile",
                           str(REPO / "Snakefile"), "--directory", str(tmp_path), "results/qwen7b/adapter",
                           "results/qwen7b-bf16-full/adapter"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = {b.split("wildcards: experiment=")[1].split()[0]: b for b in proc.stdout.split("\nrule ")[1:]
            if b.startswith("train:")}
    qwen = jobs["qwen7b"]
    words = shlex.split(qwen.split("Shell command:")[1].split(">")[0])
    assert words[1:8] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "qerl.train"]
    assert re.search(r"resources: .*\bgpu=2\b", qwen)
    assert re.search(r"resources: .*\bmem_mb=65536\b", qwen)  # LoRA: each of the 2 ranks reads its 32 GiB base
    assert re.search(r"resources: .*\bmem_mb=51767\b", jobs["qwen7b-bf16-full"])  # 3 x 14,525 + 2 x 4,096 MiB
    demo = plan[("train", "demo")]
    words = shlex.split(demo.split("Shell command:")[1].split(">")[0])
    assert words[1:4] == ["-m", "qerl.train", "--experiment"]
    assert re.search(r"resources: .*\bgpu=0\b", demo)


def _repo_raw() -> dict:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def test_memory_estimate_refuses_too_few_gpus_and_names_how_many():
    raw = _repo_raw()
    # the static torch engine keeps every row's KV cache: 1,024 rows of 4,608 tokens need 8 GPUs at 7B
    raw["experiments"]["qwen7b"]["train"] = {**raw["experiments"]["qwen7b"]["train"], "num_gpus": 2,
                                             "rollout": {"engine": "torch"}}
    with pytest.raises(QerlError, match=r"experiments\.qwen7b: train\.num_gpus: needs ~\d+ GiB per GPU with num_gpus "
                                        r"2 \(weights .*rollout .*GiB; qerl/memory.py\), more than an 80 GiB card: set "
                                        r"num_gpus: 8$"):
        parse_config(raw)


def test_full_training_is_sharded_over_its_gpus_by_the_estimate():
    """mode full on N ranks: weights, gradients and AdamW states / N (FSDP2) plus the whole model gathered for the
    rollouts; too few GPUs names how many fit, and 8-bit AdamW (whose states FSDP2 cannot shard) is refused."""
    from qerl.memory import SHAPES, rank_memory_gib

    raw = _repo_raw()
    train = parse_config(raw).experiments["qwen7b-bf16-full"].train
    assert (train.mode, train.num_gpus, train.optim) == ("full", 2, "adamw_torch")
    one, two = (rank_memory_gib(SHAPES["7B"], "bf16", train, n) for n in (1, 2))
    assert two["weights"] == pytest.approx(one["weights"] / 2) and one["gathered"] == 0
    assert two["gathered"] == pytest.approx(one["weights"] / 4)  # the bf16 weights alone: a quarter of w + g + 2 m
    raw["experiments"]["qwen7b-bf16-full"]["train"] = {**raw["experiments"]["qwen7b-bf16-full"]["train"],
                                                       "num_gpus": 1}
    with pytest.raises(QerlError, match=r"experiments\.qwen7b-bf16-full: train\.num_gpus: needs ~\d+ GiB per GPU "
                                        r"with num_gpus 1 .*: set num_gpus: 2$"):
        parse_config(raw)
    raw = _repo_raw()
    raw["experiments"]["qwen7b-bf16-full"]["train"] = {**raw["experiments"]["qwen7b-bf16-full"]["train"],
                                                       "optim": "adamw_8bit"}
    with pytest.raises(QerlError, match=r"mode full on 2 GPUs shards the optimizer states with FSDP2 .*: set optim: "
                                        r"adamw_torch"):
        parse_config(raw)


def test_the_paper_rows_fit_one_gpu_with_the_paged_engine():
    """The paged pool is released before the update, so a step's rollouts (GSM8K: 1,024 of up to 4,608 tokens;
    BigMath: 2,048 of up to 9,216) fit one 80 GB GPU up to 32B; a pool too small for one row is refused by name."""
    cfg = parse_config(_repo_raw())
    for name, rows in (("qwen7b", 1024), ("qwen14b-math-nvfp4-lora-aqn", 2048), ("qwen32b-math-nvfp4-lora-aqn", 2048)):
        train = cfg.experiments[name].train
        assert (train.rollout.engine, train.num_gpus, train.batch_size * train.num_generations) == ("paged", 1, rows)
    raw = _repo_raw()
    train = raw["experiments"]["qwen32b-math-bf16-lora"]["train"]
    raw["experiments"]["qwen32b-math-bf16-lora"]["train"] = {**train, "rollout": {
        **train["rollout"], "gpu_memory_utilization": 0.05}}
    with pytest.raises(QerlError, match=r"rollout.gpu_memory_utilization 0.05: a ~\d+\.\d GiB KV pool cannot hold one row"):
        parse_config(raw)


def test_rows_kept_out_of_experiments_really_do_not_fit():
    """config.yaml parks the paper rows that need more than one node under `_not_runnable_yet`; each one, put back
    under experiments, is refused by the estimate (move it back once it fits)."""
    raw = _repo_raw()
    parked = raw["_not_runnable_yet"]
    assert set(parked) == {"qwen32b-math-bf16-full"}  # 7B and 14B full fit 2 and 4 GPUs under FSDP2
    for name, exp in parked.items():
        with pytest.raises(QerlError, match=rf"experiments\.{re.escape(name)}: train\.num_gpus: needs"):
            parse_config({**raw, "experiments": {**raw["experiments"], name: exp}})


@pytest.mark.parametrize("train, message", [
    ({"batch_size": 6, "num_gpus": 4}, "num_gpus (4) must divide batch_size (6)"),
    ({"batch_size": 8, "micro_batch_size": 32, "num_gpus": 4}, "micro_batch_size must divide batch_size * "
                                                               "num_generations / num_gpus"),
    ({"num_gpus": 9}, "num_gpus: Input should be less than or equal to 8"),
    ({"num_gpus": 2, "rollout": {"engine": "vllm"}}, "num_gpus > 1 needs rollout.engine torch or paged"),
])
def test_num_gpus_must_split_the_step_into_whole_groups_and_micro_batches(train, message):
    with pytest.raises(QerlError) as err:
        parse_section("train", {"data": {"source": "x"}, **train})
    assert message in str(err.value)


def test_config_memory_has_a_header_and_says_where_each_experiment_runs(capsys):
    """`qerl.config memory`: a header naming the columns; the CPU demo's terms as host memory, no GPUs; the GPU
    rows' GPUs needed; the same CPU/GPU rule as the rules' `gpu` resource (qerl.memory.needs_gpu)."""
    from qerl.config import main
    from qerl.memory import needs_gpu

    main(["memory", str(REPO / "config" / "config.yaml")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["experiment", "runs", "on", "ranks"] and "GPUs needed" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["demo"][1] == "CPU" and rows["demo"][-2:] == ["(host", "memory)"]
    assert rows["qwen7b"][1] == "GPU" and rows["qwen7b"][-1] == "1"
    assert not needs_gpu("0.1B") and not needs_gpu(None) and needs_gpu("7B")


# The whole model in bf16, from the Qwen2.5 configs: 7B 7,615,283,200 parameters x 2 B = 14,525 MiB; 14B
# 14,769,192,960 x 2 B = 28,170 MiB. mode full on N > 1 ranks: rank 0's node holds 3 x the model (a checkpoint's
# weights and AdamW's two states, gathered on rank 0's host) + 4,096 MiB per rank; the LoRA modes a copy per rank.
FULL_7B, FULL_14B = 3 * 14525 + 4096, 3 * 28170 + 4096  # rank 0: 47,671 and 88,606 MiB


@pytest.mark.parametrize("mode, nodes, gpus, size, rank_mb, expected", [
    ("full", 1, 1, "7B", 32768, 32768),  # one rank: no FSDP, the one-rank job's figure
    ("full", 1, 2, "7B", 32768, FULL_7B + 4096),  # 51,767
    ("full", 1, 4, "7B", 32768, FULL_7B + 3 * 4096),  # 59,959
    ("full", 1, 2, "14B", 65536, FULL_14B + 4096),  # 92,702
    ("full", 1, 4, "14B", 65536, FULL_14B + 3 * 4096),  # 100,894
    ("full", 2, 4, "14B", 65536, FULL_14B + 3 * 4096),  # the other node holds 4 processes: rank 0's node is fuller
    ("full", 2, 1, "7B", 32768, FULL_7B),  # sharded over 2 nodes of 1: rank 0 gathers checkpoints all the same
    ("full", 1, 2, "70B", 32768, 3 * 16384 + 2 * 4096),  # unknown shape: the model counts as rank_mb / 2
    ("full", 1, 2, "0.1B", 6000, 12000),  # on the CPU every rank's state is host memory
    ("lora", 1, 4, "7B", 32768, 4 * 32768),
    ("lora", 2, 4, "7B", 32768, 4 * 32768),  # per node: that node's 4 ranks
    ("lora", 2, 1, "14B", 65536, 65536),
    ("qlora_fp4", 1, 2, "14B", 65536, 2 * 65536),
    ("qlora_nf4", 1, 4, "7B", 32768, 4 * 32768),
])
def test_train_job_memory_is_a_whole_model_where_the_code_loads_one(mode, nodes, gpus, size, rank_mb, expected):
    from qerl.memory import train_job_mem_mb

    train = parse_section("train", {"data": {"source": "x"}, "mode": mode, "dtype": "bfloat16", "num_gpus": gpus,
                                    "num_nodes": nodes})
    assert train_job_mem_mb(train, size, rank_mb) == expected


def test_full_training_asks_less_host_memory_than_lora_and_float32_more_than_bf16():
    """On 4 GPUs a LoRA job's every rank reads its base, a full one's rank 0 alone; float32 doubles the model."""
    from qerl.memory import train_job_mem_mb

    def mem(mode, dtype="bfloat16"):
        train = parse_section("train", {"data": {"source": "x"}, "mode": mode, "dtype": dtype, "num_gpus": 4})
        return train_job_mem_mb(train, "7B", 32768)

    assert (mem("lora"), mem("full")) == (131072, 59959)
    assert mem("full", "float32") == 3 * 29050 + 4096 + 3 * 4096
