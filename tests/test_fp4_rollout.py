"""train.rollout.weights nvfp4 (qerl.fp4_rollout): mode full on several ranks rolls out on an NVFP4 copy of the
current weights. The copy's packed bytes are the quantize stage's (llmcompressor's, fused global scales included)
and, under FSDP2 on 2 gloo ranks, those of quantizing each whole gathered weight; a refresh after an update
rewrites them in place; a 2-rank train step runs on it; the config asks for TIS; the memory estimate counts it."""
from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from qerl.errors import QerlError
from test_distributed import _cmd, _env, _history, _run_ranks
from test_fsdp import _full_config, task  # noqa: F401  (task: the module fixture of the demo task)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_the_copy_holds_what_the_quantize_stage_writes(nvfp4_dir, tiny_model_dir):
    """One process, plain tensors: every decoder-layer Linear packed exactly as llmcompressor's NVFP4 recipe packs
    it (q/k/v and gate/up share a global scale there too); embeddings, norms and the tied lm_head stay dense."""
    from transformers import Qwen2ForCausalLM

    from qerl.fp4_rollout import FP4RolloutCopy
    from qerl.quant.linear import FP4Linear

    model = Qwen2ForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    copy = FP4RolloutCopy(model, torch.device("cpu"))
    copy.bind_buffers(model)
    copy.gather(model)
    saved = load_file(str(nvfp4_dir / "model.safetensors"))
    fp4 = {n: m for n, m in copy.module.named_modules() if isinstance(m, FP4Linear)}
    assert len(fp4) == 14 and {f"{n}.weight_packed" for n in fp4} == {k for k in saved if k.endswith("_packed")}
    for name, m in fp4.items():
        for key in ("weight_packed", "weight_scale", "weight_global_scale"):
            assert torch.equal(_u8(getattr(m, key)), _u8(saved[f"{name}.{key}"])), f"{name}.{key}"
    q, k = fp4["model.layers.0.self_attn.q_proj"], fp4["model.layers.0.self_attn.k_proj"]
    assert torch.equal(q.weight_global_scale, k.weight_global_scale)  # fused, as vLLM requires
    plain = dict(copy.module.named_parameters())
    assert "lm_head.weight" not in plain and copy.module.lm_head.weight is copy.module.model.embed_tokens.weight
    for name, p in model.named_parameters():
        if name in plain:
            assert torch.equal(plain[name], p), name
    assert {n.rsplit(".", 1)[0] for n in plain if n.endswith(".weight")} == {
        "model.embed_tokens", "model.norm", *(f"model.layers.{i}.{norm}" for i in range(2)
                                              for norm in ("input_layernorm", "post_attention_layernorm"))}


SHARDED_FP4 = """
import json, torch
from qerl.distributed import close, init_ranks
from qerl.fsdp import FullySharded
from qerl.grpo import token_logprobs
from qerl.quant.format import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from qerl.quant.linear import FP4Linear
from qerl.resources import tiny_qwen2_config
from transformers import Qwen2ForCausalLM

ranks = init_ranks(2)
torch.manual_seed(0)
model = Qwen2ForCausalLM(tiny_qwen2_config(256)).float()
par = FullySharded(model, ranks, rollout_weights="nvfp4")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **par.optimizer_options())
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
MLP = ("gate_proj", "up_proj", "down_proj")

def expected():
    # the whole weights gathered from the shards; each group's global scale from their concatenation, each weight
    # quantized whole (the copy takes a chunk of rows at a time and stacks the members' maxima)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    out = {}
    for i in range(2):
        for group in GROUPS:
            names = [f"model.layers.{i}.{'mlp' if g in MLP else 'self_attn'}.{g}" for g in group]
            gs = nvfp4_global_scale(torch.cat([full[n + ".weight"] for n in names]))
            for n in names:
                out[n] = (quantize_nvfp4(full[n + ".weight"], gs), full[n + ".weight"])
    return full, out

def check(plain):
    full, want = expected()
    fp4 = {n: m for n, m in plain.named_modules() if isinstance(m, FP4Linear)}
    exact = sorted(fp4) == sorted(want) and all(
        torch.equal(m.weight_packed, want[n][0][0])
        and torch.equal(m.weight_scale.view(torch.uint8), want[n][0][1].view(torch.uint8))
        and torch.equal(m.weight_global_scale, want[n][0][2]) for n, m in fp4.items())
    # the dequantized weight in float64 against the same quantize -> dequantize of the whole weight
    deq = max(float((m.dequantize_weight(torch.float64) - dequantize_nvfp4(*want[n][0], dtype=torch.float64)).abs().max())
              for n, m in fp4.items())
    rel = [float((m.dequantize_weight(torch.float64) - want[n][1].double()).norm() / want[n][1].double().norm())
           for n, m in fp4.items()]
    dense = max(float((p - full[n]).abs().max()) for n, p in plain.named_parameters())
    packed = {n: m.weight_packed.clone() for n, m in fp4.items()}
    return {"exact": exact, "deq": deq, "rel_min": min(rel), "rel_max": max(rel), "dense": dense}, packed

def addresses(plain):
    return [t.data_ptr() for t in (*plain.parameters(), *plain.buffers())]

with par.gathered() as plain:
    first, packed_1 = check(plain)
    ptrs_1 = addresses(plain)
    tied = plain.lm_head.weight is plain.model.embed_tokens.weight
kept = sum(p.untyped_storage().nbytes() for p in par.rollout_model.parameters())
ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
rows = slice(0, 2) if ranks.rank == 0 else slice(2, 4)
loss = par.run(lambda: (-token_logprobs(model, ids[rows], torch.ones_like(ids[rows]), 6, chunk_size=5)[0].sum(),))[0]
loss.backward()
par.reduce_and_clip(list(model.parameters()), 1.0)
opt.step()
with par.gathered() as plain:
    second, packed_2 = check(plain)
    same_place = addresses(plain) == ptrs_1
changed = sum(not torch.equal(packed_1[n], packed_2[n]) for n in packed_1)
print(json.dumps({"first": first, "second": second, "same_place": same_place, "changed": changed,
                  "layers": len(packed_1), "tied": tied, "kept": kept, "loss": float(loss)}))
close(ranks)
"""


