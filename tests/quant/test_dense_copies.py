"""A rollout's dense copies of the FP4 weights: used at >= DENSE_COPY_MIN_ROWS inference rows on a GPU and at any
rows on the CPU, same results; CPU engines make them for one call when host memory allows."""
from __future__ import annotations

import torch
from peft import get_peft_model

from qerl.quant.dense_copies import (attach_dense_copies, dense_copy_bytes, detach_dense_copies,
                                     refresh_stale_copies)
from qerl.quant.grouped import group_projections, projections_fused, ungroup_projections
from qerl.quant.linear import DENSE_COPY_MIN_ROWS, FP4Linear, dense_copy_used
from qerl.quant.loader import load_quantized_model
from qerl.quant.lora import fp4_lora_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _layer(rows_out=48, rows_in=64):
    torch.manual_seed(0)
    return FP4Linear.from_linear(torch.nn.Linear(rows_in, rows_out, bias=True))


def test_a_gpu_reads_the_copy_from_many_rows_and_the_cpu_at_any_rows():
    assert not dense_copy_used("cuda", DENSE_COPY_MIN_ROWS - 1) and dense_copy_used("cuda", DENSE_COPY_MIN_ROWS)
    assert dense_copy_used("cpu", 1) and dense_copy_used("cpu", DENSE_COPY_MIN_ROWS)


def test_layer_uses_its_copy_for_inference_in_its_dtype_only():
    layer = _layer()
    many = torch.randn(DENSE_COPY_MIN_ROWS, 64)
    few = many[:3]
    with torch.no_grad():
        ref_many, ref_few = layer(many), layer(few)
    assert attach_dense_copies(layer, [], torch.float32) == 48 * 64 * 4 == dense_copy_bytes(layer, torch.float32)
    with torch.no_grad():
        assert torch.equal(layer(many), ref_many) and torch.equal(layer(few), ref_few)  # the reference's own GEMM
        layer.dense_copy.zero_()  # from here a call that reads the copy returns only the bias
        assert torch.equal(layer(many), layer.bias.expand(DENSE_COPY_MIN_ROWS, 48))
        assert torch.equal(layer(few), layer.bias.expand(3, 48))  # on the CPU at any rows
    assert torch.equal(layer(few.requires_grad_()), layer.bias.expand(3, 48))  # training: the copy at any rows
    assert layer(many.double()).dtype == torch.float64  # another dtype: the FP4 path
    detach_dense_copies(layer)
    assert "dense_copy" not in layer.__dict__ and "dense_copy" not in layer.state_dict()


def test_a_copy_kept_across_calls_follows_its_packed_weight_rewritten_in_place():
    """A resident engine keeps its dense copies across updates: a packed weight rewritten in place (a full run's
    NVFP4 rollout copy, every step) is re-dequantized into the same storage before the next rollout; an unchanged
    one is left alone."""
    from qerl.quant.format import quantize_nvfp4

    layer, other = _layer(), _layer(rows_out=32)
    model = torch.nn.ModuleList([layer, other])
    attach_dense_copies(model, [], torch.float32)
    ptr = layer.dense_copy.data_ptr()
    assert refresh_stale_copies(model) == 0
    new_w = torch.randn(48, 64, dtype=torch.float64)
    packed, scale, gscale = quantize_nvfp4(new_w)
    with torch.no_grad():
        layer.weight_packed.copy_(packed)
        layer.weight_scale.copy_(scale)
        layer.weight_global_scale.copy_(gscale.reshape(1))
    assert not torch.equal(layer.dense_copy, layer.dequantize_weight(torch.float32))  # stale
    assert refresh_stale_copies(model) == 1
    assert layer.dense_copy.data_ptr() == ptr and torch.equal(layer.dense_copy, layer.dequantize_weight(torch.float32))
    assert refresh_stale_copies(model) == 0


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
        assert not calls  # 16 rows: a GPU would run the FP4 kernels, the CPU reads its copies at any rows
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(short, ref_short, rtol=1e-4, atol=1e-4)
    detach_dense_copies(model, groups)
    assert groups[0].dense is None
    assert not any("dense_copy" in m.__dict__ for m in model.modules() if isinstance(m, FP4Linear))
    attach_dense_copies(model, groups, torch.float32)
    ungroup_projections(groups)  # members get their own weights back and drop their views of the stacked copy
    assert not any("dense_copy" in m.base_layer.__dict__ for g in groups for m in g.members)


