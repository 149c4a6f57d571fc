"""train.mode full on several ranks loads as it scales (qerl.fsdp, qerl.train): rank 0 alone reads the checkpoint,
the other ranks build the model on the meta device and receive their shards, so their peak host memory holds no
whole model; every rank then holds the 1-process weights and buffers, takes rank 0's forward swaps, and trains
its first update as one process does (CPU, gloo)."""
from __future__ import annotations

import json

import pytest

from test_distributed import _run_ranks

LOAD = """
import json, os, resource, torch
import transformers.modeling_utils as mu

opened = []  # the safetensors files this process opened to read tensors (headers are read without safe_open)
_safe_open = mu.safe_open
def counted(path, *args, **kwargs):
    opened.append(str(path))
    return _safe_open(path, *args, **kwargs)
mu.safe_open = counted

from qerl.config import parse_section
from qerl.distributed import close, init_ranks
from qerl.fsdp import data_parallel, fuse_as_rank0
from qerl.fused_elementwise import fused_names
from qerl.grpo import token_logprobs
from qerl.tiled_mlp import tile_mlps
from qerl.train import _setup_model

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux

model_dir, world = os.environ["QERL_TEST_MODEL"], int(os.environ["WORLD_SIZE"])
ranks = init_ranks(world)
cfg = parse_section("train", {"data": {"source": "unused"}, "mode": "full", "dtype": "float32", "num_gpus": world,
                              "gradient_checkpointing": True})
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(model_dir)  # its transient peak (~250 MB) before the baseline: the model's alone after
ranks.barrier()
before = peak_mb()
model, tok = _setup_model(cfg, model_dir, ranks)
fuse_as_rank0(model, cfg, ranks)  # the trainer's order: forward swaps, tiles, then sharding
tile_mlps(model, 2)
par = data_parallel(model, cfg, ranks)
load_mb = peak_mb() - before
fused = fused_names(model)
buffers = {n: b.tolist() for n, b in model.named_buffers()}

# one update: each rank its share of the rows, clipped and stepped as the trainer does
ids = torch.randint(0, 1000, (4, 12), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)
def loss_of(m, rows):
    lp, _ = token_logprobs(m, ids[rows], mask[rows], 6, chunk_size=5)
    return -lp.sum() / 24
rows = ranks.share(4)
with par.gathered() as plain:
    loaded = {n: p.detach().clone() for n, p in plain.named_parameters()} if ranks.is_main else None
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **par.optimizer_options())
loss = par.run(lambda: (loss_of(model, rows),))[0]
loss.backward()
norm = par.reduce_and_clip(list(model.parameters()), 1.0)
opt.step()
total = float(ranks.all_reduce(loss.detach(), "sum"))
with par.gathered() as plain:
    stepped = {n: p.detach().clone() for n, p in plain.named_parameters()} if ranks.is_main else None
out = {"rank": ranks.rank, "load_mb": load_mb, "opened": opened, "fused": fused, "buffers": buffers,
       "norm": norm, "loss": total}
if ranks.is_main:  # the 1-process run: the same checkpoint, the whole batch
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tile_mlps(ref, 2)
    out["same_names"] = sorted(loaded) == sorted(n for n, _ in ref.named_parameters())
    out["load_exact"] = all(torch.equal(loaded[n], p) for n, p in ref.named_parameters())
    out["ref_buffers"] = {n: b.tolist() for n, b in ref.named_buffers()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_loss = 0.0
    for r in range(world):  # the ranks' micro-batches, accumulated
        part = loss_of(ref, slice(r * 4 // world, (r + 1) * 4 // world))
        part.backward()
        ref_loss += float(part)
    out["ref_norm"] = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    ref_opt.step()
    out["ref_loss"] = ref_loss
    out["step_dist"] = max(float((stepped[n] - p).abs().max()) for n, p in ref.named_parameters())
print(json.dumps(out))
close(ranks)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """A random Qwen2-shaped model of ~180 MB in float32, in tensors of <= 4 MB (the broadcast sends one at a time);
    a vocabulary of 1024 rows (the real tokenizer beside it only has to load)."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from qerl.resources import tiny_qwen2_config

    out = tmp_path_factory.mktemp("load_model")
    torch.manual_seed(0)
    config = tiny_qwen2_config(1024, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                               num_attention_heads=8, num_key_value_heads=4)
    Qwen2ForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)
    return out


def _model_mb(path) -> float:
    return (path / "model.safetensors").stat().st_size / 2**20


@pytest.mark.parametrize("world", [2, 4])
def test_rank_0_alone_reads_and_every_rank_gets_the_one_process_model(model_dir, world):
    results = _run_ranks(LOAD, world=world, timeout=300, QERL_TEST_MODEL=str(model_dir))
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    got = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    main, size = got[0], _model_mb(model_dir)
    assert main["opened"] and main["same_names"] and main["load_exact"]  # bit-exact after the load
    # peak RSS growth: every rank other than 0 holds its shard (1/world) and one tensor in flight, never a whole
    # model. Only an upper bound: the peak is the process's lifetime peak, which the imports may already exceed on
    # some machines (growth 0), so that rank 0's read is checked by the files it opened, not by its memory
    print(f"peak RSS growth MB by rank {[round(g['load_mb']) for g in got]}, model {size:.0f} MB")
    for g in got[1:]:
        assert g["opened"] == []  # no other rank read a weight
        assert g["load_mb"] < size / world + 0.25 * size, (g["load_mb"], size)
    for g in got:
        assert g["buffers"] == main["ref_buffers"]  # rotary frequencies: rank 0's on every rank
        assert g["fused"] == main["fused"] and main["fused"]  # rank 0's probe decided for every rank
        assert g["loss"] == pytest.approx(main["ref_loss"], rel=1e-6)
        # the sharded norm's own rounding: 1.1e-5 relative here, the same when every rank loads the whole model
        assert g["norm"] == pytest.approx(main["ref_norm"], rel=1e-4)
    # AdamW's first step moves an element by lr * g / (|g| + eps): where |g| is near eps, by part of lr (1e-3)
    assert main["step_dist"] < 1e-4


def test_an_empty_model_is_the_checkpoints_model_on_meta_and_takes_rank_0s_swaps(tiny_model_dir):
    """load_policy(empty=True): every tensor on the meta device, the config and generation config of the loaded
    model; fuse_elementwise(names=...) swaps those modules without probing (a probe could not read a weight)."""
    import torch

    from qerl.fused_elementwise import fuse_elementwise, fused_names
    from qerl.errors import QerlError
    from qerl.policy import LoraSpec, load_policy

    loaded, _ = load_policy(tiny_model_dir, mode="full")
    empty, _ = load_policy(tiny_model_dir, mode="full", empty=True)
    assert all(t.is_meta for t in (*empty.parameters(), *empty.buffers()))
    assert empty.config.to_dict() == loaded.config.to_dict()
    assert empty.generation_config.to_dict() == loaded.generation_config.to_dict() and empty.training
    assert [(n, p.shape, p.dtype) for n, p in empty.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in loaded.named_parameters()]
    count = fuse_elementwise(loaded)
    assert fuse_elementwise(empty, names=fused_names(loaded)) == count and fused_names(empty) == fused_names(loaded)
    with pytest.raises(QerlError, match="only mode full"):
        load_policy(tiny_model_dir, mode="lora", lora=LoraSpec(r=2, alpha=4), empty=True)