def test_two_ranks_quantize_the_gathered_weights_and_refresh_them_in_place():
    results = _run_ranks(SHARDED_FP4, timeout=240)
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    for r in results:
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["layers"] == 14 and got["tied"] and got["kept"] > 0  # the copy stays through the update
        for when in ("first", "second"):
            g = got[when]
            assert g["exact"] and g["deq"] == 0.0 and g["dense"] == 0.0, (when, g)
            assert 0.02 < g["rel_min"] <= g["rel_max"] < 0.2, (when, g)  # 4-bit: quantized, not a plain copy
        assert got["same_place"], "a refresh moved the copy's storage (captured graphs would read stale memory)"
        assert got["changed"] == 14, "the refresh after the update did not rewrite every packed weight"
        assert math.isfinite(got["loss"])


@pytest.mark.slow  # ~50 s on 2 CPU cores: the train stage under torchrun
def test_a_two_rank_step_rolls_out_on_the_fp4_copy(tiny_model_dir, task, tmp_path):  # noqa: F811
    """The train stage, mode full on 2 ranks, rolls out on the NVFP4 copy: the step's loss is finite and the
    rollout's log-probs differ from the trained float32 policy's by what 4-bit weights make (without AQN noise,
    the bf16/fp32 gathered copy gives ~1e-7)."""
    cfg = {**_full_config(task, 2), "max_steps": 1, "aqn": None, "rollout": {"weights": "nvfp4"}}
    proc = subprocess.run(_cmd(2, tiny_model_dir, tmp_path / "out", tmp_path / "ck", tmp_path / "res", cfg),
                          env=_env(task), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (step,) = _history(tmp_path / "out")
    assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    assert step["sampling/sampling_logp_difference/mean"] > 1e-3


# ------------------------------------------------------------------ the config and the memory estimate
def _train(**kw):
    from qerl.config import parse_section

    return parse_section("train", {"data": {"source": "x"}, "mode": "full", "num_gpus": 2, "batch_size": 8,
                                   "rollout_correction": "tis", **kw})


@pytest.mark.parametrize("kw, message", [
    ({"mode": "lora"}, "rollout.weights nvfp4 is for mode full on several GPUs"),
    ({"num_gpus": 1}, "rollout.weights nvfp4 is for mode full on several GPUs"),
    ({"rollout_correction": "none"}, "rollout.weights nvfp4 needs rollout_correction: tis"),
])
def test_nvfp4_rollouts_need_sharded_full_training_and_tis(kw, message):
    assert _train(rollout={"weights": "nvfp4"}).rollout.weights == "nvfp4"
    assert _train(**kw).rollout.weights == "policy"  # the default: today's rollouts, wherever
    with pytest.raises(QerlError, match=message):
        _train(rollout={"weights": "nvfp4"}, **kw)


def test_the_estimate_counts_the_rollout_copy_at_nvfp4_size():
    from qerl.memory import SHAPES, gpus_needed, rank_memory_gib

    shape, gib = SHAPES["32B"], 2**30
    common = dict(max_prompt_length=1024, max_completion_length=8192, num_generations=16, batch_size=128,
                  micro_batch_size=4, gradient_checkpointing=True, offload_activations=True, dtype="bfloat16",
                  rollout={"engine": "paged", "gpu_memory_utilization": 0.85})
    bf16, fp4 = (_train(**{**common, "rollout": {**common["rollout"], "weights": w}}) for w in ("policy", "nvfp4"))
    a, b = (rank_memory_gib(shape, "bf16", t, 8) for t in (bf16, fp4))
    whole = (shape.linear_params + shape.embedding_params) * 2 / gib
    assert a["gathered"] == pytest.approx(whole) and a["fp4_copy"] == 0  # 61 GiB: the whole bf16 model
    assert b["fp4_copy"] == pytest.approx((shape.linear_params * 0.5625 + shape.embedding_params * 2) / gib)
    assert 18 < b["fp4_copy"] < 20 and b["gathered"] < 2  # 4.5 bits a weight + bf16 embeddings; one tensor gathered
    grads = (shape.linear_params + shape.embedding_params) * 2 / 8 / gib  # freed while the engine rolls out
    both = b["weights"] + b["fp4_copy"] + b["overhead"]  # the copy beside the update, not against it
    assert b["update_total"] == pytest.approx(both + b["activations"])
    assert b["rollout_total"] == pytest.approx(both - grads + b["gathered"])
    assert b["total"] == max(b["update_total"], b["rollout_total"])
    # the 32B row: the bf16 copy needs 2 nodes of 8 (its KV pool would not hold a row on 1); NVFP4 rollouts, one
    assert gpus_needed(shape, "bf16", bf16) == (2, 8) and gpus_needed(shape, "bf16", fp4) == (1, 8)
    assert rank_memory_gib(shape, "bf16", fp4, 8)["total"] < 80 < rank_memory_gib(shape, "bf16", bf16, 8)["total"]
