"""qerl.launch without a cluster: the srun + torchrun command it builds inside a SLURM job (scontrol and sinfo
stand-ins on PATH), its one-line refusals (no rendezvous endpoint, a job holding fewer nodes than train.num_nodes,
a node count no partition has), and the train rule's multi-node job as Snakemake plans it."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qerl.errors import QerlError
from qerl.launch import PORT_BASE, launch_args, largest_partition, nodes_problem

REPO = Path(__file__).resolve().parents[1]
JOB = """JobId=4242 JobName=train
   NumNodes={nodes} NumCPUs={cpus} NumTasks={nodes} CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   NodeList={nodelist} BatchHost=gpu-a
   ReqTRES=cpu={cpus},mem=64G,node={nodes},billing={cpus}{gres}
   AllocTRES=cpu={cpus},mem=64G,node={nodes},billing={cpus}{gres}
"""


def _fake(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """slurm(nodes, cpus, gpus): `scontrol show job` / `show hostnames` of a running job 4242 on gpu-a, gpu-b..."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("QERL_RDZV_ENDPOINT", raising=False)

    def make(nodes: int, cpus: int, gpus: bool) -> dict:
        names = [f"gpu-{chr(ord('a') + i)}" for i in range(nodes)]
        job = JOB.format(nodes=nodes, cpus=cpus, nodelist=f"gpu-[{names[0][-1]}-{names[-1][-1]}]",
                         gres=",gres/gpu=8" if gpus else "")
        (tmp_path / "job.txt").write_text(job)
        (tmp_path / "hosts.txt").write_text("\n".join(names) + "\n")
        _fake(bin_dir, "scontrol", f'case "$1 $2" in\n  "show job") cat {tmp_path}/job.txt ;;\n'
                                   f'  "show hostnames") cat {tmp_path}/hosts.txt ;;\n  *) exit 1 ;;\nesac\n')
        return dict(os.environ, SLURM_JOB_ID="4242")

    return make


def test_a_slurm_job_starts_one_torchrun_per_node_meeting_on_the_first(slurm):
    env = slurm(nodes=2, cpus=32, gpus=True)
    cmd = launch_args(2, 4, env)
    srun, torchrun = cmd[:cmd.index(sys.executable)], cmd[cmd.index(sys.executable):]
    assert srun == ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--cpus-per-task=16",
                    "--kill-on-bad-exit=1"]
    assert torchrun == [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"gpu-a:{PORT_BASE + 4242}", "--rdzv-id",
                        "4242", "-m", "qerl.train"]
    # an endpoint named by the user wins; a CPU job may stack its 'nodes' on fewer hosts (a one-node test SLURM)
    assert launch_args(2, 1, {**slurm(nodes=1, cpus=2, gpus=False), "QERL_RDZV_ENDPOINT": "h:1"})[:9] == \
        ["srun", "--nodes", "1", "--ntasks", "2", "--ntasks-per-node", "2", "--cpus-per-task=1", "--kill-on-bad-exit=1"]


def test_a_job_holding_fewer_gpu_nodes_than_num_nodes_is_one_line(slurm):
    with pytest.raises(QerlError, match=r"^train.num_nodes is 2 but SLURM job 4242 holds 1 node\(s\) \(gpu-\[a-a\]\): "
                                        r"ask for 2 \(a profile's set-resources train: nodes wins over the rule\)$"):
        launch_args(2, 4, slurm(nodes=1, cpus=16, gpus=True))


def test_without_slurm_the_rendezvous_endpoint_must_be_named(monkeypatch):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "QERL_RDZV"))}
    with pytest.raises(QerlError, match=r"^train.num_nodes is 2 but there is no rendezvous endpoint: run under SLURM "
                                        r".* set QERL_RDZV_ENDPOINT=<first node>:<port> and start this command on "
                                        r"every node$"):
        launch_args(2, 2, env)
    assert launch_args(2, 2, {**env, "QERL_RDZV_ENDPOINT": "10.0.0.1:29400"})[1:] == [
        "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "qerl", "-m", "qerl.train"]
    # the CLI: the same line and exit code 2 as a stage, before anything starts
    proc = subprocess.run([sys.executable, "-m", "qerl.launch", "--nodes", "2", "--nproc-per-node", "1", "--",
                           "--experiment", "x"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        line for line in proc.stderr.splitlines() if line.startswith("error: train.num_nodes is 2 but there is no")]


def test_config_check_refuses_more_nodes_than_the_largest_partition(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "sinfo", "printf 'gpu-a gpu\\ngpu-b gpu\\ngpu-a debug\\ncpu-a cpu\\n'\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    largest_partition.cache_clear()
    try:
        assert largest_partition() == 2 and nodes_problem(2) is None
        assert nodes_problem(4) == "4 nodes, but the largest SLURM partition here has 2 (sinfo)"
        raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        raw["experiments"]["qwen7b"]["train"] = {**raw["experiments"]["qwen7b"]["train"], "num_nodes": 4}
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
        proc = subprocess.run([sys.executable, "-m", "qerl.config", "check", str(tmp_path / "config.yaml")],
                              capture_output=True, text=True, timeout=120, cwd=REPO,
                              env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
        assert proc.returncode == 1 and proc.stderr.strip() == (
            f"error: {tmp_path / 'config.yaml'}: experiments.qwen7b.train.num_nodes: 4 nodes, but the largest SLURM "
            "partition here has 2 (sinfo)")
    finally:
        largest_partition.cache_clear()


def test_several_nodes_ask_slurm_for_nodes_x_gpus_and_run_qerl_launch(tmp_path):
    """The train rule of num_nodes 2 x num_gpus 4: the SLURM executor's multi-node job (nodes, one task each, a GPU
    gres per node, mpi: the rule's command starts srun itself) and qerl.launch; one node keeps its resources."""
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw["experiments"]["qwen7b"]["train"] = {**raw["experiments"]["qwen7b"]["train"], "num_nodes": 2, "num_gpus": 4}
    raw["tokenizer_dir"] = str(REPO.parent / "shared" / "tokenizers" / "qwen2.5")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1", "--snakefile",
                           str(REPO / "Snakefile"), "--directory", str(tmp_path), "results/qwen7b/adapter",
                           "results/qwen3b-nvfp4-lora/adapter"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = {b.split("wildcards: experiment=")[1].split()[0]: b for b in proc.stdout.split("\nrule ")[1:]
            if b.startswith("train:")}
    words = shlex.split(jobs["qwen7b"].split("Shell command:")[1].split(">")[0])
    assert words[1:8] == ["-m", "qerl.launch", "--nodes", "2", "--nproc-per-node", "4", "--"]
    assert words[8] == "--experiment"
    resources = dict(re.findall(r"(\w+)=(\S+?),?(?=\s|$)", jobs["qwen7b"].split("resources: ")[1].splitlines()[0]))
    assert {k: resources.get(k) for k in ("nodes", "tasks", "tasks_per_gpu", "gres", "mpi", "gpu")} == \
        {"nodes": "2", "tasks": "2", "tasks_per_gpu": "0", "gres": "gpu:4", "mpi": "srun", "gpu": None}
    one = jobs["qwen3b-nvfp4-lora"].split("resources: ")[1].splitlines()[0]
    assert re.search(r"\bgpu=1\b", one) and not re.search(r"\b(nodes|tasks|gres|mpi)=", one)
