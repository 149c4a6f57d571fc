"""The shrunken pipeline on a real single-node SLURM (`bash .ci/slurm.sh start`), through Snakemake's executor.

Proves each stage ran as its own SLURM job (the executor's per-job SLURM log, and the job's final state from
sacct, or slurmctld's job-completion log, or squeue's history), that the train job ran data parallel over 2
processes (train.num_gpus 2: torchrun inside the job, gloo on a node without GPUs), that train.num_nodes 2 runs a
torchrun per 'node' under srun (two tasks standing for two nodes), and that a failed or killed job is retried per
profile until the workflow completes. Skipped where `sinfo` does not answer.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_pipeline import STAGES, tiny_config  # the shrunken demo config of the local e2e test

REPO = Path(__file__).resolve().parents[2]
PROFILE = Path(__file__).resolve().parent / "slurm_profile"
RESOURCE_RULES = ("tiny_model", "demo_task")


def _slurm_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
    return proc.returncode == 0 and bool({"idle", "mix", "alloc"} & set(proc.stdout.split()))


def _plugin_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("snakemake_executor_plugin_slurm") is not None


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not _slurm_up(), reason="no SLURM answering sinfo (run: bash .ci/slurm.sh start)"),
    pytest.mark.skipif(not _plugin_installed(), reason="snakemake-executor-plugin-slurm is not installed"),
]


def snakemake(workdir: Path, *args: str, snakefile: Path = REPO / "Snakefile", timeout: float = 900):
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--profile", str(PROFILE), *args]
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout)


def slurm_jobs(workdir: Path) -> dict[str, list[str]]:
    """rule -> SLURM job ids, from the log each job wrote: .snakemake/slurm_logs/rule_<rule>/<wc>/<jobid>.log."""
    jobs: dict[str, list[str]] = {}
    for log in sorted((workdir / ".snakemake" / "slurm_logs").rglob("*.log")):
        rule_dir = next(p for p in log.relative_to(workdir).parts if p.startswith("rule_"))
        jobs.setdefault(rule_dir.removeprefix("rule_"), []).append(log.stem)
    return jobs


def _jobcomp_path() -> Path | None:
    conf = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
    kind = re.search(r"^JobCompType\s*=\s*(\S+)", conf, re.M)
    loc = re.search(r"^JobCompLoc\s*=\s*(\S+)", conf, re.M)
    if kind and loc and kind.group(1) == "jobcomp/filetxt":
        return Path(loc.group(1))
    return None


def job_states(ids: list[str]) -> dict[str, str]:
    """Final SLURM state of each job, from whichever record this cluster keeps."""
    states: dict[str, str] = {}
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(ids)],
                          capture_output=True, text=True, timeout=30)
    if acct.returncode == 0:
        states.update(line.split("|")[:2] for line in acct.stdout.splitlines() if "|" in line)
    comp = _jobcomp_path()
    if comp is not None and comp.is_file():  # one line per finished job; the last one wins if ids restarted
        completed = dict(re.findall(r"^JobId=(\d+) .*?JobState=(\S+)", comp.read_text(), re.M))
        states.update({i: state for i, state in completed.items() if i not in states})
    missing = [i for i in ids if i not in states]
    if missing:
        queue = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i|%T", "-j", ",".join(missing)],
                               capture_output=True, text=True, timeout=30)
        states.update(line.split("|")[:2] for line in queue.stdout.splitlines() if "|" in line)
    return {i: states.get(i, "UNKNOWN").split()[0] for i in ids}


def wait_until(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def slurm_pipeline(tmp_path_factory, tokenizer_dir, data_dir):
    work = tmp_path_factory.mktemp("e2e_slurm")
    (work / "config").mkdir()
    cfg = tiny_config(tokenizer_dir, data_dir)
    cfg["experiments"]["tiny"]["train"]["num_gpus"] = 2  # one prompt group per rank
    (work / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.time()
    proc = snakemake(work)
    if proc.returncode != 0:
        logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted(work.rglob("*.log"))
                         if "mlartifacts" not in p.parts)
        pytest.fail(f"snakemake on SLURM failed:\n{proc.stderr[-4000:]}\n{logs[-12000:]}")
    print(f"tiny pipeline on SLURM: {time.time() - t0:.0f} s")
    return work, proc.stderr


def test_pipeline_outputs_exist(slurm_pipeline):
    work, _ = slurm_pipeline
    res = work / "results" / "tiny"
    assert (res / "quantized" / "config.json").is_file()
    assert (res / "adapter" / "adapter_config.json").is_file()
    assert (res / "merged" / "config.json").is_file()
    assert (res / "eval.json").stat().st_size > 0
    for stage in STAGES:
        assert (res / "runs" / f"{stage}.json").is_file(), stage


def test_every_stage_ran_as_a_completed_slurm_job(slurm_pipeline):
    work, log = slurm_pipeline
    jobs = slurm_jobs(work)
    assert set(jobs) == set(STAGES) | set(RESOURCE_RULES) | {"experiment_report"}, jobs
    ids = [i for rule in jobs.values() for i in rule]
    assert all(len(rule_ids) == 1 for rule_ids in jobs.values()), jobs  # no retry was needed
    states = job_states(ids)
    assert all(state == "COMPLETED" for state in states.values()), states
    for rule, (jobid,) in jobs.items():
        text = next((work / ".snakemake" / "slurm_logs").rglob(f"{jobid}.log")).read_text()
        assert re.search(rf"^rule {rule}:", text, re.M), (rule, text[-1500:])  # the job ran this rule
    # Nothing but the target rule ran on the submit host.
    assert set(re.findall(r"^localrule (\w+):", log, re.M)) <= {"all"}
    assert sorted(re.findall(r"submitted with SLURM jobid (\d+)", log)) == sorted(ids)


def test_the_train_job_ran_two_ranks_under_torchrun(slurm_pipeline):
    work, _ = slurm_pipeline
    (jobid,) = slurm_jobs(work)["train"]
    job_log = next((work / ".snakemake" / "slurm_logs").rglob(f"{jobid}.log")).read_text()
    assert "-m torch.distributed.run --standalone --nproc-per-node 2 -m qerl.train" in job_log, job_log[-2000:]
    train_log = (work / "logs" / "tiny" / "train.log").read_text()
    assert "data parallel over 2 ranks (torch.distributed backend gloo" in train_log, train_log[-2000:]
    assert train_log.count("step 3/3:") == 1  # rank 0 alone logs


def test_several_nodes_run_a_torchrun_each_under_srun(slurm_pipeline, tmp_path):
    """train.num_nodes 2 x num_gpus 1 on the single-node SLURM, in a copy of the pipeline's folder (only train
    reruns): the job asks for 2 tasks (nodes=1 set for this one-node cluster, where a job without GPUs may stack
    its 'nodes'), the rule runs qerl.launch, whose srun starts 2 torchruns with --nnodes 2 meeting in a c10d
    rendezvous on the job's first node, and they train as 2 ranks."""
    work = tmp_path / "work"
    shutil.copytree(slurm_pipeline[0], work, symlinks=True,
                    ignore=shutil.ignore_patterns("slurm_logs", "locks", "incomplete"))
    cfg = yaml.safe_load((work / "config" / "config.yaml").read_text())
    cfg["experiments"]["tiny"]["train"].update(num_nodes=2, num_gpus=1)
    (work / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(work, "results/tiny/adapter", "--forcerun", "train", "--set-resources", "train:nodes=1",
                     "train:mem_mb=2000", "train:runtime=15", "train:gpu=0")
    train_log = (work / "logs" / "tiny" / "train.log").read_text() if (work / "logs" / "tiny" / "train.log").is_file() \
        else ""
    assert proc.returncode == 0, proc.stderr[-4000:] + train_log[-4000:]
    jobs = slurm_jobs(work)
    assert set(jobs) == {"train"} and len(jobs["train"]) == 1, jobs
    (jobid,) = jobs["train"]
    assert job_states([jobid]) == {jobid: "COMPLETED"}
    job_log = next((work / ".snakemake" / "slurm_logs").rglob(f"{jobid}.log")).read_text()
    assert "-m qerl.launch --nodes 2 --nproc-per-node 1 -- --experiment tiny" in job_log, job_log[-2000:]
    launched = next(line for line in train_log.splitlines() if line.startswith("qerl.launch: "))
    assert launched.startswith("qerl.launch: srun --nodes 1 --ntasks 2 --ntasks-per-node 2 --cpus-per-task=1 "
                               "--kill-on-bad-exit=1 "), launched
    assert re.search(rf"-m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "
                     rf"\S+:{20000 + int(jobid) % 10000} --rdzv-id {jobid} -m qerl.train ", launched), launched
    assert "data parallel over 2 ranks (torch.distributed backend gloo" in train_log, train_log[-2000:]
    assert train_log.count("step 3/3:") == 1  # rank 0 alone logs


RETRY_SNAKEFILE = """
# A job that fails on its first attempt and one that is killed (scancel) on its first attempt.
rule all:
    input: "flaky.txt", "killed.txt"

rule flaky:
    output: "flaky.txt"
    log: "logs/flaky.log"
    resources: fail=lambda wildcards, attempt: int(attempt == 1), mem_mb=200, runtime=5
    shell: "echo job $SLURM_JOB_ID > {log}; test {resources.fail} = 0; echo $SLURM_JOB_ID > {output}"

rule killed:
    output: "killed.txt"
    log: "logs/killed.log"
    resources: nap=lambda wildcards, attempt: 600 if attempt == 1 else 1, mem_mb=200, runtime=15
    shell: "echo job $SLURM_JOB_ID > {log}; sleep {resources.nap}; echo $SLURM_JOB_ID > {output}"
"""


def _running_job_of(work: Path, rule: str) -> str | None:
    """Id of this test's RUNNING job of `rule` whose shell has started (its log exists)."""
    if not (work / "logs" / f"{rule}.log").is_file():
        return None
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i|%Z|%k"], capture_output=True, text=True,
                         timeout=20).stdout
    for line in out.splitlines():
        jobid, workdir, comment = line.split("|", 2)
        if Path(workdir).resolve() == work.resolve() and comment == f"rule_{rule}":
            return jobid
    return None


