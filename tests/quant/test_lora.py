"""peft LoRA on FP4Linear: numerics vs a dense peft model, standard adapter files, reload on FP4 and bf16."""
from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from qerl.quant.linear import FP4Linear
from qerl.quant.loader import load_quantized_model
from qerl.quant.lora import FP4LoraLinear, fp4_lora_config, load_fp4_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.tensor([[5, 77, 1000, 31, 2, 640, 9, 12], [8, 1, 300, 4000, 12, 6, 90, 3]])


def _lora_kwargs():
    # init_lora_weights=False: B random too, so the adapter changes the output from step 0
    return dict(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)


@pytest.fixture()
def fp4_peft(nvfp4_dir):
    torch.manual_seed(0)
    return get_peft_model(load_quantized_model(nvfp4_dir), fp4_lora_config(**_lora_kwargs()))


def _dense_twin(nvfp4_dir, tiny_model_dir, fp4_peft):
    """The same network as a dense float32 model (dequantized weights) with plain peft and copied LoRA weights."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    for name, module in fp4_peft.base_model.model.named_modules():
        if isinstance(module, FP4Linear):
            dense.get_submodule(name.removesuffix(".base_layer")).weight.data.copy_(module.dequantize_weight())
    twin = get_peft_model(dense, LoraConfig(**_lora_kwargs()))
    twin.load_state_dict({k: v for k, v in fp4_peft.state_dict().items() if "lora_" in k}, strict=False)
    return twin


def test_lora_wraps_fp4_layers_and_matches_dense_peft(fp4_peft, nvfp4_dir, tiny_model_dir):
    wrapped = [m for m in fp4_peft.modules() if isinstance(m, FP4LoraLinear)]
    assert len(wrapped) == 14
    trainable = [n for n, p in fp4_peft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert wrapped[0].lora_A["default"].weight.dtype == torch.float32

    twin = _dense_twin(nvfp4_dir, tiny_model_dir, fp4_peft)
    out, ref = fp4_peft(IDS).logits, twin(IDS).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.square().mean().backward()
    ref.square().mean().backward()
    grads = {n: p.grad for n, p in fp4_peft.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in twin.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-6)


def test_saved_adapter_is_standard_peft_and_loads_on_bf16_and_fp4(fp4_peft, nvfp4_dir, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    fp4_peft.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and sorted(cfg["target_modules"]) == sorted(TARGETS)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert len(saved) == 28 and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in saved)
    assert not any("base_layer" in k or "weight_packed" in k for k in saved)

    # plain peft onto a bf16 dense model of the same architecture
    bf16 = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    loaded = PeftModel.from_pretrained(bf16, str(tmp_path))
    sd = loaded.state_dict()
    for key, value in saved.items():
        key = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight",
                                                                                 ".lora_B.default.weight")
        assert torch.equal(sd[key], value.to(sd[key].dtype))  # peft keeps adapters in fp32 by default

    # and back onto a fresh FP4 model: same function
    again = load_fp4_adapter(load_quantized_model(nvfp4_dir), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(IDS).logits, fp4_peft(IDS).logits)
    assert not any(p.requires_grad for p in again.parameters())


def test_merge_in_place_is_refused(fp4_peft):
    with pytest.raises(NotImplementedError, match="merge_adapter"):
        fp4_peft.merge_and_unload()


def test_inference_forward_fuses_the_adapter_into_one_op(fp4_peft, monkeypatch):
    """Without autograd, with adapter weights in the activation dtype, each FP4 LoRA layer is one
    qerl::fp4_lora_matmul call (CUDA: LoRA B in the FP4 kernel's epilogue) with the same result as the separate
    modules; with autograd, dropout active or other dtypes it falls back to peft's path."""
    import qerl.quant.lora as lora_mod

    calls = []
    real = lora_mod.fp4_lora_matmul
    monkeypatch.setattr(lora_mod, "fp4_lora_matmul", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        fused = fp4_peft(IDS).logits
    assert len(calls) == 14
    calls.clear()
    with torch.enable_grad():
        ref = fp4_peft(IDS).logits
    assert not calls
    torch.testing.assert_close(fused, ref.detach(), rtol=1e-5, atol=1e-5)

    layer = next(m for m in fp4_peft.modules() if isinstance(m, FP4LoraLinear))
    x = torch.randn(3, layer.in_features)
    assert layer._fused_adapter(x.double()) is None  # adapter fp32, input fp64: peft's own casts
    layer.lora_dropout["default"] = torch.nn.Dropout(0.5)
    layer.lora_dropout["default"].train()
    with torch.no_grad():
        assert layer._fused_adapter(x) is None
        layer.lora_dropout["default"].eval()
        assert layer._fused_adapter(x) == "default"
        with fp4_peft.disable_adapter():
            assert layer._fused_adapter(x) is None
