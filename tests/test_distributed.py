"""Data-parallel training (qerl.distributed) on CPU with gloo: 2 ranks under torchrun train the 1-rank adapter from
the same global batch and seed, write only from rank 0, resume under another rank count after a rank is killed,
and end within seconds when a rank dies or hangs; the collectives and the metric reduction on their own."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TOY_REWARDS = """\
import time


def slow_text_length(completions, **kw):
    time.sleep(0.3)  # a step long enough to kill a rank in the middle of the run
    return [len(c) / 10.0 for c in completions]
"""
EXACT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                 "completions/max_length", "completions/clipped_ratio", "rewards/correctness/mean",
                 "rewards/slow_text_length/mean", "rewards/grading_timeouts", "aqn/sigma")


def _train_config(task: Path, num_gpus: int, **overrides) -> dict:
    """4 prompts x 2 samples a step: each of 2 ranks holds 2 groups in 2 micro-batches (4 in the step)."""
    return {
        "mode": "qlora_fp4",
        "data": {"source": str(task / "train.jsonl"), "answer_kind": "numeric", "template": "answer_line",
                 "limit": 12},
        "rewards": ["correctness", "toy_rewards:slow_text_length"], "reward_weights": [1.0, 0.1],
        "num_generations": 2, "batch_size": 4, "micro_batch_size": 2, "max_steps": 3, "learning_rate": 5e-3,
        "max_prompt_length": 128, "max_completion_length": 5, "lora": {"lora_r": 4, "lora_alpha": 8},
        "aqn": {"sigma_start": 1e-2, "sigma_end": 1e-3, "num_stages": 3}, "dtype": "float32", "save_steps": 1,
        "rollout_correction": "tis", "num_gpus": num_gpus, **overrides,
    }


def _cmd(ranks: int, model: Path, out: Path, ckpt: Path, results: Path, cfg: dict) -> list[str]:
    launch = ["-m", "qerl.train"] if ranks == 1 else \
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "qerl.train"]
    return [sys.executable, *launch, "--experiment", "dp", "--model", str(model), "--out", str(out),
            "--checkpoint-dir", str(ckpt), "--config-json", json.dumps(cfg), "--results-dir", str(results),
            "--resume"]


def _env(task: Path, **extra) -> dict:
    path = os.pathsep.join(filter(None, [str(task), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, QERL_DIST_TIMEOUT_S="30", **extra)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from qerl.data import make_demo_task

    out = tmp_path_factory.mktemp("task")
    make_demo_task(out, seed=0)
    (out / "toy_rewards.py").write_text(TOY_REWARDS)
    return out


@pytest.fixture(scope="module")
def one_rank(nvfp4_dir, task, tmp_path_factory):
    """one_rank(**overrides): the output folder of the uninterrupted 1-rank run of that config (run once)."""
    done: dict[str, Path] = {}

    def run(**overrides) -> Path:
        key = json.dumps(overrides, sort_keys=True)
        if key not in done:
            root = tmp_path_factory.mktemp("one_rank")
            cfg = _train_config(task, 1, **overrides)
            proc = subprocess.run(_cmd(1, nvfp4_dir, root / "out", root / "ck", root / "res", cfg), env=_env(task),
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[key] = root / "out"
        return done[key]

    return run


def _history(out: Path) -> list[dict]:
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def _assert_same_adapter(a_dir: Path, b_dir: Path) -> None:
    """Equal up to float rounding: the ranks' gradients are summed in another order than one process accumulates
    them, and a rank pads its prompts to its own longest one (other matmul shapes). AdamW divides each gradient
    element by its own running RMS, so an element whose gradient is ~0 moves by a rounding-sized amount times
    the learning rate: elementwise tolerances do not hold, each tensor's relative distance does (measured up to
    3e-4). AdamW also hides a gradient scaled as a whole (per-rank token counts as the loss normaliser moved
    lora_B by 9e-4 only): the callers compare the gradient norms too (that bug doubled them)."""
    a, b = load_file(a_dir / "adapter_model.safetensors"), load_file(b_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a
    for k in a:
        assert float((b[k] - a[k]).norm()) <= 1e-3 * float(a[k].norm()), k
    assert any(v.abs().max() > 1e-3 for k, v in a.items() if "lora_B" in k), "training did not move the adapter"


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {},  # dapo: the loss divided by the step's completion tokens, every rank's
    {"loss_type": "grpo", "scale_rewards": "batch"},  # per-micro-batch means over every rank's micro-batches;
    # advantages scaled by the std of the whole step's rewards
    {"gradient_checkpointing": True},  # the GPU recipes' setting: auto shares each prompt in packed rows
])
def test_two_ranks_train_the_one_rank_adapter_and_only_rank_0_writes(nvfp4_dir, task, one_rank, tmp_path, overrides):
    cfg = _train_config(task, 2, **overrides)
    proc = subprocess.run(_cmd(2, nvfp4_dir, tmp_path / "out", tmp_path / "ck", tmp_path / "res", cfg),
                          env=_env(task), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_adapter(one_rank(**overrides), tmp_path / "out")
    one, two = _history(one_rank(**overrides)), _history(tmp_path / "out")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        # the same rollouts (row seeds by global row) and rewards gathered from every rank: bit-identical
        assert {k: b[k] for k in EXACT_METRICS} == {k: a[k] for k in EXACT_METRICS}
        # global token count and micro-batch count normalise the loss: the same gradient, so the same norm
        for k in ("grad_norm", "entropy", "clip_ratio/region_mean", "sampling/importance_sampling_ratio/mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    # rank 0 alone logged and wrote: one progress line per step, one MLflow run, one checkpoint folder
    assert proc.stdout.count("trained 3 steps") == 1
    assert proc.stderr.count("step 3/3:") == 1
    assert len([p for p in (tmp_path / "ck").iterdir() if p.is_dir()]) == 1
    from mlflow.tracking import MlflowClient

    run_file = json.loads((tmp_path / "res" / "dp" / "runs" / "train.json").read_text())
    client = MlflowClient(run_file["tracking_uri"])
    runs = client.search_runs([run_file["experiment_id"]])
    assert len(runs) == 1 and sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "reward")) \
        == [1, 2, 3]


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the worker torchrun started for `rank` (its child with RANK=<rank> in the environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _assert_one_rank_resumes(nvfp4_dir, task, one_rank, tmp_path, ck) -> None:
    """--resume as one process from a killed run's checkpoints completes and equals the uninterrupted run."""
    resumed = subprocess.run(_cmd(1, nvfp4_dir, tmp_path / "out", ck, tmp_path / "res", _train_config(task, 1)),
                             env=_env(task), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    _assert_same_adapter(one_rank(), tmp_path / "out")


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_and_one_rank_resumes_it(nvfp4_dir, task, one_rank, tmp_path):
    """kill -9 of rank 1 mid-run: torchrun ends the job within seconds naming rank 1; --resume under num_gpus 1
    (another rank count, the same checkpoint folder) completes and equals the uninterrupted run."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen(_cmd(2, nvfp4_dir, tmp_path / "out", ck, tmp_path / "res", _train_config(task, 2)),
                            env=_env(task), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 200
    while not list(ck.glob("*/step-000001")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    pid = _rank_pid(proc.pid, 1)
    assert proc.poll() is None and pid is not None, "training finished before a rank could be killed"
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.time() - t0 < 30
    assert f"failed (exitcode: -9) local_rank: 1 (pid: {pid})" in output
    assert not (tmp_path / "out").exists()

    _assert_one_rank_resumes(nvfp4_dir, task, one_rank, tmp_path, ck)
    assert [h["reward"] for h in _history(tmp_path / "out")] == [h["reward"] for h in _history(one_rank())]


def _nodes(model: Path, out: Path, ckpt: Path, results: Path, cfg: dict, port: int) -> list[list[str]]:
    """Each 'node' of 2: qerl.launch, as on a node outside SLURM (a torchrun with --nnodes 2 and 2 ranks, meeting the
    other in a c10d rendezvous on 127.0.0.1; ranks are numbered by the rendezvous, so node ranks are not given)."""
    train = _cmd(1, model, out, ckpt, results, cfg)[3:]
    return [[sys.executable, "-m", "qerl.launch", "--nodes", "2", "--nproc-per-node", "2", "--", *train]] * 2


def _node_env(task: Path, port: int) -> dict:
    env = _env(task, QERL_RDZV_ENDPOINT=f"127.0.0.1:{port}")
    return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    return found


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until the first node's torchrun hosts the rendezvous store, so the second is never its host."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError("the first node's rendezvous store never listened")


@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_the_one_rank_adapter(nvfp4_dir, task, one_rank, tmp_path):
    """2 nodes x 2 ranks (two torchruns, --nnodes 2, c10d rendezvous) train what one process trains."""
    port = _free_port()
    cfg = _train_config(task, 2, num_nodes=2)
    procs = [subprocess.Popen(cmd, env=_node_env(task, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for cmd in _nodes(nvfp4_dir, tmp_path / "out", tmp_path / "ck", tmp_path / "res", cfg, port)]
    done = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in done]
    assert all("--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d" in err for _, err in done)
    _assert_same_adapter(one_rank(), tmp_path / "out")
    one, four = _history(one_rank()), _history(tmp_path / "out")
    assert len(four) == 3
    for a, b in zip(one, four):
        assert {k: b[k] for k in EXACT_METRICS} == {k: a[k] for k in EXACT_METRICS}
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert "".join(err for _, err in done).count("data parallel over 4 ranks") == 1  # rank 0 alone logs


@pytest.mark.slow
def test_a_killed_node_ends_the_job_in_one_line_and_one_rank_resumes_it(nvfp4_dir, task, one_rank, tmp_path):
    """kill -9 of a whole node (its torchrun and both its ranks) mid-run: the other node's ranks stop within seconds
    with one error line; --resume as one process completes and equals the uninterrupted run."""
    port, ck = _free_port(), tmp_path / "ck"
    first, second = _nodes(nvfp4_dir, tmp_path / "out", ck, tmp_path / "res", _train_config(task, 2, num_nodes=2),
                           port)
    survivor = subprocess.Popen(first, env=_node_env(task, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    _wait_listening(port, survivor)
    victim = subprocess.Popen(second, env=_node_env(task, port), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 200
    while not list(ck.glob("*/step-000001")) and survivor.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert survivor.poll() is None and victim.poll() is None, "training finished before a node could be killed"
    for pid in [victim.pid, *_descendants(victim.pid)]:  # torchrun starts its workers in sessions of their own
        os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    output, _ = survivor.communicate(timeout=120)
    victim.wait(timeout=10)
    assert survivor.returncode != 0 and time.time() - t0 < 30, (time.time() - t0, output[-3000:])
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors and all(re.match(r"error: rank \d of 4: .* failed \(.*\): another rank died or hung", e)
                          for e in errors), output[-3000:]
    assert not (tmp_path / "out").exists()

    _assert_one_rank_resumes(nvfp4_dir, task, one_rank, tmp_path, ck)


# ------------------------------------------------------------------ the collectives, without a model
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(script: str, world: int = 2, timeout: float = 120, **env) -> list[subprocess.CompletedProcess]:
    """`script` in `world` processes joined as torchrun would join them (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    base = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                OMP_NUM_THREADS="1", **env)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


COLLECTIVES = """
import json, torch
from qerl.distributed import close, init_ranks
ranks = init_ranks(2)
r = ranks.rank
metrics = ranks.reduce_metrics({"mean": r + 1.0, "timing": 10.0 * r, "count": 3.0 + r},
                               sums=("count",), maxima=("timing",))
gathered = ranks.all_gather(torch.tensor([[r, 10 * r]])).tolist()
p = torch.nn.Parameter(torch.full((3,), float(r)))
q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
p.grad = torch.full((3,), r + 1.0)  # q has no gradient on either rank: zeros, not an error
ranks.all_reduce_grads([p, q])
ranks.broadcast_params([p])
share = ranks.share(8)
print(json.dumps({"metrics": metrics, "gathered": gathered, "grad": p.grad.tolist(), "q": q.grad.tolist(),
                  "param": p.tolist(), "share": [share.start, share.stop]}))
close(ranks)
"""


def test_collectives_reduce_metrics_gradients_and_rows():
    results = _run_ranks(COLLECTIVES)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    got = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    for rank, g in enumerate(got):
        assert g["metrics"] == {"mean": 1.5, "timing": 10.0, "count": 7.0}
        assert g["gathered"] == [[0, 0], [1, 10]]
        assert g["grad"] == [3.0] * 3 and g["q"] == [0.0, 0.0]
        assert g["param"] == [0.0] * 3  # rank 0's values everywhere
        assert g["share"] == [4 * rank, 4 * rank + 4]


HUNG = """
import time
from qerl.distributed import init_ranks
from qerl.stage import run_main

def main(argv):
    ranks = init_ranks(2)
    if ranks.rank == 1:
        time.sleep(8)  # alive, never joins the collective
        return
    t0 = time.time()
    try:
        ranks.reduce_metrics({"x": 1.0})
    finally:
        print(f"waited {time.time() - t0:.1f}", flush=True)

run_main(main)
"""


def test_a_hung_rank_ends_the_others_with_one_line_within_the_timeout():
    rank0 = _run_ranks(HUNG, QERL_DIST_TIMEOUT_S="3")[0]
    assert rank0.returncode == 2, rank0.stderr[-2000:]
    line = rank0.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 0 of 2: all_reduce (sum) failed") and "QERL_DIST_TIMEOUT_S" in line, line
    assert 2.5 < float(rank0.stdout.split("waited ")[1]) < 7  # the timeout, not rank 1's exit after 8 s


def test_num_gpus_must_match_the_launch(monkeypatch):
    from qerl.distributed import init_ranks
    from qerl.errors import QerlError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(QerlError, match=r"train.num_gpus is 2 but this process was launched as one of 1 rank\(s\): "
                                        r"run torchrun --standalone --nproc-per-node 2 -m qerl.train"):
        init_ranks(2)
    assert init_ranks(1).world_size == 1


def test_a_rank_samples_its_rows_as_one_process_does(nvfp4_dir):
    """Row seeds by global row index (SamplingParams.first_row): rank 1's half of a step equals those rows of
    the whole step generated at once."""
    from dataclasses import replace

    from qerl.config import parse_section
    from qerl.rollout import SamplingParams, make_engine
    from qerl.train import _setup_model

    model, tok = _setup_model(parse_section("train", {"data": {"source": "unused"}, "dtype": "float32"}),
                              str(nvfp4_dir))
    engine = make_engine("torch", model, tok)
    prompts = [tok.encode(f"{a} + {a} =") for a in (11, 23, 35, 47)]
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=123)
    whole = engine.generate(prompts, n=2, sampling=sampling)
    half = engine.generate(prompts[2:], n=2, sampling=replace(sampling, first_row=4))
    assert half.completion_ids == whole.completion_ids[4:]
    shifted = engine.generate(prompts[2:], n=2, sampling=sampling)  # rows numbered from 0: other draws
    assert shifted.completion_ids != whole.completion_ids[4:]
