"""Projection groups (q/k/v, gate/up as one stacked FP4 call at inference) against the separate layers."""
from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from qerl.quant.grouped import group_projections, projections_fused, ungroup_projections
from qerl.quant.loader import load_quantized_model
from qerl.quant.lora import FP4LoraLinear, fp4_lora_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.tensor([[5, 77, 1000, 31, 2, 640, 9, 12], [8, 1, 300, 4000, 12, 6, 90, 3]])


def _peft(nvfp4_dir, **overrides):
    torch.manual_seed(0)
    kwargs = dict(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False) | overrides
    return get_peft_model(load_quantized_model(nvfp4_dir), fp4_lora_config(**kwargs))


def _count_calls(monkeypatch):
    import qerl.quant.grouped as grouped_mod
    import qerl.quant.lora as lora_mod

    calls = []
    for mod in (grouped_mod, lora_mod):
        real = mod.fp4_lora_matmul
        monkeypatch.setattr(mod, "fp4_lora_matmul",
                            lambda *a, real=real, mod=mod: calls.append(mod.__name__) or real(*a))
    return calls


def test_grouped_inference_equals_separate_layers_in_fewer_calls(nvfp4_dir, monkeypatch):
    model = _peft(nvfp4_dir)
    layers = [m for m in model.modules() if isinstance(m, FP4LoraLinear)]
    with torch.no_grad():
        ref = model(IDS).logits
    before = {id(m): m.base_layer.weight_packed.clone() for m in layers}
    groups = group_projections(model)
    n_layers = len(model.base_model.model.model.layers)
    assert len(groups) == 4 * n_layers and [len(g.members) for g in groups[:4]] == [3, 1, 2, 1]  # qkv, o, gate|up, down
    q, k, v = groups[0].members
    o = groups[1].members[0]  # a group of one reads its own tensors: nothing stacked, nothing copied
    assert groups[1].stacked["weight_packed"].data_ptr() == o.base_layer.weight_packed.data_ptr()
    # members hold views of one stacked tensor: nothing copied twice, values unchanged
    stacked = groups[0].stacked["weight_packed"]
    assert k.base_layer.weight_packed.data_ptr() == stacked.data_ptr() + q.base_layer.weight_packed.numel()
    assert all(torch.equal(m.base_layer.weight_packed, before[id(m)]) for m in layers)

    calls = _count_calls(monkeypatch)
    with torch.no_grad(), projections_fused(groups, torch.float32):
        fused = model(IDS).logits
    # per layer: q|k|v and gate|up stacked, o and down groups of one = 4 calls instead of 7
    assert calls.count("qerl.quant.grouped") == 4 * n_layers and len(calls) == 4 * n_layers
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)

    calls.clear()
    with projections_fused(groups, torch.float32):  # autograd on: the training path, untouched
        out = model(IDS).logits
    assert not calls.count("qerl.quant.grouped")
    out.square().mean().backward()
    assert q.lora_B["default"].weight.grad is not None and k.lora_A["default"].weight.grad is not None
    with torch.no_grad():
        model(IDS)  # outside the context: separate layers
    assert not calls.count("qerl.quant.grouped")

    ungroup_projections(groups)
    assert all(torch.equal(m.base_layer.weight_packed, before[id(m)]) for m in layers)
    assert k.base_layer.weight_packed.data_ptr() != stacked.data_ptr() + q.base_layer.weight_packed.numel()
    assert o.base_layer.weight_packed.data_ptr() == groups[1].members[0].base_layer.weight_packed.data_ptr()
    assert not any("_qerl_group" in m.__dict__ for m in layers)


def test_adapter_changes_reach_the_stacked_copies(nvfp4_dir):
    model = _peft(nvfp4_dir)
    groups = group_projections(model)
    k = groups[0].members[1]
    with torch.no_grad():
        k.lora_B["default"].weight.mul_(3.0)  # a training step happened
        ref = model(IDS).logits
        with projections_fused(groups, torch.float32):
            fused = model(IDS).logits
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)


def test_a_different_input_or_order_computes_alone(nvfp4_dir):
    model = _peft(nvfp4_dir)
    group = group_projections(model)[0]
    q, k, v = group.members
    x = torch.randn(2, 3, q.in_features)
    with torch.no_grad(), projections_fused([group], torch.float32):
        ref_k = k.base_layer(x) + k.lora_B["default"](k.lora_A["default"](x)) * k.scaling["default"]
        torch.testing.assert_close(k(x), ref_k)  # k first: no stacked output to take from
        q(x)
        torch.testing.assert_close(k(x.clone()), ref_k)  # another tensor than q's input