def test_cpu_engines_roll_out_on_copies_made_for_the_call(nvfp4_dir, tiny_model_dir, monkeypatch):
    """On the CPU both engines dequantize each FP4 weight once per call (not once per forward), roll out the same
    rows as without the copies, and drop them when the call (TorchEngine) or the pool (PagedEngine) goes."""
    from transformers import AutoTokenizer

    import qerl.quant.dense_copies as dense_mod
    import qerl.quant.reference as reference_mod
    from qerl.rollout import SamplingParams
    from qerl.rollout.paged_engine import PagedEngine
    from qerl.rollout.torch_engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = get_peft_model(load_quantized_model(nvfp4_dir), fp4_lora_config(
        r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    prompts = [tok(t)["input_ids"] for t in ("2+2=", "Hello there, how are you", "The quick brown fox")]
    params = SamplingParams(temperature=0.9, max_tokens=6, seed=3)
    dequants = []
    real = reference_mod._dequant_rows
    monkeypatch.setattr(reference_mod, "_dequant_rows", lambda *a: dequants.append(1) or real(*a))
    for engine in (TorchEngine, PagedEngine):
        dequants.clear()
        fast = engine(model, tok, eos_token_ids=())
        got = fast.generate(prompts, 2, params)
        assert not dequants  # every FP4 call of the rollout read its copy
        if engine is PagedEngine:
            assert got.stats["dense_check_kept"] and got.stats["dense_copy_bytes"] > 0
            fast.release()
        else:
            assert got.stats["dense_copies"] == 1
        assert not any("dense_copy" in m.__dict__ for m in model.modules() if isinstance(m, FP4Linear))
        monkeypatch.setattr(dense_mod, "available_host_bytes", lambda: 0)  # no room: both engines dequantize
        ref = engine(model, tok, eos_token_ids=()).generate(prompts, 2, params)
        monkeypatch.undo()
        monkeypatch.setattr(reference_mod, "_dequant_rows", lambda *a: dequants.append(1) or real(*a))
        assert dequants  # the reference dequantized on every forward
        assert got.completion_ids == ref.completion_ids
        for a, b in zip(got.logprobs, ref.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_no_cpu_copies_when_they_would_take_over_a_quarter_of_the_free_host_memory(monkeypatch):
    import qerl.quant.dense_copies as dense_mod

    layer = _layer()
    need = dense_copy_bytes(layer, torch.float32)
    monkeypatch.setattr(dense_mod, "available_host_bytes", lambda: 4 * need - 1)
    with dense_mod.cpu_dense_copies(layer, [], torch.float32) as made:
        assert not made and "dense_copy" not in layer.__dict__
    monkeypatch.setattr(dense_mod, "available_host_bytes", lambda: 4 * need)
    with dense_mod.cpu_dense_copies(layer, [], torch.float32) as made:
        assert made and layer.dense_copy.shape == (48, 64)
    assert "dense_copy" not in layer.__dict__
    monkeypatch.undo()  # the real reader: a number on Linux
    assert dense_mod.available_host_bytes() > 0


def test_weights_made_under_inference_mode_are_keyed_by_address():
    """Inference tensors keep no version counter: their copies are refreshed by address only, never an error."""
    with torch.inference_mode():
        layer = _layer()
    attach_dense_copies(layer, [], torch.float32)
    assert refresh_stale_copies(layer) == 0
