"""merge_adapter: FP4 base + LoRA + trained norms -> plain checkpoint that computes what the policy computed."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qerl.errors import QerlError
from qerl.merging import merge_adapter
from qerl.policy import LoraSpec, load_policy

IDS = torch.tensor([[5, 77, 1000, 31, 2, 640, 9, 12]])


def as_if_trained(model, out) -> None:
    """Give a fresh policy's LoRA and norm values non-trivial random moves (as after training), save its adapter
    and trained norms to `out`, and put it in eval mode."""
    from qerl.checkpoint import save_trained_norms

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * (0.05 if "lora_" in name else 0.1))
    model.save_pretrained(str(out))
    save_trained_norms(model, out)
    model.eval()


@pytest.fixture(scope="module")
def trained(nvfp4_dir, tmp_path_factory):
    """An FP4 policy with non-trivial LoRA and norm values (as after training), its adapter dir and logits."""
    torch.manual_seed(0)
    model, _ = load_policy(nvfp4_dir, mode="qlora_fp4", lora=LoraSpec(r=4, alpha=8), train_norms=True)
    out = tmp_path_factory.mktemp("adapter")
    as_if_trained(model, out)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return out, logits


def test_float32_merge_computes_the_policy_function(nvfp4_dir, trained, tmp_path):
    from transformers import AutoModelForCausalLM

    adapter_dir, policy_logits = trained
    report = merge_adapter(nvfp4_dir, adapter_dir, tmp_path, dtype=torch.float32)
    assert report["base_quantized"] and report["merged_layers"] == 14 and report["trained_norms_copied"] == 5
    assert report["max_abs_diff"] < 1e-6 * report["max_abs_weight"]  # float32 rounding only

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert not any("scale" in k or "packed" in k or "lora" in k for k in saved)
    assert (tmp_path / "tokenizer_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, policy_logits, rtol=1e-4, atol=1e-4)


def test_bf16_merge_report_bound_and_requantize(nvfp4_dir, trained, tmp_path):
    adapter_dir, _ = trained
    report = merge_adapter(nvfp4_dir, adapter_dir, tmp_path, requantize="nvfp4")
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    # one bf16 rounding of the float32 merge: at most half an ulp (2^-8 relative) of the largest weight
    assert 0 < report["max_abs_diff"] <= report["max_abs_weight"] * 2 ** -8
    norms = load_file(str(adapter_dir / "trained_norms.safetensors"))
    for name, value in norms.items():
        assert torch.equal(saved[name], value.to(torch.bfloat16))
    requant = json.loads((tmp_path / "requantized" / "config.json").read_text())
    assert requant["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert report["requantize"]["relative_weight_error"]["num_layers"] == 14


def test_dense_base_merge_and_errors(tiny_model_dir, tmp_path):
    torch.manual_seed(1)
    model, _ = load_policy(tiny_model_dir, mode="lora", lora=LoraSpec(r=2, alpha=2, target_modules=("v_proj",)))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(tmp_path / "adapter"))
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    report = merge_adapter(tiny_model_dir, tmp_path / "adapter", tmp_path / "merged", dtype=torch.float32)
    assert not report["base_quantized"] and report["merged_layers"] == 2 and report["trained_norms_copied"] == 0
    assert report["max_abs_diff"] < 1e-6
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(QerlError, match="adapter_config.json not found"):
        merge_adapter(tiny_model_dir, tmp_path, tmp_path / "x")