@pytest.mark.parametrize("overrides,sizes", [
    (dict(rank_pattern={"k_proj": 8}), [1, 1, 1, 1, 2, 1]),  # k's rank differs: q, k, v one op each, gate|up stack
    # k and the MLP have no adapter: q and v alone, the plain gate|up stacked (plain o and down: no group)
    (dict(target_modules=["q_proj", "v_proj"]), [1, 1, 2]),
])
def test_incompatible_layers_stay_separate(nvfp4_dir, overrides, sizes):
    model = _peft(nvfp4_dir, **overrides)
    n_layers = len(model.base_model.model.model.layers)
    groups = group_projections(model)
    assert sorted(len(g.members) for g in groups) == sorted(sizes * n_layers)


@pytest.mark.parametrize("case", ["lora, torch engine", "plain, paged engine"])
def test_engine_decodes_the_same_tokens_with_groups(nvfp4_dir, tiny_model_dir, case):
    """Greedy tokens and log-probs with projection groups equal those of the separate layers: FP4 + LoRA (4 groups
    a layer) on the static engine, and an FP4 checkpoint without adapters, an evaluation (q|k|v and gate|up: 2 a
    layer), on the paged engine."""
    from transformers import AutoTokenizer

    from qerl.rollout import SamplingParams
    from qerl.rollout.paged_engine import PagedEngine
    from qerl.rollout.torch_engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(t)["input_ids"] for t in ("2+2=", "The quick brown fox jumps")]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    lora = case.startswith("lora")
    model, engine_class = (_peft(nvfp4_dir), TorchEngine) if lora else (load_quantized_model(nvfp4_dir), PagedEngine)
    layers = len((model.base_model.model if lora else model).model.layers)
    ref = engine_class(model, tok, eos_token_ids=(), fuse_projections=False).generate(prompts, 2, greedy)
    engine = engine_class(model, tok, eos_token_ids=(), fuse_projections=True)
    out = engine.generate(prompts, 2, greedy)
    assert out.stats["projection_groups"] == (4 if lora else 2) * layers
    assert out.completion_ids == ref.completion_ids
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), rtol=1e-4, atol=1e-4)
    engine.close()
    assert not any("_qerl_group" in m.__dict__ for m in model.modules())


def test_dense_lora_layers_group_the_same_way(tiny_model_dir):
    """peft LoRA over nn.Linear (the bf16 baseline's layers): stacked weight, one x @ A.T, block-diagonal B."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    with torch.no_grad():
        ref = model(IDS).logits
    assert group_projections(model, kinds=("fp4",)) == []  # what TorchEngine's "auto" asks for
    groups = group_projections(model)
    n_layers = len(model.base_model.model.model.layers)
    assert len(groups) == 4 * n_layers and {g.kind for g in groups} == {"dense"}
    q, k, _ = groups[0].members
    assert k.base_layer.weight.data_ptr() == q.base_layer.weight.data_ptr() + q.base_layer.weight.numel() * 4
    calls = []
    real = groups[0]._stacked_forward
    groups[0]._stacked_forward = lambda x: calls.append(1) or real(x)
    with torch.no_grad(), projections_fused(groups, torch.float32):
        fused = model(IDS).logits
    assert calls == [1]
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    with projections_fused(groups, torch.float32):
        model(IDS).logits.square().mean().backward()  # training: peft's own forward, gradients flow
    assert k.lora_A["default"].weight.grad is not None
    ungroup_projections(groups)
    assert "forward" not in k.__dict__ and not any("_qerl_group" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref)


@pytest.mark.parametrize("kind", ["fp4", "dense", "fp4 plain", "dense plain"])
def test_dynamo_traces_the_group_protocol_without_breaks(nvfp4_dir, tiny_model_dir, kind):
    """torch.compile sees one stacked op per group and no graph break (the engine compiles its decode step)."""
    import torch._dynamo

    from transformers import AutoModelForCausalLM

    if kind == "fp4":
        model = _peft(nvfp4_dir)
    elif kind == "fp4 plain":
        model = load_quantized_model(nvfp4_dir)
    else:
        from peft import LoraConfig

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        if kind == "dense":
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                     init_lora_weights=False))
        else:
            model.requires_grad_(False)  # a checkpoint evaluated: plain projections stack only when frozen
    layer = (model.base_model.model if kind in ("fp4", "dense") else model).model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp

    def projections(x):
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)

    x = torch.randn(2, 3, attn.q_proj.in_features)
    with torch.no_grad():
        ref = projections(x)
    groups = group_projections(model)
    torch._dynamo.reset()
    with torch.no_grad(), projections_fused(groups, torch.float32):
        explanation = torch._dynamo.explain(projections)(x)
        out = torch.compile(projections, backend="eager", fullgraph=True)(x)
    assert explanation.graph_break_count == 0
    targets = [str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"]
    stacked = {"fp4": "qerl.fp4_lora_matmul", "dense": "qerl.dense_lora_matmul", "fp4 plain": "qerl.fp4_lora_matmul",
               "dense plain": "linear"}[kind]
    assert sum(stacked in t for t in targets) == 2  # q|k|v and gate|up, not five layers
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ungroup_projections(groups)


@pytest.mark.gpu
def test_bf16_lora_graph_engine_groups_dense_projections(tmp_path, tokenizer_dir):
    """The default CUDA engine (graph + torch.compile) stacks a bf16 peft LoRA model's q/k/v and gate/up and
    decodes the tokens of the same engine without groups (weights of std 0.2: peaked logits, no near-ties for
    bf16 rounding to flip)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.resources import build_tiny_model
    from qerl.rollout import SamplingParams
    from qerl.rollout.torch_engine import TorchEngine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    build_tiny_model(tmp_path, tokenizer_dir, seed=0, initializer_range=0.2)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False))
    prompts = [tok(t)["input_ids"] for t in ("2+2=", "The quick brown fox jumps")]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    ref_engine = TorchEngine(model, tok, eos_token_ids=(), fuse_projections=False)
    ref = ref_engine.generate(prompts, 2, greedy)
    ref_engine.close()
    engine = TorchEngine(model, tok, eos_token_ids=())
    outs = [engine.generate(prompts, 2, greedy) for _ in range(2)]
    assert engine.use_cuda_graph and engine.use_compile
    assert outs[1].stats["projection_groups"] == 4 * len(model.base_model.model.model.layers)
    assert outs[1].stats["graph_captures"] == 1 and outs[1].stats["graph_replays"] > 0
    assert outs[0].completion_ids == outs[1].completion_ids == ref.completion_ids
    engine.close()


