"""A rollout's dense copies of the FP4 weights: used at >= DENSE_COPY_MIN_ROWS inference rows only, same results."""
from __future__ import annotations

import torch
from peft import get_peft_model

from qerl.quant.dense_copies import attach_dense_copies, dense_copy_bytes, detach_dense_copies
from qerl.quant.grouped import group_projections, projections_fused, ungroup_projections
from qerl.quant.linear import DENSE_COPY_MIN_ROWS, FP4Linear
from qerl.quant.loader import load_quantized_model
from qerl.quant.lora import fp4_lora_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _layer(rows_out=48, rows_in=64):
    torch.manual_seed(0)
    return FP4Linear.from_linear(torch.nn.Linear(rows_in, rows_out, bias=True))


def test_layer_uses_its_copy_only_for_many_inference_rows():
    layer = _layer()
    many = torch.randn(DENSE_COPY_MIN_ROWS, 64)
    few = many[:DENSE_COPY_MIN_ROWS - 1]
    with torch.no_grad():
        ref_many, ref_few = layer(many), layer(few)
    assert attach_dense_copies(layer, [], torch.float32) == 48 * 64 * 4 == dense_copy_bytes(layer, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(layer(many), ref_many, rtol=1e-6, atol=1e-6)
        layer.dense_copy.zero_()  # from here a call that reads the copy returns only the bias
        assert torch.equal(layer(many), layer.bias.expand(DENSE_COPY_MIN_ROWS, 48))
        torch.testing.assert_close(layer(few), ref_few)  # too few rows: the FP4 path
    torch.testing.assert_close(layer(many), ref_many, rtol=1e-6, atol=1e-6)  # autograd on: the FP4 path
    assert layer(many.double()).dtype == torch.float64  # another dtype: the FP4 path
    detach_dense_copies(layer)
    assert "dense_copy" not in layer.__dict__ and "dense_copy" not in layer.state_dict()


def test_grouped_model_over_copies_equals_fp4_path(nvfp4_dir, monkeypatch):
    torch.manual_seed(0)
    model = get_peft_model(load_quantized_model(nvfp4_dir), fp4_lora_config(
        r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    ids = torch.randint(3, 1000, (2, (DENSE_COPY_MIN_ROWS + 1) // 2 + 3))
    with torch.no_grad():
        ref = model(ids).logits
        ref_short = model(ids[:, :8]).logits
    groups = group_projections(model)
    nbytes = attach_dense_copies(model, groups, torch.float32)
    assert nbytes == dense_copy_bytes(model, torch.float32) > 0
    q, k, _ = groups[0].members
    assert k.base_layer.dense_copy.data_ptr() == groups[0].dense.data_ptr() + q.base_layer.dense_copy.numel() * 4

    import qerl.quant.grouped as grouped_mod
    import qerl.quant.lora as lora_mod

    calls = []
    for mod in (grouped_mod, lora_mod):
        real = mod.fp4_lora_matmul
        monkeypatch.setattr(mod, "fp4_lora_matmul", lambda *a, real=real: calls.append(1) or real(*a))
    with torch.no_grad(), projections_fused(groups, torch.float32):
        got = model(ids).logits
        assert not calls  # every FP4 layer ran on its dense copy
        short = model(ids[:, :8]).logits
        assert calls  # 16 rows: the FP4 kernels
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(short, ref_short, rtol=1e-4, atol=1e-4)
    detach_dense_copies(model, groups)
    assert groups[0].dense is None
    assert not any("dense_copy" in m.__dict__ for m in model.modules() if isinstance(m, FP4Linear))
    attach_dense_copies(model, groups, torch.float32)
    ungroup_projections(groups)  # members get their own weights back and drop their views of the stacked copy
    assert not any("dense_copy" in m.base_layer.__dict__ for g in groups for m in g.members)
