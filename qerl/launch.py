"""One experiment over several nodes: a torchrun per node, met by torchrun's c10d rendezvous on the first node.

    python -m qerl.launch --nodes 2 --nproc-per-node 4 -- --experiment qwen14b ... # what the train rule runs

Inside a SLURM job (the slurm profile submits train.num_nodes nodes, one task each, and runs the rule's command on
the first node) this becomes

    srun --nodes N --ntasks N --ntasks-per-node 1 --cpus-per-task=<the job's per node> --kill-on-bad-exit=1 \
        python -m torch.distributed.run --nnodes N --nproc-per-node G --rdzv-backend c10d \
        --rdzv-endpoint <first node>:<20000 + job id % 10000> --rdzv-id <job id> -m qerl.train <the arguments after -->

so torchrun owns the rendezvous, the rank numbering and the failure of a node (its agent ends the local ranks when
one exits; srun ends the other nodes' tasks; SLURM ends a job whose node fails), and Snakemake's retries resubmit
the job, which resumes from its last checkpoint. Outside SLURM, QERL_RDZV_ENDPOINT=<host>:<port> names the
rendezvous and this command is started once on every node (by hand); without it the launch stops in one line.
Only the arguments are built here: nothing of torch is imported, and the process becomes srun or torchrun (exec).
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys

from qerl.errors import QerlError

ENDPOINT_ENV = "QERL_RDZV_ENDPOINT"
PORT_BASE, PORT_SPAN = 20000, 10000  # a job's port: below Linux's ephemeral range, apart for neighbouring job ids


def _scontrol(*args: str) -> str:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise QerlError(f"scontrol {' '.join(args)} failed: {(proc.stderr.strip() or 'no output')[:200]}")
    return proc.stdout


def slurm_job(job_id: str) -> tuple[int, int, str, bool]:
    """A running job's node and CPU counts, node list and whether it holds GPUs (`scontrol show job`; the job
    step's own SLURM_* variables are not there: Snakemake's job step strips them before running the rule)."""
    text = _scontrol("show", "job", job_id)
    found = [re.search(rf"\b{key}=(\S+)", text) for key in ("NumNodes", "NumCPUs", "NodeList")]
    if not all(found):
        raise QerlError(f"scontrol show job {job_id}: no NumNodes/NumCPUs/NodeList (is the job still running?)")
    nodes, cpus, nodelist = (m.group(1) for m in found)
    tres = " ".join(re.findall(r"\b(?:Alloc)?TRES=(\S+)", text))
    return int(nodes.split("-")[0]), int(cpus.split("-")[0]), nodelist, "gres/gpu" in tres


def torchrun_args(nodes: int, nproc: int, endpoint: str, rdzv_id: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "-m", "qerl.train"]


def launch_args(nodes: int, nproc: int, env=os.environ) -> list[str]:
    """The command that starts this node's torchrun (outside SLURM) or every node's (srun inside a SLURM job)."""
    endpoint = env.get(ENDPOINT_ENV)
    job_id = env.get("SLURM_JOB_ID")
    if job_id is None:
        if not endpoint:
            raise QerlError(f"train.num_nodes is {nodes} but there is no rendezvous endpoint: run under SLURM (the "
                            f"slurm profile starts a torchrun per node) or set {ENDPOINT_ENV}=<first node>:<port> and "
                            "start this command on every node")
        return torchrun_args(nodes, nproc, endpoint, "qerl")
    held, cpus, nodelist, gpus = slurm_job(job_id)
    if held < nodes and (gpus or nodes % held):
        raise QerlError(f"train.num_nodes is {nodes} but SLURM job {job_id} holds {held} node(s) ({nodelist}): ask "
                        f"for {nodes} (a profile's set-resources train: nodes wins over the rule)")
    # fewer nodes than torchruns only without GPUs: several 'nodes' per host, as on a single-node test cluster
    first = _scontrol("show", "hostnames", nodelist).split()[0]
    endpoint = endpoint or f"{first}:{PORT_BASE + int(job_id) % PORT_SPAN}"
    # Snakemake's job step cleared SLURM_CPUS_*: without --cpus-per-task each torchrun would get one core
    srun = ["srun", "--nodes", str(min(held, nodes)), "--ntasks", str(nodes), "--ntasks-per-node",
            str(nodes // min(held, nodes)), f"--cpus-per-task={max(1, cpus // nodes)}", "--kill-on-bad-exit=1"]
    return srun + torchrun_args(nodes, nproc, endpoint, job_id)


@functools.lru_cache(maxsize=None)
def largest_partition() -> int | None:
    """The node count of this cluster's largest SLURM partition (`sinfo`), or None where there is no SLURM."""
    if not shutil.which("sinfo"):
        return None
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %R"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None
    nodes: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        if len(line.split()) == 2:
            node, partition = line.split()
            nodes.setdefault(partition, set()).add(node)
    return max((len(v) for v in nodes.values()), default=None)


def nodes_problem(num_nodes: int) -> str | None:
    """Why this cluster cannot give train.num_nodes nodes to one job, or None (`qerl.config check`)."""
    largest = largest_partition() if num_nodes > 1 else None
    if largest is not None and num_nodes > largest:
        return f"{num_nodes} nodes, but the largest SLURM partition here has {largest} (sinfo)"
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qerl.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True, help="train.num_nodes")
    p.add_argument("--nproc-per-node", type=int, required=True, help="train.num_gpus")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of python -m qerl.train")
    a = p.parse_args(argv)
    rest = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    try:
        cmd = launch_args(a.nodes, a.nproc_per_node) + rest
    except QerlError as err:
        sys.stderr.write(f"error: {err}\n")
        sys.exit(2)
    sys.stderr.write(f"qerl.launch: {shlex.join(cmd)}\n")  # the log shows what ran on the nodes
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
