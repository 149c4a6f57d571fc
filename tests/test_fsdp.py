"""train.mode full under FSDP2 (qerl.fsdp) on CPU with gloo: the sharded update equals one process's (gradient
sums, clipping norm, AdamW), the gathered rollout copy holds the whole weights, checkpoints gather to the one-rank
format and load back into shards; the train stage on 2 ranks equals 1 rank, and a checkpoint resumes under the
other rank count, both ways."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from safetensors.torch import load_file

from test_distributed import _cmd, _env, _history, _run_ranks

SHARDED_STEP = """
import json, torch
from qerl.distributed import close, init_ranks
from qerl.fsdp import FullySharded, decoder_layers
from qerl.grpo import token_logprobs
from qerl.resources import tiny_qwen2_config
from transformers import Qwen2ForCausalLM

ranks = init_ranks(2)
torch.manual_seed(0)
model = Qwen2ForCausalLM(tiny_qwen2_config(256)).float()
ref = Qwen2ForCausalLM(tiny_qwen2_config(256)).float()
ref.load_state_dict(model.state_dict())
for m in (model, ref):  # each layer's forward recomputed in backward, through FSDP's hooks
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)

def loss_of(m, rows):  # the trainer's normalisation: a sum over rows of the whole batch's mean
    lp, _ = token_logprobs(m, ids[rows], mask[rows], 6, chunk_size=5)
    return -lp.sum() / 24

# one process: the whole batch in two micro-batches, clipped, one AdamW step
opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
for rows in (slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)):
    loss_of(ref, rows).backward()
ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
opt.step()

# two ranks: half the batch each, the same two micro-batches per rank
par = FullySharded(model, ranks)
assert len(decoder_layers(model)) == 2
sharded_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **par.optimizer_options())
mine = (slice(0, 1), slice(1, 2)) if ranks.rank == 0 else (slice(2, 3), slice(3, 4))
for rows in mine:
    par.run(lambda r: (loss_of(model, r),), rows)[0].backward()
norm = par.reduce_and_clip(list(model.parameters()), 0.5)
sharded_opt.step()
with par.gathered() as plain:
    dist = max(float((p - q).abs().max()) for p, q in zip(plain.parameters(), ref.parameters()))
    tied = plain.lm_head.weight is plain.model.embed_tokens.weight
    sizes = sum(p.untyped_storage().nbytes() for p in plain.parameters())
freed = sum(p.untyped_storage().nbytes() for p in par.rollout_model.parameters())
gathered = par.checkpoint_state(sharded_opt)
saved = None
if gathered is not None:
    tensors, optim = gathered
    ref_optim = opt.state_dict()
    saved = {"names": sorted(tensors) == sorted(n for n, _ in ref.named_parameters()),
             "weights": max(float((tensors[n] - p).abs().max()) for n, p in ref.named_parameters()),
             "moments": max(float((optim["state"][i]["exp_avg"] - ref_optim["state"][i]["exp_avg"]).abs().max())
                            for i in ref_optim["state"])}
# load back: zeros in the shards first, then rank 0's full tensors
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
par.restore(*(gathered or ({}, {"state": {}, "param_groups": opt.state_dict()["param_groups"]})), sharded_opt)
with par.gathered() as plain:
    reloaded = max(float((p - q).abs().max()) for p, q in zip(plain.parameters(), ref.parameters()))
print(json.dumps({"norm": norm, "ref_norm": ref_norm, "dist": dist, "tied": tied, "sizes": sizes, "freed": freed,
                  "saved": saved, "reloaded": reloaded}))