def test_a_second_engine_on_a_grouped_model_warns_and_groups_once_the_first_is_closed(tokenizer_dir):
    """Projection groups belong to one engine at a time: a second engine on the same model gets none (its forwards
    would run every projection apart) and says so; once the first is closed, the second groups them."""
    from bench.paged import build_lora_model
    from transformers import AutoTokenizer

    from qerl.rollout.paged_engine import PagedEngine

    model = build_lora_model("tiny", "bf16", 4, 0, "cpu").float()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    first = PagedEngine(model, tok, fuse_projections=True, eos_token_ids=())
    assert len(first._groups) == 4 * 2  # q/k/v, o, gate/up and down of 2 layers
    with pytest.warns(UserWarning, match="8 projection groups .* belong to another engine"):
        second = PagedEngine(model, tok, fuse_projections=True, eos_token_ids=())
    assert second._groups == []
    first.close()
    assert second.fuse_projections() == 8


@pytest.mark.parametrize("kind", ["fp4", "dense"])
def test_plain_projections_stack_too(nvfp4_dir, tiny_model_dir, kind):
    """A model without adapters (an evaluated checkpoint): q|k|v and gate|up stacked, o and down left alone; the
    same logits as the separate layers in two stacked calls per layer; training untouched; ungrouped as before."""
    from transformers import AutoModelForCausalLM

    from qerl.quant.linear import FP4Linear

    model = (load_quantized_model(nvfp4_dir) if kind == "fp4"
             else AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32))
    if kind == "dense":  # trained weights are never stacked (the optimizer and checkpoints hold them); frozen ones are
        assert group_projections(model) == []
        model.requires_grad_(False)
    assert group_projections(model, plain=False) == []  # the trainer's rollouts: LoRA layers only
    plain = FP4Linear if kind == "fp4" else torch.nn.Linear
    layers = [m for n, m in model.named_modules() if isinstance(m, plain) and n.rsplit(".", 1)[-1] in TARGETS]
    before = {id(m): (m.weight_packed if kind == "fp4" else m.weight).clone() for m in layers}
    with torch.no_grad():
        ref = model(IDS).logits
    groups = group_projections(model)
    n_layers = len(model.model.layers)
    assert len(groups) == 2 * n_layers and [len(g.members) for g in groups[:2]] == [3, 2]
    assert {g.kind for g in groups} == {kind} and not any(g.lora for g in groups)
    calls = []
    for g in groups:
        real = g._stacked_forward
        g._stacked_forward = lambda x, real=real: calls.append(1) or real(x)
    with torch.no_grad(), projections_fused(groups, torch.float32):
        fused = model(IDS).logits
    assert len(calls) == 2 * n_layers
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    calls.clear()
    with torch.no_grad(), projections_fused(groups, torch.float64):  # x in another dtype: each layer alone
        model(IDS)
    assert not calls
    with projections_fused(groups, torch.float32):
        model(IDS)  # autograd on: each layer alone
    assert not calls
    ungroup_projections(groups)
    assert all(torch.equal(m.weight_packed if kind == "fp4" else m.weight, before[id(m)]) for m in layers)
    assert not any("forward" in m.__dict__ or "_qerl_group" in m.__dict__ for m in layers)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref)