def test_failed_and_killed_jobs_are_retried_and_the_workflow_completes(tmp_path):
    (tmp_path / "Snakefile").write_text(RETRY_SNAKEFILE)
    t0 = time.time()
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", "Snakefile", "--profile", str(PROFILE)]
    with (tmp_path / "snakemake.log").open("w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            def first_killed_job():
                if proc.poll() is not None:
                    pytest.fail(f"snakemake exited early:\n{(tmp_path / 'snakemake.log').read_text()[-4000:]}")
                return _running_job_of(tmp_path, "killed")

            victim = wait_until(first_killed_job, 120, "the first `killed` job to run")
            subprocess.run(["scancel", victim], check=True, timeout=20)
            rc = proc.wait(timeout=170 - (time.time() - t0))
        finally:
            if proc.poll() is None:
                proc.kill()
    log = (tmp_path / "snakemake.log").read_text()
    assert rc == 0, log[-4000:]
    print(f"retry workflow on SLURM: {time.time() - t0:.0f} s")

    jobs = slurm_jobs(tmp_path)
    assert len(jobs["flaky"]) == 2 and len(jobs["killed"]) == 2, jobs
    states = job_states(jobs["flaky"] + jobs["killed"])
    first_flaky, second_flaky = sorted(jobs["flaky"], key=int)
    first_killed, second_killed = sorted(jobs["killed"], key=int)
    assert victim == first_killed
    assert states[first_flaky] == "FAILED" and states[first_killed] == "CANCELLED", states
    assert states[second_flaky] == "COMPLETED" and states[second_killed] == "COMPLETED", states
    # The outputs come from the retries, written inside their SLURM jobs.
    assert (tmp_path / "flaky.txt").read_text().strip() == second_flaky
    assert (tmp_path / "killed.txt").read_text().strip() == second_killed