close(ranks)
"""


def test_sharded_update_equals_one_process_and_checkpoints_round_trip():
    results = _run_ranks(SHARDED_STEP, timeout=240)
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    got = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    for rank, g in enumerate(got):
        # the whole gradient's norm (shards summed over ranks), clipped and stepped as one process does
        assert g["norm"] == pytest.approx(g["ref_norm"], rel=1e-5)
        # AdamW's first step moves an element by lr * g / (|g| + eps): where |g| is near eps, by a rounding-dependent
        # part of lr (1e-2); the restored shards are exactly what was gathered
        assert g["dist"] < 1e-4 and g["reloaded"] == g["dist"]
        assert g["tied"] and g["sizes"] > 0 and g["freed"] == 0  # gathered while inside, freed after
        if rank == 0:
            assert g["saved"]["names"] and g["saved"]["weights"] == g["dist"] and g["saved"]["moments"] < 1e-8
        else:
            assert g["saved"] is None  # rank 0 alone holds the gathered state


# ------------------------------------------------------------------ the train stage, 1 and 2 ranks
TOY_REWARD = "def text_length(completions, **kw):\n    return [len(c) / 10.0 for c in completions]\n"


def _full_config(task, num_gpus: int) -> dict:
    """4 prompts x 2 samples a step of the tiny dense model, every weight trained: each of 2 ranks holds 2 groups
    in 2 micro-batches; AQN on (noise goes into the gathered copy); gradient checkpointing on, as the GPU recipes
    run it (train.padding_free auto: each group's prompt once, in packed rows)."""
    return {
        "mode": "full",
        "data": {"source": str(task / "train.jsonl"), "answer_kind": "numeric", "template": "answer_line",
                 "limit": 12},
        "rewards": ["correctness", "toy_rewards:text_length"], "reward_weights": [1.0, 0.1],
        "num_generations": 2, "batch_size": 4, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3,
        "max_prompt_length": 128, "max_completion_length": 5, "dtype": "float32", "save_steps": 1,
        "aqn": {"sigma_start": 1e-2, "sigma_end": 1e-3, "num_stages": 2}, "rollout_correction": "tis",
        "gradient_checkpointing": True, "num_gpus": num_gpus,
    }


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from qerl.data import make_demo_task

    out = tmp_path_factory.mktemp("full_task")
    make_demo_task(out, seed=0)
    (out / "toy_rewards.py").write_text(TOY_REWARD)
    return out


def _train(ranks: int, model, task, root, timeout: float = 400) -> subprocess.CompletedProcess:
    cfg = _full_config(task, ranks)
    proc = subprocess.run(_cmd(ranks, model, root / "out", root / "ck", root / "res", cfg), env=_env(task),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def runs(tiny_model_dir, task, tmp_path_factory):
    """The uninterrupted 1-rank and 2-rank runs (their outputs and checkpoint folders)."""
    root = tmp_path_factory.mktemp("full")
    procs = {n: _train(n, tiny_model_dir, task, root / str(n)) for n in (1, 2)}
    return root, procs


def _assert_same_model(a_dir, b_dir) -> None:
    """Equal up to float rounding, per tensor (as tests/test_distributed.py's adapters: gradient sums in another
    order, and AdamW dividing each element by its own RMS turns rounding in ~0 gradients, the biases' here, into
    lr-sized moves; measured <= 8e-4 relative)."""
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys() and a
    for k in a:
        assert float((b[k] - a[k]).norm()) <= 1e-3 * float(a[k].norm()), k


def _assert_same_history(a_dir, b_dir) -> None:
    one, two = _history(a_dir), _history(b_dir)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert (b["reward"], b["completions/mean_length"]) == (a["reward"], a["completions/mean_length"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)


@pytest.mark.slow
def test_full_mode_on_two_ranks_trains_the_one_rank_model(runs, tiny_model_dir):
    root, procs = runs
    one, two = root / "1" / "out", root / "2" / "out"
    _assert_same_model(one, two)
    _assert_same_history(one, two)
    moved = load_file(two / "model.safetensors")["model.norm.weight"] - \
        load_file(tiny_model_dir / "model.safetensors")["model.norm.weight"]
    assert float(moved.abs().max()) > 1e-4, "training did not move the weights"
    # rank 0 wrote a plain model (not the FSDP class), once; one checkpoint folder
    assert json.loads((two / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert procs[2].stdout.count("trained 2 steps") == 1
    assert len([p for p in (root / "2" / "ck").iterdir() if p.is_dir()]) == 1


@pytest.mark.slow
def test_a_checkpoint_resumes_under_the_other_rank_count(runs, tiny_model_dir, task):
    """The 2-rank run's step-1 checkpoint (gathered from shards) resumes on 1 rank, and the 1-rank run's on 2
    ranks (loaded into shards); each finishes as the uninterrupted runs did."""
    root, _ = runs
    for written, resumed in ((2, 1), (1, 2)):
        work = root / f"resume_{written}_on_{resumed}"
        shutil.copytree(root / str(written) / "ck", work / "ck")
        for last in (work / "ck").glob("*/step-000002"):
            shutil.rmtree(last)
        proc = _train(resumed, tiny_model_dir, task, work)
        assert "resumed from" in proc.stderr and "step-000001" in proc.stderr
        _assert_same_model(root / "1" / "out", work / "out")
        _assert_same_history(root / "1" / "out", work / "out")
